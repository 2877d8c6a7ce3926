"""Probe: the default model's step cost T(n) at fp32, int8 and q4 (or --dtypes), interleaved in one process (docs/benchmarks.md,
"Verification cost T(n)" and "Step cost": the verification curve T(n)/T(1) and int8 against fp32).

    python benchmarks/probes/step_curve.py [--threads 2] [--rounds 10] [--dtypes fp32,int8,q4] [--rows 1,2,4,8,16]

Also the machine's read bandwidth (a 2-thread ``torch.sum`` over 1 GiB, at the threads asked for) and, per precision,
the weights a one-row step reads ÷ T(1): how near a decode step runs to that roof (issue 41).

``fp32-torch`` (``bf16-torch``) in --dtypes is fp32 (bf16) with PyTorch's linear layers (what they ran before they
went through the kernel's float layers: models/fast.py, float_kernel), to compare the two in one process.

Both precisions through the lean decoder (FastKVModel, what the engine uses), a 200-token random context
prefilled once; each round times, for each precision (their order alternating by round) and each n, 15
forwards over n new tokens (every row's logits, as a verification) and keeps the median; the table gives the
median over rounds. ``speculate calc --profile`` measures one precision's curve the same way, for --k auto.
"""

import argparse
import statistics
import time

import torch

from unittest import mock

from torch import nn

from speculate.models import fast
from speculate.models.quantize import QuantizedLinear
from speculate.models.fast import FastKVModel
from speculate.models.loader import load_model


def lean(dtype: str) -> FastKVModel:
    loaded = load_model("smollm2-135m-instruct", dtype=dtype.removesuffix("-torch"), progress=False)
    if not dtype.endswith("-torch"):
        return FastKVModel(loaded)
    with mock.patch.object(fast, "float_kernel", lambda model: False):  # its lean model, made here, keeps F.linear
        return FastKVModel(loaded)


def weight_bytes(kv: FastKVModel) -> int:
    """The linear layers' weights a one-row step reads (the LM head included; a tied one once)."""
    return sum(m.weight_bytes() if isinstance(m, QuantizedLinear) else m.weight.numel() * m.weight.element_size()
               for m in kv.loaded.model.modules() if isinstance(m, QuantizedLinear) or type(m) is nn.Linear)


def read_bandwidth() -> float:
    """GB/s of a torch.sum over 1 GiB (the median of 5, after one to warm up)."""
    big = torch.ones(1 << 28)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        big.sum()
        times.append(time.perf_counter() - t)
    return big.numel() * 4 / statistics.median(times[1:]) / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtypes", default="fp32,int8,q4")
    parser.add_argument("--rows", default="1,2,4,8,16", help="the n of T(n), comma-separated, starting at 1")
    args = parser.parse_args()
    rows = tuple(int(n) for n in args.rows.split(","))
    torch.set_num_threads(args.threads)
    context = torch.randint(0, 40000, (200,), generator=torch.Generator().manual_seed(0))
    models = {dtype: lean(dtype) for dtype in args.dtypes.split(",")}
    for kv in models.values():
        kv.reset(512)
        kv.forward(context)
    times = {(dtype, n): [] for dtype in models for n in rows}
    for r in range(args.rounds):
        for dtype in (list(models)[r % len(models):] + list(models)[: r % len(models)]):  # rotated by round
            kv = models[dtype]
            for n in rows:
                ts = []
                for _ in range(15):
                    kv.keep(200)
                    t = time.perf_counter()
                    kv.forward(context[:n])
                    ts.append(time.perf_counter() - t)
                times[dtype, n].append(statistics.median(ts))
    med = {key: statistics.median(v) for key, v in times.items()}
    print(f"{args.threads} threads, {args.rounds} rounds; T(1) and T(n)/T(1):")
    print("| | T(1) | " + " | ".join(f"T({n})/T(1)" for n in rows[1:]) + " |")
    for dtype in models:
        print(f"| {dtype} | {1e3 * med[dtype, 1]:.1f} ms | "
              + " | ".join(f"{med[dtype, n] / med[dtype, 1]:.2f}" for n in rows[1:]) + " |")
    roof = read_bandwidth()
    print(f"read bandwidth (torch.sum over 1 GiB, {args.threads} threads): {roof:.1f} GB/s")
    for dtype, kv in models.items():
        rate = weight_bytes(kv) / med[dtype, 1] / 1e9
        print(f"{dtype}: {weight_bytes(kv) / 1e6:.0f} MB of weights a step, {rate:.1f} GB/s at T(1) "
              f"({100 * rate / roof:.0f} % of the read bandwidth)")
    first = next(iter(models))
    for dtype in list(models)[1:]:  # each precision against the first, at one row
        ratios = sorted(a / b for a, b in zip(times[first, 1], times[dtype, 1]))
        print(f"{dtype} over {first} at one row: {med[first, 1] / med[dtype, 1]:.2f}x "
              f"(per round {ratios[0]:.2f}-{ratios[-1]:.2f})")


if __name__ == "__main__":
    main()
