"""Benchmark files name the machine: bench/machine.py's description, its one line, and where they are written."""

from __future__ import annotations

import json

import torch

from speculate.bench import machine, machine_header
from speculate.bench.methods import engine_method
from speculate.bench.report import CSV_FIELDS, summarise, to_csv, to_markdown
from speculate.bench.runner import BenchConfig, read_records, run_bench


def test_describe_fills_every_field_on_this_machine():
    d = machine.describe()
    for key in ("cpu", "vendor", "arch", "isa", "blas", "torch"):
        assert isinstance(d[key], str) and d[key], key
    for key in ("vnni", "amx", "avx512_bf16", "mkl", "onednn"):
        assert isinstance(d[key], bool), key
    assert d["cores"] >= 1 and d["usable_cores"] >= 1 and d["torch_threads"] == torch.get_num_threads()
    assert d["isa"] == torch.backends.cpu.get_cpu_capability()
    assert d["mkl"] == torch.backends.mkl.is_available()
    assert d["blas"] != "unknown"  # torch's build config names its BLAS
    assert isinstance(d["flags"], list) and isinstance(d["env"], dict)
    json.dumps(d)  # it goes into run files as it is


def test_summary_names_the_cpu_and_the_capability_torch_reports():
    d = machine.describe()
    line = machine.summary(d)
    assert "\n" not in line
    assert d["cpu"] in line and torch.backends.cpu.get_cpu_capability() in line
    assert d["blas"] in line and f"{d['cores']} cores" in line and f"{d['torch_threads']} torch threads" in line
    assert ("VNNI" in line) == d["vnni"] and ("AMX" in line) == d["amx"]


def test_summary_from_a_described_machine():
    d = {"cpu": "AMD EPYC 9654 96-Core Processor", "vendor": "AMD", "isa": "AVX2", "vnni": True,
         "avx512_bf16": False, "amx": False, "blas": "MKL", "cores": 8, "usable_cores": 4, "torch_threads": 4,
         "onednn_bf16": False, "env": {"ATEN_CPU_CAPABILITY": "avx2"}}
    assert machine.summary(d) == ("AMD EPYC 9654 96-Core Processor, AVX2 + VNNI, MKL, 8 cores (4 usable), "
                                  "4 torch threads, no fast bf16 matmul; ATEN_CPU_CAPABILITY=avx2")
    d.update(vnni=False, int8_activation_bits=7, env={"FBGEMM_ENABLE_INSTRUCTIONS": "AVX2"})
    assert machine.summary(d) == ("AMD EPYC 9654 96-Core Processor, AVX2, MKL, 8 cores (4 usable), "
                                  "4 torch threads, no fast bf16 matmul, 7-bit int8 activations; "
                                  "FBGEMM_ENABLE_INSTRUCTIONS=AVX2")


def test_int8_activation_bits_follow_the_kernel(monkeypatch):
    """Recorded from the kernel's behaviour (quantize.activation_levels), not from the CPU's flags."""
    from speculate.models import quantize

    for levels, bits in ((127, 8), (63, 7)):
        monkeypatch.setattr(quantize, "activation_levels", lambda levels=levels: levels)
        assert machine.describe()["int8_activation_bits"] == bits


def test_env_overrides_are_recorded(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    d = machine.describe()
    assert d["env"]["ATEN_CPU_CAPABILITY"] == "avx2" and d["env"]["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert "ATEN_CPU_CAPABILITY=avx2" in machine.summary(d)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    assert "ATEN_CPU_CAPABILITY" not in machine.describe()["env"]


def test_blas_from_the_build_config():
    assert machine._blas("  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release") == "MKL"
    assert machine._blas("  - Build settings: BLAS_INFO=open, LAPACK_INFO=open, USE_OPENBLAS=1 OpenBLAS") \
        == "OpenBLAS"
    assert machine._blas("  - Build settings: BLAS_INFO=accelerate") == "Accelerate"


def test_script_headers_carry_the_machine():
    h = machine_header()
    assert h["machine"] == machine.summary(h["machine_info"])
    assert set(h["machine_info"]) == set(machine.describe())


def test_bench_run_names_the_machine_in_every_file(tmp_path, tiny_folders):
    cfg = BenchConfig(model=str(tiny_folders[0]), out=tmp_path / "run", methods=[engine_method("lookup", "greedy", 3)],
                      datasets=["copy"], limit=1, max_new_tokens=6)
    out = run_bench(cfg, progress=False)
    run = json.loads((out / "run.json").read_text())
    line = machine.summary()
    assert run["machine"] == line and run["machine_info"]["isa"] == torch.backends.cpu.get_cpu_capability()
    records = read_records(out / "samples.jsonl")
    assert records and all(r["machine"] == line for r in records)
    assert f"Machine: {line}." in (out / "summary.md").read_text()
    csv_text = (out / "summary.csv").read_text()
    assert csv_text.splitlines()[0].endswith(",machine") and line.split(",")[0] in csv_text


def test_report_flags_samples_from_several_machines():
    def record(method, i, machine_line):
        return {"method": method, "dataset": "copy", "id": str(i), "quality": {}, "peak_rss_mb": 1,
                "machine": machine_line,
                "turns": [{"text": "the cat", "new_tokens": 2, "seconds": 1.0, "token_ids": [1, 2], "stats": None}]}

    # a run resumed elsewhere: plain's second sample was measured on another machine
    records = [record("plain", 0, "cpu A, AVX2"), record("other", 0, "cpu A, AVX2"),
               record("plain", 1, "cpu B, AVX512"), record("other", 1, "cpu A, AVX2")]
    rows = {r["method"]: r for r in summarise(records, n_resamples=10) if r["dataset"] == "copy"}
    assert rows["plain"]["machine"] == "cpu A, AVX2 | cpu B, AVX512" and rows["other"]["machine"] == "cpu A, AVX2"
    md = to_markdown(list(rows.values()), {"machine": "cpu B, AVX512"})
    assert "Machine: cpu A, AVX2 | cpu B, AVX512." in md and "more than one machine" in md
    assert "machine" in CSV_FIELDS and "cpu A, AVX2 | cpu B, AVX512" in to_csv(list(rows.values()))
    # one machine: no such note; records written before they named their machine: the run file's
    one = [record(m, 0, "cpu A, AVX2") for m in ("plain", "other")]
    assert "more than one" not in to_markdown(summarise(one, n_resamples=10), {"machine": "cpu B"})
    old = [{k: v for k, v in r.items() if k != "machine"} for r in one]
    assert "Machine: cpu C." in to_markdown(summarise(old, n_resamples=10), {"machine": "cpu C"})
