"""What this CPU is: /proc/cpuinfo's fields and flags, and whether torch's bf16 matmul has a fast kernel here.

Read by the loader (bf16 warnings), the kernels' build key (kernel.py) and every benchmark record's machine line
(bench/machine.py). Nothing here loads a model.
"""

from __future__ import annotations

import os

import torch

_CPU_INFO = None


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "vendor_id", "flags", ...); {} where
    there is no such file (macOS, Windows)."""
    global _CPU_INFO
    if _CPU_INFO is None:
        info = {}
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    if not line.strip():
                        if "flags" in info or "Features" in info:
                            break  # the first processor's block is enough (their flags are the same)
                        continue
                    key, _, value = line.partition(":")
                    info.setdefault(key.strip(), value.strip())
        except OSError:
            pass
        _CPU_INFO = info
    return _CPU_INFO


def cpu_flags(info: dict[str, str] | None = None) -> set[str]:
    """The CPU's feature flags (x86 "flags", Arm "Features" in /proc/cpuinfo); empty where unknown."""
    info = cpu_info() if info is None else info
    return set((info.get("flags") or info.get("Features") or "").split())


# oneDNN, which torch's bf16 matmuls (mm/addmm/linear) go to, has bf16 kernels from AVX-512 (avx512_core:
# bw/vl/dq; AVX512_BF16 and AMX-BF16 natively, emulated without) or from AVX2 with AVX-NE-CONVERT and
# AVX-VNNI-INT8 (avx2_vnni_2); Arm needs the BF16 extension. Without them torch falls back to its generic
# bf16 kernels: only a one-row product (a plain decode step) has a vectorised one, so a prompt's prefill and
# every multi-token verification run several times slower than fp32 (with oneDNN capped at AVX2 on an AMX
# Xeon: 64 rows × 576 → 1536 took 6.1 ms in bf16 against 1.3 ms in fp32; a 685-token prompt + 32 tokens
# ran at 3.1 tokens/s in bf16 against 8.5 in fp32).
_X86_BF16 = ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, {"avx2", "avx_ne_convert", "avx_vnni_int8"})


def onednn_bf16() -> bool | None:
    """torch's own check that its oneDNN bf16 matmul applies here (it also sees ONEDNN_MAX_CPU_ISA and a
    disabled or missing oneDNN); None where this torch cannot say."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
            return False
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


def bf16_slow_reason(flags: set[str] | None = None, onednn: bool | None = None) -> str | None:
    """Why bf16 has no fast matmul on this CPU, as one line; None where it has one (or nothing says not).

    Decided by the CPU's flags (``flags``, default /proc/cpuinfo), then by torch's own check (``onednn``,
    default :func:`onednn_bf16`), which also catches oneDNN capped by ONEDNN_MAX_CPU_ISA or turned off."""
    flags = cpu_flags() if flags is None else flags
    onednn = onednn_bf16() if onednn is None else onednn
    advice = ("so torch falls back to generic bf16 kernels and prompts and multi-token verification run several "
              "times slower than fp32; use fp32 or int8")
    if flags & {"sse2", "avx", "avx2"}:  # x86
        if not any(need <= flags for need in _X86_BF16):
            return f"bf16 has no fast matmul on this CPU (no AVX-512, AVX512_BF16 or AMX), {advice}"
    elif flags & {"asimd", "fp"}:  # Arm
        if "bf16" not in flags:
            return f"bf16 has no fast matmul on this CPU (no Arm BF16 instructions), {advice}"
    if onednn is False:
        capped = next((f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA") if os.environ.get(k)),
                      None)
        why = capped or "torch's oneDNN reports no bf16 support"
        return f"bf16 has no fast matmul here ({why}), {advice}"
    return None
