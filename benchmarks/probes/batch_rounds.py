"""Probe: the median round of batched greedy decoding, engine-level, at the batch sizes given: what a source tree's
kernels cost at load (docs/benchmarks.md, "AMX for the LM head").

    PYTHONPATH=TREE/src python benchmarks/probes/batch_rounds.py 1 8 16 32

For each B, B generations of the first MT-Bench first turns (again from the first past the last) run together through
``engine.step``, plain greedy decoding of 64 tokens, as the server's scheduler runs them; printed: JSON {B: the median
round in ms}, the prefill rounds and those where a generation ended left out. Run it under two trees in turn, several
times, to compare them (the machine drifts between processes: alternate them).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable


def rounds(decoder, prompts: list[str], batch: int, tokens: int, arm: Callable[[int], object] = lambda i: None) -> dict:
    """``batch`` greedy generations of ``prompts`` (from the first, again past the last) stepped together through
    ``engine.step``, plain decoding of ``tokens`` each; before round i, ``arm(i)`` (it may switch something) names its
    arm. Returns {arm: [seconds of each steady round]}: neither a prefill round nor one where a generation ended."""
    from speculate import engine

    runs = [decoder.start(prompts[i % len(prompts)], max_new_tokens=tokens, chat=True) for i in range(batch)]
    out: dict = {}
    i = 0
    while not all(r.done for r in runs):
        live = [r for r in runs if not r.done]
        steady = not any(r.prefilling for r in live)
        name = arm(i)
        t = time.perf_counter()
        engine.step(live, ks=[0] * len(live) if steady else None)  # (k = 0: the decoder drafts nothing anyway)
        dt = time.perf_counter() - t
        if steady and not any(r.done for r in live):
            out.setdefault(name, []).append(dt)
        i += 1
    return out


def main() -> int:
    import torch

    from speculate import SpeculativeDecoder, SpeculativeSpec, load_model
    from speculate.bench.serve_load import prompt_texts

    torch.set_num_threads(2)
    decoder = SpeculativeDecoder(load_model("smollm2-135m-instruct", dtype="q4", progress=False), SpeculativeSpec("none"))
    decoder.generate("Hello", max_new_tokens=8)  # (a first call's costs are not timed)
    prompts = prompt_texts("mt_bench", 80)
    print(json.dumps({b: statistics.median(rounds(decoder, prompts, b, 64)[None]) * 1e3
                      for b in (int(x) for x in sys.argv[1:])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
