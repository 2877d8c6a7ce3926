"""Engine speed against Hugging Face, interleaved in one process (these machines are noisy: compare
methods round-robin on the same prompts and quote ratios, not absolute numbers).

    python -m speculate.bench.speed [--model M] [--max-new-tokens 128] [--repeats 2] [--out FILE.json]

Prompt sets: "copy" (repeat a paragraph, fix its typos) and "paraphrase" (simplify, summarize), reported
separately. Methods (greedy: each should produce the same tokens as HF generate — counted and reported;
a difference means a near-tie argmax flipped between batched and single-row kernels):
  hf_generate     model.generate(do_sample=False)
  none            our engine, no drafts (plain decoding)
  hf_lookup       model.generate(prompt_lookup_num_tokens=10)   (HF's prompt lookup)
  lookup          our engine, prompt lookup, k=6
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date

import torch

from ..engine import SpeculativeDecoder
from ..models import DEFAULT_MODEL, load_model
from ..models.cache import atomic_write_text
from ..text import encode_prompt

PARAGRAPHS = [
    "The city council met on Tuesday evening to discuss the proposed changes to the public transport network. "
    "After two hours of debate, the members agreed to extend the night bus service to the northern districts, "
    "to add three new stops near the hospital, and to review ticket prices again in the spring. Residents who "
    "attended the meeting said they welcomed the longer hours but worried about the cost of the new routes.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide into "
    "glucose and oxygen. It takes place mainly in the leaves, inside small structures called chloroplasts, "
    "which contain the green pigment chlorophyll. The glucose gives the plant energy to grow, and the oxygen "
    "is released into the air, where animals and people breathe it.",
    "Our support team is available from Monday to Friday, between nine in the morning and six in the evening. "
    "If you need help outside these hours, please send an email describing your problem, including your order "
    "number and a short description of what went wrong, and we will reply on the next working day.",
]
# Misspellings for the "fix the typos" prompts: the answer copies the paragraph almost word for word.
TYPOS = [("council", "councel"), ("debate", "debat"), ("hospital", "hospitel"), ("Residents", "Residnets"),
         ("Photosynthesis", "Photosynthesys"), ("sunlight", "sunligth"), ("structures", "structers"),
         ("available", "availabel"), ("morning", "mornign"), ("describing", "describeing")]


def _misspell(text: str) -> str:
    for right, wrong in TYPOS:
        text = text.replace(right, wrong)
    return text


PROMPT_SETS = {
    # The answer is (nearly) a copy of text in the prompt: what prompt lookup is for.
    "copy": [f"Repeat the following paragraph exactly:\n\n{p}" for p in PARAGRAPHS]
    + [f"Correct the spelling mistakes in the following text and write it out in full:\n\n{_misspell(p)}"
       for p in PARAGRAPHS],
    # The answer reuses the prompt's words but not its sentences: lookup helps far less.
    "paraphrase": [f"Rewrite the following paragraph in simpler words:\n\n{PARAGRAPHS[0]}",
                   f"Summarize the following paragraph in two sentences:\n\n{PARAGRAPHS[2]}"],
}


def copy_heavy_prompts() -> list[str]:
    return PROMPT_SETS["copy"]


def _hf(loaded, ids, max_new, **kw):
    out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=max_new, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


def run(model: str, max_new_tokens: int, repeats: int, k: int) -> dict:
    loaded = load_model(model)
    tok = loaded.tokenizer
    ours = {"none": SpeculativeDecoder(loaded, "none"), "lookup": SpeculativeDecoder(loaded, "lookup", "greedy", k=k)}
    methods = {
        "hf_generate": lambda ids: _hf(loaded, ids, max_new_tokens),
        "none": lambda ids: ours["none"].generate(ids, max_new_tokens=max_new_tokens).token_ids,
        "hf_lookup": lambda ids: _hf(loaded, ids, max_new_tokens, prompt_lookup_num_tokens=10),
        "lookup": lambda ids: ours["lookup"].generate(ids, max_new_tokens=max_new_tokens).token_ids,
    }
    order = list(methods)
    jobs = [(name, encode_prompt(tok, p)) for name, prompts in PROMPT_SETS.items() for p in prompts]
    methods["none"](jobs[0][1][:20])  # warm-up (first-call allocations)
    totals = {(s, m): [0, 0.0] for s in PROMPT_SETS for m in methods}  # tokens, seconds
    same = {m: 0 for m in methods}
    done = 0
    for r in range(repeats):
        for i, (set_name, ids) in enumerate(jobs):
            # Rotate the order each time so that no method always runs first or after the same neighbour.
            rot = (r * len(jobs) + i) % len(order)
            outs = {}
            for name in order[rot:] + order[:rot]:
                t0 = time.perf_counter()
                out = methods[name](ids)
                dt = time.perf_counter() - t0
                if tok.eos_token_id in out:  # HF keeps generating nothing after EOS; count up to it
                    out = out[: out.index(tok.eos_token_id) + 1]
                outs[name] = out
                totals[set_name, name][0] += len(out)
                totals[set_name, name][1] += dt
            for name in methods:
                same[name] += outs[name] == outs["hf_generate"]
            done += 1
            print(f"  {done}/{repeats * len(jobs)} prompts", file=sys.stderr)
    result = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads",
        "torch": torch.__version__,
        "model": model, "max_new_tokens": max_new_tokens, "repeats": repeats, "k": k,
        "identical_to_hf_generate": {m: f"{same[m]}/{done}" for m in methods if m != "hf_generate"},
        "sets": {},
    }
    for set_name in PROMPT_SETS:
        tps = {m: totals[set_name, m][0] / totals[set_name, m][1] for m in methods}
        result["sets"][set_name] = {
            "prompts": len(PROMPT_SETS[set_name]),
            "tokens_per_second": {m: round(v, 2) for m, v in tps.items()},
            "none / hf_generate": round(tps["none"] / tps["hf_generate"], 3),
            "lookup / none": round(tps["lookup"] / tps["none"], 3),
            "lookup / hf_lookup": round(tps["lookup"] / tps["hf_lookup"], 3),
            "hf_lookup / hf_generate": round(tps["hf_lookup"] / tps["hf_generate"], 3),
        }
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.speed", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--out", help="write the result as JSON here (atomically)")
    a = p.parse_args(argv)
    result = run(a.model, a.max_new_tokens, a.repeats, a.k)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        atomic_write_text(a.out, text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
