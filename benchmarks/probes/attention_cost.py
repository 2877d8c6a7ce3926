"""Probe: what exact (batch-invariant) attention costs a whole int8 step of the default model, against PyTorch's
fused attention (not exact), interleaved in one process (docs/benchmarks.md, "Exactness").

    python benchmarks/probes/attention_cost.py [--threads 2] [--rounds 8] [--context 200]

Three lean decoders over one int8 model: the compiled kernel (models/kernel.py, the default), its PyTorch-ops
fallback (integer sums, models/exact_attention.py) and fused attention. Each round times, for each decoder (the
order reversed every other round), 11 forwards of n new tokens after a prefilled random context and keeps the
median; the table gives the median over rounds, and a 300-token prefill. Prints the machine it ran on.
"""

import argparse
import statistics
import time

import torch

from speculate.bench.machine import summary
from speculate.models import kernel
from speculate.models.fast import FastKVModel
from speculate.models.loader import load_model

ROWS = (1, 2, 4, 8, 16)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--context", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(summary())
    loaded = load_model("smollm2-135m-instruct", dtype="int8", progress=False)
    context = torch.randint(0, 40000, (args.context,), generator=torch.Generator().manual_seed(0))
    models = {"kernel": FastKVModel(loaded), "fused": FastKVModel(loaded, exact=False)}
    real = kernel.load
    kernel.load = lambda: None  # the fallback, as where no C compiler works
    models["integer"] = FastKVModel(loaded)
    kernel.load = real
    assert [m.attention for m in models.values()] == ["kernel", "fused", "integer"]
    for kv in models.values():
        kv.reset(args.context + 400)
        kv.forward(context)
    times = {(m, n): [] for m in models for n in (*ROWS, "prefill")}
    for r in range(args.rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            kv = models[name]
            for n in ROWS:
                ts = []
                for _ in range(11):
                    kv.keep(args.context)
                    t = time.perf_counter()
                    kv.forward(context[:n])
                    ts.append(time.perf_counter() - t)
                times[name, n].append(statistics.median(ts))
            kv.keep(0)
            t = time.perf_counter()
            kv.forward(context[:300].repeat(2)[:300], last=1)
            times[name, "prefill"].append(time.perf_counter() - t)
            kv.keep(0)
            kv.forward(context)
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"{args.threads} threads, {args.rounds} rounds, context {args.context}; T(n) in ms, and over fused:")
    print("| attention | " + " | ".join(f"T({n})" for n in ROWS) + " | prefill 300 |")
    print("|---|" + "---|" * (len(ROWS) + 1))
    for name in models:
        cells = [f"{1e3 * med[name, n]:.1f} ({med[name, n] / med['fused', n]:.2f}x)" for n in (*ROWS, "prefill")]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
