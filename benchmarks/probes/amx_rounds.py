"""Probe: AMX's tile path (kernels/blocks.c, AMX) against the VNNI loops in batched greedy decoding, engine-level.

    python benchmarks/probes/amx_rounds.py [--model smollm2-135m-instruct] [--dtype q4] [--batch 8 16 32]
        [--tokens 64]

One process and one kernel library. For each batch size B, B generations of the first B MT-Bench first turns (each
prompt again past the 80th) run together through ``engine.step``, plain greedy decoding, as the server's scheduler
runs them; the tile path is switched on and off from round to round (``speculate_amx_enable``), so the machine's drift
falls on both alike. Printed per B: the median round with and without it, and their ratio; the prefill rounds and
the rounds where a generation ended are left out. The tokens are the same either way (an integer dot is exact whatever
sums it: tests/test_blocks.py checks both paths' bits against their arithmetic). Needs a CPU with AMX-INT8 that the OS
lets this process use; elsewhere it says so and stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="q4")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    import torch

    from speculate import SpeculativeDecoder, SpeculativeSpec, load_model
    from speculate.bench import machine_header
    from speculate.bench.serve_load import prompt_texts
    from speculate.models import kernel

    sys.path.insert(0, str(Path(__file__).parent))
    from batch_rounds import rounds

    torch.set_num_threads(2)
    print(machine_header()["machine"], flush=True)
    target = load_model(a.model, dtype=a.dtype, progress=False)
    if not kernel.amx_tiles():
        print("no AMX here (or the OS refused it): nothing to compare")
        return 1
    enable = kernel.function("lib").speculate_amx_enable
    decoder = SpeculativeDecoder(target, SpeculativeSpec("none"))
    decoder.generate("Hello", max_new_tokens=8)
    prompts = prompt_texts("mt_bench", 80)

    def switch(i: int) -> bool:  # round i: the tile path on (even) or off (odd)
        enable(i % 2)
        return i % 2 == 0

    print(f"{a.model} at {target.dtype}, {a.tokens} tokens a generation; median round, ms:", flush=True)
    for b in a.batch:
        times = rounds(decoder, prompts, b, a.tokens, switch)
        enable(0)
        amx, vnni = statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3
        print(f"  B={b}: {len(times[True])} + {len(times[False])} rounds; VNNI {vnni:.2f}, AMX {amx:.2f}, "
              f"VNNI / AMX {vnni / amx:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
