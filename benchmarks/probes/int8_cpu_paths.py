"""Does the int8 conversion depend on the CPU's code path? Converts a model (quantize.quantize) under this
CPU's default kernels and under AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2), each in
a subprocess, and counts the int8 weights and fp32 tensors' entries that differ; also the largest relative
difference between the two paths' unrounded statistics. ``--old`` converts the way speculate did before
FORMAT 2: statistics from Hugging Face's fp32 forward, nothing rounded to a grid.

    python benchmarks/probes/int8_cpu_paths.py [--model smollm2-135m-instruct] [--old]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import torch

CHILD = r"""
import sys, torch
from speculate.models import load_model, quantize

model_name, out, old = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
raw = {}
real_grid = quantize._on_grid

def grid(x64, near=None):  # keep the unrounded values too
    raw[f"v{len(raw)}"] = x64.clone()
    return x64.float() if old else real_grid(x64, near)

def hf_fp32(model, sequences, near=None):  # the pre-FORMAT-2 calibration: Hugging Face's fp32 forward
    stats = quantize.hf_statistics(model, sequences)
    raw.update(stats)
    return {name: amax.float() for name, amax in stats.items()}

quantize._on_grid = grid
if old:
    quantize.calibrate = hf_fp32
m = load_model(model_name, dtype="fp32")
tensors = quantize.quantize(m.model, m.tokenizer)
torch.save({"tensors": tensors, "raw": raw, "path": torch.backends.cpu.get_cpu_capability()}, out)
"""


def convert(model: str, old: bool, env: dict, out: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, model, out, "1" if old else "0"],
                          env={**os.environ, **env}, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return torch.load(out, weights_only=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--old", action="store_true", help="the pre-FORMAT-2 conversion (fp32 statistics)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        here = convert(args.model, args.old, {}, f"{tmp}/a.pt")
        avx2 = convert(args.model, args.old, {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
                       f"{tmp}/b.pt")
    print(f"code paths: {here['path']} against {avx2['path']}; conversion: {'old (fp32)' if args.old else 'float64 + bf16 grid'}")
    int8_diff = int8_total = side_diff = side_total = 0
    for key, a in here["tensors"].items():
        b = avx2["tensors"][key]
        n = int((a != b).sum())
        if a.dtype == torch.int8:
            int8_diff, int8_total = int8_diff + n, int8_total + a.numel()
        else:
            side_diff, side_total = side_diff + n, side_total + a.numel()
    rel = max(float(((here["raw"][k] - avx2["raw"][k]).abs() / here["raw"][k].abs().clamp_min(1e-30)).max())
              for k in here["raw"])
    print(f"int8 weights that differ: {int8_diff:,} of {int8_total:,}")
    print(f"fp32 entries (scales, biases, smoothed norms) that differ: {side_diff:,} of {side_total:,}")
    print(f"largest relative difference of the unrounded statistics and s: {rel:.3g}")


if __name__ == "__main__":
    main()
