"""bf16 on a CPU without a fast bf16 matmul: one warning line at load, decided by the CPU's flags and torch's
own oneDNN check (models/cpu.py, bf16_slow_reason)."""

from __future__ import annotations

import warnings

import pytest
import torch

from speculate.cli import main
from speculate.models import cpu
from speculate.models.cpu import bf16_slow_reason
from speculate.models.loader import SlowPrecisionWarning, load_model

X86 = {"fpu", "sse2", "avx", "avx2", "fma"}
AVX512 = X86 | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize("flags, onednn, slow", [
    (X86, True, "no AVX-512"),                                  # an AVX2-only x86 (or a VM hiding AVX-512)
    (X86 | {"avx512f"}, None, "no AVX-512"),                    # avx512f alone is not oneDNN's avx512_core
    (AVX512, True, None),                                       # avx512_core: oneDNN's bf16 (emulated)
    (AVX512 | {"avx512_bf16", "amx_bf16"}, True, None),         # native bf16 (Zen 4, Sapphire Rapids)
    (X86 | {"avx_ne_convert", "avx_vnni_int8"}, True, None),    # oneDNN's avx2_vnni_2
    (AVX512, False, "oneDNN"),                                  # the flags are there, torch says no
    ({"fp", "asimd"}, None, "Arm BF16"),
    ({"fp", "asimd", "bf16"}, True, None),
    (set(), None, None),                                        # nothing known: no warning
    (set(), False, "oneDNN"),
])
def test_slow_reason_from_flags(flags, onednn, slow, monkeypatch):
    # onednn None: the function asks torch, so torch's answer is pinned to "cannot say" (this machine's own answer
    # would make the case depend on the CPU: an AVX2-only one says False).
    monkeypatch.setattr(cpu, "onednn_bf16", lambda: None)
    reason = bf16_slow_reason(flags=flags, onednn=onednn)
    if slow is None:
        assert reason is None
    else:
        assert slow in reason and "use fp32 or int8" in reason and "\n" not in reason


def test_capped_onednn_names_the_variable(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert "ONEDNN_MAX_CPU_ISA=AVX2" in bf16_slow_reason(flags=AVX512, onednn=False)


def test_load_warns_once_per_load_only_for_bf16_on_torchs_matmuls(tiny_folders, monkeypatch):
    """Through the kernel's float layers (a C compiler, a Llama-family model) bf16 needs no bf16 matmul: no
    warning on any CPU; on PyTorch's layers (SPECULATE_NO_KERNEL here), the warning where the CPU has none."""
    monkeypatch.setattr(cpu, "cpu_flags", lambda info=None: set(X86))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPrecisionWarning)
        assert load_model(str(tiny_folders[0]), dtype="bf16").model.lm_head.weight.dtype == torch.bfloat16
    monkeypatch.setenv("SPECULATE_NO_KERNEL", "1")
    with pytest.warns(SlowPrecisionWarning, match="no fast matmul on this CPU"):
        load_model(str(tiny_folders[0]), dtype="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPrecisionWarning)
        load_model(str(tiny_folders[0]), dtype="fp32")
    monkeypatch.setattr(cpu, "cpu_flags", lambda info=None: set(AVX512))
    monkeypatch.setattr(cpu, "onednn_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPrecisionWarning)
        load_model(str(tiny_folders[0]), dtype="bf16")


def test_this_machine_agrees_with_torch():
    """Here: a warning exactly when torch's own check says its oneDNN has no bf16 matmul."""
    onednn = cpu.onednn_bf16()
    if onednn is None:
        pytest.skip("this torch cannot say")
    assert (bf16_slow_reason() is None) == onednn


def test_cli_prints_the_warning_as_one_line(tiny_folders, monkeypatch, capsys):
    monkeypatch.setattr(cpu, "cpu_flags", lambda info=None: set(X86))
    monkeypatch.setenv("SPECULATE_NO_KERNEL", "1")  # (PyTorch's bf16 layers)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["generate", "--model", str(tiny_folders[0]), "--dtype", "bf16", "--max-new-tokens", "2",
                     "hello"]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "bf16" in line]
    assert lines == [lines[0]] and lines[0].startswith("speculate: warning: bf16 has no fast matmul")
    assert "SlowPrecisionWarning" not in err
