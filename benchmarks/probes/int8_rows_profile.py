"""Probe: where the extra time of an 8-row int8 forward goes (T(8) against T(1)), by operator.

    python benchmarks/probes/int8_rows_profile.py [--threads 2]

The default model at int8 through the lean decoder (FastKVModel), 200 cached tokens, then 30 forwards of 1
and of 8 new tokens under torch.profiler; prints the self CPU time per forward of the operators whose time
grows most from 1 to 8 rows. Results in docs/benchmarks.md, "Other int8 kernels".
"""

import argparse

import torch
from torch.profiler import profile

from speculate.models.fast import FastKVModel
from speculate.models.loader import load_model


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kv = FastKVModel(load_model("smollm2-135m-instruct", dtype="int8", progress=False))
    context = torch.randint(0, 40000, (200,), generator=torch.Generator().manual_seed(0))
    kv.reset(512)
    kv.forward(context)
    per_op = {}
    for rows in (1, 8):
        for _ in range(5):  # warm-up
            kv.keep(200)
            kv.forward(context[:rows])
        with profile() as prof:
            for _ in range(30):
                kv.keep(200)
                kv.forward(context[:rows])
        per_op[rows] = {e.key: e.self_cpu_time_total / 30 for e in prof.key_averages()}
    total = {rows: sum(ops.values()) for rows, ops in per_op.items()}
    print(f"self CPU time per forward: 1 row {total[1] / 1e3:.2f} ms, 8 rows {total[8] / 1e3:.2f} ms "
          f"(profiled: slower than unprofiled)")
    grow = sorted(set(per_op[1]) | set(per_op[8]), key=lambda k: per_op[1].get(k, 0) - per_op[8].get(k, 0))
    print(f"{'operator':60s} {'1 row µs':>9s} {'8 rows µs':>9s} {'growth':>8s}")
    for key in grow[:12]:
        a, b = per_op[1].get(key, 0), per_op[8].get(key, 0)
        print(f"{key[:60]:60s} {a:9.0f} {b:9.0f} {b - a:8.0f}")


if __name__ == "__main__":
    main()
