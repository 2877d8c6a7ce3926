"""What q4's second activation pass costs one layer: the largest q4 layer under 100,000 outputs of SmolLM2-135M (its
LM head, Q8_0) and of the Qwen 1.5B (an MLP's gate and up, Q4_K), its kernel call (``BlockLinear._run``) with
``passes`` 1 (llama.cpp's 8-bit activations) and 2 (what q4 runs: ~16 bits), at 1-32 rows, interleaved; the median
of 3 x 30 calls each.

    python benchmarks/probes/layer_passes.py

Needs the Qwen 1.5B's wheels (``pip install -e '.[qwen]'``). Prints the machine first.
"""

from __future__ import annotations

import statistics
import time

import torch

from speculate.bench import machine_header
from speculate.models import load_model
from speculate.models.blocks import BlockLinear


def seconds(layer: BlockLinear, x: torch.Tensor, passes: int, calls: int = 30) -> float:
    """The median time of one kernel call of ``layer`` on ``x`` at ``passes`` (three untimed calls first)."""
    layer.passes = passes
    for _ in range(3):
        layer._run(x, None)
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        layer._run(x, None)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    print(machine_header()["machine"])
    for alias in ("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"):
        model = load_model(alias, dtype="q4", progress=False)
        layers = [m for m in model.model.modules() if isinstance(m, BlockLinear) and m.out_features < 100_000]
        layer = max(layers, key=lambda m: m.out_features * m.in_features)
        kept = layer.passes
        print(alias, layer.kind, layer.in_features, "->", layer.out_features)
        for rows in (1, 2, 4, 8, 16, 32):
            x = torch.randn(rows, layer.in_features)
            got = {2: [], 1: []}
            for _ in range(3):  # (the two settings in turn, so that a slow spell of the machine hits both)
                for passes in got:
                    got[passes].append(seconds(layer, x, passes))
            two, one = statistics.median(got[2]), statistics.median(got[1])
            print(f"  rows {rows:3d}: 2 passes {two * 1e3:7.3f} ms, 1 pass {one * 1e3:7.3f} ms, 2/1 = {two / one:.2f}")
        layer.passes = kept


if __name__ == "__main__":
    main()
