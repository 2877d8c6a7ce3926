"""What a benchmark ran on: the one description that every run file's header records.

Tokens/s depend on the CPU far more than on the architecture's name: the ISA level torch dispatches to
(AVX2, AVX512), whether the matmuls have VNNI / AMX / bf16 instructions (int8 and bf16 speed), the BLAS
torch is built with, the cores and torch threads, and the environment overrides that cap any of these.
:func:`describe` collects them as a dict (``machine_info`` in a run file); :func:`summary` is its one line
(``machine``; also the bench report's heading), e.g. "Intel(R) Xeon(R) Processor, AVX512 + VNNI + BF16 +
AMX, MKL, 2 cores, 2 torch threads".
"""

from __future__ import annotations

import os
import platform
import re

# Environment variables that change which kernels run (or how many threads run them).
ENV_OVERRIDES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA",
                 "DNNL_MAX_CPU_ISA", "SPECULATE_KERNEL_FLAGS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
# The flags that matter for these kernels, as /proc/cpuinfo spells them.
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16",
         "avx512_fp16", "avx_ne_convert", "asimd", "bf16", "i8mm", "sve")
VENDORS = {"GenuineIntel": "Intel", "AuthenticAMD": "AMD", "CentaurHauls": "Centaur", "HygonGenuine": "Hygon"}
ARM_IMPLEMENTERS = {"0x41": "Arm", "0x61": "Apple", "0x51": "Qualcomm", "0xc0": "Ampere", "0x48": "HiSilicon",
                    "0x4e": "NVIDIA"}


def _blas(config: str) -> str:
    """The BLAS torch was built with, from ``torch.__config__.show()``."""
    m = re.search(r"BLAS_INFO=(\w+)", config)
    name = m.group(1).lower() if m else ""
    if name == "mkl" or (not name and "Math Kernel Library" in config):
        return "MKL"
    if name in ("open", "openblas") or (not name and "OpenBLAS" in config):  # OpenBLAS builds say "open"
        return "OpenBLAS"
    return {"accelerate": "Accelerate", "blis": "BLIS", "flexi": "FlexiBLAS"}.get(name, name or "unknown")


def _int8_activation_bits() -> int | None:
    """8, or 7 where the int8 kernel lacks VNNI (models/quantize.py, activation_levels); None: no int8 kernel."""
    from ..models import quantize

    try:
        return 8 if quantize.activation_levels() == 127 else 7
    except Exception:  # no fbgemm in this build, or a kernel exact at neither width: int8 will not load
        return None


def describe() -> dict:
    """The machine and torch setup (``"unknown"`` / None where this platform cannot say)."""
    import torch

    from ..models.cpu import cpu_flags, cpu_info, onednn_bf16

    info = cpu_info()
    flags = cpu_flags(info)
    model = info.get("model name") or info.get("Model") or info.get("Hardware") or platform.processor() \
        or platform.machine() or "unknown CPU"
    vendor = VENDORS.get(info.get("vendor_id", ""), info.get("vendor_id", "")) \
        or ARM_IMPLEMENTERS.get(info.get("CPU implementer", "").lower(), "")
    if not vendor:
        vendor = next((v for v in ("Intel", "AMD", "Apple", "Arm") if v.lower() in model.lower()), "") or "unknown"
    config = torch.__config__.show()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        load = None
    return {
        "cpu": model,
        "vendor": vendor,
        "arch": platform.machine() or "unknown",
        "cpu_id": " ".join(f"{k} {info[k]}" for k in ("cpu family", "model", "stepping") if k in info),
        "isa": torch.backends.cpu.get_cpu_capability(),  # what ATen's kernels dispatch to
        "vnni": bool(flags & {"avx512_vnni", "avx_vnni"}),
        "amx": bool(flags & {"amx_int8", "amx_bf16"}),
        "avx512_bf16": "avx512_bf16" in flags,
        "flags": [f for f in FLAGS if f in flags],
        "blas": _blas(config),
        "mkl": torch.backends.mkl.is_available(),
        "onednn": torch.backends.mkldnn.is_available(),
        "onednn_bf16": onednn_bf16(),  # torch's bf16 matmul goes to oneDNN (fast) or not (slow); None: unknown
        "int8_activation_bits": _int8_activation_bits(),  # 7 where fbgemm's kernel would saturate at 8
        "cores": os.cpu_count() or 0,
        "usable_cores": usable,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "env": {k: os.environ[k] for k in ENV_OVERRIDES if os.environ.get(k)},
        "load_average": load,  # at the start: other processes on these cores slow every parallel op
    }


def summary(info: dict | None = None) -> str:
    """One line: CPU, ISA + matmul extensions, BLAS, cores, threads, and any override or slow path."""
    d = describe() if info is None else info
    isa = [d["isa"]] + [name for name, on in (("VNNI", d["vnni"]), ("BF16", d["avx512_bf16"]), ("AMX", d["amx"]))
                        if on]
    parts = [d["cpu"], " + ".join(isa), d["blas"], f"{d['cores']} cores"]
    if d["usable_cores"] and d["usable_cores"] != d["cores"]:
        parts[-1] += f" ({d['usable_cores']} usable)"
    parts.append(f"{d['torch_threads']} torch threads")
    if d["onednn_bf16"] is False:
        parts.append("no fast bf16 matmul")
    if d.get("int8_activation_bits") == 7:  # (records from before it was recorded: 8)
        parts.append("7-bit int8 activations")
    line = ", ".join(parts)
    if d["env"]:
        line += "; " + " ".join(f"{k}={v}" for k, v in d["env"].items())
    return line


def header() -> dict:
    """The fields every run file's header carries: ``machine`` (the summary) and ``machine_info``."""
    info = describe()
    return {"machine": summary(info), "machine_info": info}
