"""Engine speed against Hugging Face and across precisions, interleaved in one process (these machines
are noisy: compare methods round-robin on the same prompts and quote ratios, not absolute numbers).

    python -m speculate.bench.speed [--model M] [--dtypes fp32,int8] [--threads 1,2] [--max-new-tokens 128]
                                    [--repeats 2] [--k 6] [--out FILE.json]

Prompt sets: "copy" (repeat a paragraph, fix its typos) and "paraphrase" (simplify, summarize), reported
separately. Methods (greedy: each should produce the same tokens as HF generate at the same precision —
counted and reported; a difference means a near-tie argmax flipped between batched and single-row kernels):
  hf_generate     model.generate(do_sample=False)                 (first precision only)
  hf_lookup       model.generate(prompt_lookup_num_tokens=10)     (HF's prompt lookup; first precision only)
  none@D          our engine, no drafts (plain decoding), at precision D
  lookup@D        our engine, prompt lookup, k, at precision D

Engine overhead: for our methods, the time inside target forwards and inside the drafter is measured per
call (timers around ``KVModel.forward`` and the drafter's ``propose``/``update``); the rest of a
generation's wall time is the engine's own (verification, sampling, bookkeeping, detokenization) and is
reported as a share of the wall time and in ms per round.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import date
from functools import partial

import torch

from ..engine import SpeculativeDecoder
from ..spec import SpeculativeSpec
from ..models import DEFAULT_MODEL, load_model
from ..text import encode_prompt
from . import emit, machine_header, script

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


def _hf(loaded, ids, max_new, **kw):
    out = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                max_new_tokens=max_new, do_sample=False, **kw)
    return out[0, len(ids):].tolist()


class _Timed:
    """Our decoder with timers around the target forwards and the drafter: what is left is engine time."""

    def __init__(self, decoder: SpeculativeDecoder):
        self.decoder, self.model_seconds, self.drafter_seconds = decoder, 0.0, 0.0
        self.wall_seconds, self.rounds = 0.0, 0
        new_cache = decoder.new_cache

        def timed_cache():  # each generation's own cache, timed
            kv = new_cache()
            kv.forward = self._timer(kv.forward, "model_seconds")
            return kv

        decoder.new_cache = timed_cache
        # (One generation at a time: each drafts with the decoder's own drafter, SpeculativeDecoder.new_drafter.)
        decoder.drafter.propose = self._timer(decoder.drafter.propose, "drafter_seconds")
        decoder.drafter.update = self._timer(decoder.drafter.update, "drafter_seconds")

    def _timer(self, fn, field):
        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)
        return timed

    def __call__(self, ids, max_new_tokens):
        g = self.decoder.generate(ids, max_new_tokens=max_new_tokens)
        self.wall_seconds += g.stats.wall_seconds
        self.rounds += g.stats.target_calls
        return g.token_ids

    def overhead(self) -> dict:
        engine = self.wall_seconds - self.model_seconds - self.drafter_seconds
        return {"engine_share": round(engine / self.wall_seconds, 4),
                "engine_ms_per_round": round(1e3 * engine / max(self.rounds, 1), 3),
                "model_share": round(self.model_seconds / self.wall_seconds, 4),
                "drafter_share": round(self.drafter_seconds / self.wall_seconds, 4),
                "rounds": self.rounds}


def _at_threads(fn, n: int | None):
    """``fn`` run with ``n`` torch threads (None: as set)."""
    if n is None:
        return fn

    def call(*a, **k):
        torch.set_num_threads(n)
        return fn(*a, **k)
    return call


def run(model: str, max_new_tokens: int, repeats: int, k: int, dtypes: list[str] | tuple = ("fp32",),
        threads: list[int] | tuple = ()) -> dict:
    """``threads``: thread counts to compare, interleaved in this one process (our methods get a ``/Nt``
    suffix per count; HF's run at the largest); empty: as the process is set."""
    machine = machine_header()  # at the start: the threads and load as the run begins
    original_threads = torch.get_num_threads()
    loaded = {d: load_model(model, dtype=d) for d in dtypes}
    ref = loaded[dtypes[0]]
    tok = ref.tokenizer
    counts = list(threads) or [None]
    suffix = {n: f"/{n}t" if len(counts) > 1 else "" for n in counts}
    ours, at = {}, {}
    for n in counts:
        for d in dtypes:
            for kind, decoder in (("none", SpeculativeDecoder(loaded[d], SpeculativeSpec("none"))),
                                  ("lookup",
                                   SpeculativeDecoder(loaded[d], SpeculativeSpec("lookup", verifier="greedy", k=k)))):
                ours[f"{kind}@{d}{suffix[n]}"], at[f"{kind}@{d}{suffix[n]}"] = _Timed(decoder), n
    top = max(counts, key=lambda n: n or 0)
    methods = {"hf_generate": _at_threads(lambda ids: _hf(ref, ids, max_new_tokens), top),
               "hf_lookup": _at_threads(lambda ids: _hf(ref, ids, max_new_tokens, prompt_lookup_num_tokens=10), top)}
    methods.update({name: _at_threads(partial(timed, max_new_tokens=max_new_tokens), at[name])
                    for name, timed in ours.items()})
    order = list(methods)
    jobs = [(name, encode_prompt(tok, p)) for name, prompts in PROMPT_SETS.items() for p in prompts]
    for fn in methods.values():  # warm-up (first-call allocations), not timed
        fn(jobs[0][1][:20])
    for timed in ours.values():
        timed.model_seconds = timed.drafter_seconds = timed.wall_seconds = 0.0
        timed.rounds = 0
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
                precision = name.split("@")[1] if "@" in name else dtypes[0]
                reference = outs["hf_generate"] if precision.split("/")[0] == dtypes[0] else outs[f"none@{precision}"]
                same[name] += outs[name] == reference
            done += 1
            print(f"  {done}/{repeats * len(jobs)} prompts", file=sys.stderr)
    result = {
        "date": date.today().isoformat(), **machine, "torch": torch.__version__,
        "model": model, "dtypes": list(dtypes), "threads": list(threads) or torch.get_num_threads(),
        "max_new_tokens": max_new_tokens, "repeats": repeats, "k": k,
        "identical_to_reference": {m: f"{same[m]}/{done}" for m in methods if m != "hf_generate"},
        "reference": f"hf_generate for {dtypes[0]} and HF methods; none@D for the other precisions",
        "engine_overhead": {name: timed.overhead() for name, timed in ours.items()},
        "sets": {},
    }
    for set_name in PROMPT_SETS:
        tps = {m: totals[set_name, m][0] / totals[set_name, m][1] for m in methods}
        d0, t0 = dtypes[0], suffix[top]
        ratios = {f"none@{d0}{t0} / hf_generate": tps[f"none@{d0}{t0}"] / tps["hf_generate"],
                  f"lookup@{d0}{t0} / hf_lookup": tps[f"lookup@{d0}{t0}"] / tps["hf_lookup"],
                  "hf_lookup / hf_generate": tps["hf_lookup"] / tps["hf_generate"]}
        for n in counts:
            t = suffix[n]
            for d in dtypes:
                ratios[f"lookup@{d}{t} / none@{d}{t}"] = tps[f"lookup@{d}{t}"] / tps[f"none@{d}{t}"]
                if d != d0:
                    ratios[f"none@{d}{t} / none@{d0}{t}"] = tps[f"none@{d}{t}"] / tps[f"none@{d0}{t}"]
                if n != top:
                    for kind in ("none", "lookup"):
                        ratios[f"{kind}@{d}{suffix[top]} / {kind}@{d}{t}"] = \
                            tps[f"{kind}@{d}{suffix[top]}"] / tps[f"{kind}@{d}{t}"]
        result["sets"][set_name] = {"prompts": len(PROMPT_SETS[set_name]),
                                    "tokens_per_second": {m: round(v, 2) for m, v in tps.items()},
                                    **{name: round(v, 3) for name, v in ratios.items()}}
    torch.set_num_threads(original_threads)
    return result


def main(argv=None) -> int:
    from ..models import DTYPES

    p = argparse.ArgumentParser(prog="python -m speculate.bench.speed", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtypes", default="fp32", help="comma-separated precisions, the first is the HF reference "
                                                   f"(from {', '.join(DTYPES)}; default fp32)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--threads", default="", help="comma-separated torch thread counts to compare, interleaved "
                                                  "(e.g. 1,2; default: as the process is set)")
    p.add_argument("--out", help="write the result as JSON here (atomically)")
    a = p.parse_args(argv)
    try:
        threads = [int(t) for t in a.threads.split(",") if t.strip()]
    except ValueError:
        p.error("--threads: comma-separated integers")
    if any(t < 1 for t in threads):
        p.error("--threads: counts must be >= 1")
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        p.error(f"--dtypes: choose from {', '.join(DTYPES)}")
    return emit(run(a.model, a.max_new_tokens, a.repeats, a.k, dtypes, threads), a.out)


if __name__ == "__main__":
    sys.exit(script(main))
