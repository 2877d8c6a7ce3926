"""Probe: what a drafted round costs outside the target forward, engine-level (issue 41: "price a drafted round's own
overhead").

    python benchmarks/probes/round_overhead.py [--model smollm2-135m-instruct] [--dtype auto] [--repeats 1]

One process, one generation at a time, driven round by round through ``engine.step`` as the server's scheduler drives
it. Three arms, in an order that rotates from prompt to prompt over the first 16 MT-Bench first turns (greedy, 128 new
tokens): ``none``, the plain decoder (``--drafter none``); ``auto`` at k = 0, the default drafter planned no draft (it
peeks); ``auto`` at k = 1. Each round is split into the drafter's proposal (``engine._propose``), the target forward
(``engine.forward_many``) and the rest (rows, verification, roll-back, commit); printed: the medians per arm and rows
per round. Medians of rounds interleaved within seconds: two server processes started one after the other differ by
more than what is compared here (``python -m speculate.bench.ab``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    import torch

    from speculate import SpeculativeDecoder, SpeculativeSpec, engine, load_model
    from speculate.bench import machine_header
    from speculate.bench.serve_load import prompt_texts

    sys.path.insert(0, str(Path(__file__).parent))
    from server_rounds import time_the_round

    torch.set_num_threads(2)
    print(machine_header()["machine"], flush=True)
    target = load_model(a.model, dtype=a.dtype, progress=False)
    decoders = {name: SpeculativeDecoder(target, SpeculativeSpec(name, k=6)) for name in ("none", "auto")}
    spent = {"propose": 0.0, "forward": 0.0}
    time_the_round(engine, spent)
    prompts = prompt_texts("mt_bench", 16)
    for d in decoders.values():
        d.generate("Hello", max_new_tokens=8)
    gc.collect()
    arms = [("none", 0), ("auto", 0), ("auto", 1)]
    rounds: dict = {}  # (arm, k, rows) -> [(round, propose, forward, rest)]
    for _ in range(a.repeats):
        for i, prompt in enumerate(prompts):
            for name, k in arms[i % 3:] + arms[:i % 3]:
                run = decoders[name].start(prompt, max_new_tokens=128, chat=True)
                first = True
                while not run.done:
                    spent["propose"] = spent["forward"] = 0.0
                    t = time.perf_counter()
                    engine.step([run], ks=None if run.prefilling else [k])
                    dt = time.perf_counter() - t
                    if not first and not run.done:  # (the prefill round and the last, which ends the run, left out)
                        rounds.setdefault((name, k, run.rows_last), []).append(
                            (dt, spent["propose"], spent["forward"], dt - spent["propose"] - spent["forward"]))
                    first = False
    print(f"{a.model} at {target.dtype}, {a.repeats} x 16 MT-Bench answers per arm; medians, ms:", flush=True)
    for (name, k, rows), v in sorted(rounds.items()):
        if len(v) >= 20:
            m = [statistics.median(x) * 1e3 for x in zip(*v)]
            print(f"  {name} k={k}, {rows} row{'s' * (rows > 1)}: {len(v)} rounds, round {m[0]:.2f}, proposal {m[1]:.3f}, "
                  f"forward {m[2]:.2f}, the rest {m[3]:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
