"""Engine speed against Hugging Face, interleaved in one process (these machines are noisy: compare
methods round-robin on the same prompts and quote ratios, not absolute numbers).

    python -m speculate.bench.speed [--model M] [--max-new-tokens 128] [--repeats 2] [--out FILE.json]

Methods (greedy, so every method must produce the same tokens — checked and reported):
  hf_generate     model.generate(do_sample=False)
  none            our engine, no drafts (plain decoding)
  hf_lookup       model.generate(prompt_lookup_num_tokens=10)   (HF's prompt lookup)
  lookup          our engine, prompt lookup, k=6
"""

from __future__ import annotations

import argparse
import json
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
TASKS = ["Rewrite the following paragraph, correcting any mistakes and keeping its meaning:\n\n{}",
         "Repeat the following paragraph exactly:\n\n{}"]


def copy_heavy_prompts() -> list[str]:
    return [t.format(p) for p in PARAGRAPHS for t in TASKS]


def _hf(loaded, ids, max_new, **kw):
    out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=max_new, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


def run(model: str, max_new_tokens: int, repeats: int, k: int) -> dict:
    loaded = load_model(model)
    tok = loaded.tokenizer
    torch.manual_seed(0)
    ours = {"none": SpeculativeDecoder(loaded, "none"), "lookup": SpeculativeDecoder(loaded, "lookup", "greedy", k=k)}
    methods = {
        "hf_generate": lambda ids: _hf(loaded, ids, max_new_tokens),
        "none": lambda ids: ours["none"].generate(ids, max_new_tokens=max_new_tokens).token_ids,
        "hf_lookup": lambda ids: _hf(loaded, ids, max_new_tokens, prompt_lookup_num_tokens=10),
        "lookup": lambda ids: ours["lookup"].generate(ids, max_new_tokens=max_new_tokens).token_ids,
    }
    prompts = [encode_prompt(tok, p) for p in copy_heavy_prompts()]
    methods["none"](prompts[0][:20])  # warm-up (first-call allocations)
    totals = {m: {"tokens": 0, "seconds": 0.0} for m in methods}
    agree = {m: 0 for m in methods}
    order = list(methods)
    runs = 0
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            reference = None
            # Rotate the order each time so no method always runs first (or after the same neighbour).
            rot = (r * len(prompts) + i) % len(order)
            for name in order[rot:] + order[:rot]:
                t0 = time.perf_counter()
                out = methods[name](ids)
                dt = time.perf_counter() - t0
                eos = tok.eos_token_id
                if eos in out:  # HF keeps the EOS; count what each produced up to and including it
                    out = out[: out.index(eos) + 1]
                totals[name]["tokens"] += len(out)
                totals[name]["seconds"] += dt
                if name == "hf_generate":
                    reference = out
                agree[name] += out == reference if reference is not None else 0
            runs += 1
            print(f"  round {runs}/{repeats * len(prompts)} done", file=sys.stderr)
    tps = {m: v["tokens"] / v["seconds"] for m, v in totals.items()}
    return {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.processor() or ''}".strip(", "),
        "torch": torch.__version__,
        "model": model, "max_new_tokens": max_new_tokens, "repeats": repeats, "k": k, "prompts": len(prompts),
        "tokens_per_second": {m: round(v, 2) for m, v in tps.items()},
        "ratios": {
            "none / hf_generate": round(tps["none"] / tps["hf_generate"], 3),
            "lookup / none": round(tps["lookup"] / tps["none"], 3),
            "lookup / hf_lookup": round(tps["lookup"] / tps["hf_lookup"], 3),
            "hf_lookup / hf_generate": round(tps["hf_lookup"] / tps["hf_generate"], 3),
        },
        "runs_identical_to_hf_generate": {m: f"{agree[m]}/{runs}" for m in methods if m != "hf_generate"},
    }


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
