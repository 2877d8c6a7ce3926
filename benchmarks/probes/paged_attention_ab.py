"""Probe: the paged attention kernel (models/paged.py's block tables) against the contiguous one before it, bit for bit
and in time (docs/benchmarks.md, "A paged KV cache").

    python benchmarks/probes/paged_attention_ab.py --base CHECKOUT_BEFORE_THE_PAGED_CACHE [--threads 2]

Builds kernels/ of both checkouts, gives the old one its contiguous cache [kv heads, d, capacity] and the new one the
same keys and values in 64-position blocks laid out in memory in a shuffled order (kernel.pages), and times
speculate_attend on the default model's heads (9 / 3 KV, d 64) at several contexts and row counts, the two calls
interleaved (medians of 30). Says where the outputs' bits differ.
"""

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from speculate.models import kernel

KERNELS = "src/speculate/models/kernels"


def build(checkout: Path, out: Path) -> ctypes.CDLL:
    subprocess.run(["cc", *kernel.FLAGS, "-fopenmp", "-o", str(out),
                    *[str(checkout / KERNELS / name) for name in kernel.SOURCES], "-lm"], check=True)
    return ctypes.CDLL(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="a checkout from before the paged cache")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    with tempfile.TemporaryDirectory() as tmp:
        old = build(args.base, Path(tmp) / "old.so").speculate_attend
        new = build(Path(__file__).resolve().parents[2], Path(tmp) / "new.so").speculate_attend
        old.argtypes = [p, p, p, i64, p, i, i, i, i, i, f, p, i]  # (q, kt, v, capacity, allowed, ...)
        new.argtypes = kernel.SIGNATURES["speculate_attend"][1]  # (q, key blocks, value blocks, offset, blocks, ...)
        torch.manual_seed(0)
        capacity = 2048
        kt, v = torch.randn(3, 64, capacity), torch.randn(3, capacity, 64)
        pages = kernel.pages(kt, v, order=torch.randperm(capacity // kernel.KEYS).tolist())
        print(f"attention, 9 heads / 3 KV, d 64, {args.threads} threads: old (contiguous) / new (paged, shuffled "
              "blocks) µs, medians of 30")
        for context in (0, 200, 800, 1500):  # 0: a causal prefill of n rows
            cells = []
            for n in (1, 8, 64) if context else (128, 1000):
                length = context + n
                mask = kernel.mask(torch.ones(n, length, dtype=torch.bool).tril(context)) if n > 1 else None
                m = None if mask is None else mask.data_ptr()
                q, o1, o2 = torch.randn(n, 9, 64), torch.empty(n, 9, 64), torch.empty(n, 9, 64)
                t1, t2 = [], []
                for _ in range(30):
                    t = time.perf_counter()
                    old(q.data_ptr(), kt.data_ptr(), v.data_ptr(), capacity, m, n, 9, 3, 64, length, 0.125,
                        o1.data_ptr(), args.threads)
                    t1.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    new(q.data_ptr(), pages[2], pages[3], 0, len(pages[2]), m, n, 9, 3, 64, length, 0.125,
                        o2.data_ptr(), args.threads)
                    t2.append(time.perf_counter() - t)
                a, b = statistics.median(t1) * 1e6, statistics.median(t2) * 1e6
                same = "" if torch.equal(o1, o2) else " DIFFERENT BITS"
                cells.append(f"{n} rows {a:.0f} / {b:.0f} ({b / a:.2f}x){same}")
            print(f"  context {context}: " + " | ".join(cells))


if __name__ == "__main__":
    main()
