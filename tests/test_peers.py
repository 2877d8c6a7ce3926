"""The serving benchmark against the peers (bench/peers.py): servers as processes, one up at a time, alternated;
answers compared across servers and loads; memory of a process tree counted once; bad input one line."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from speculate.bench import peers
from speculate.errors import SpeculateError

# Our server on a tiny model at fp32 (exact through the kernel: batched = alone) as two "peers": plain decoding and
# lookup (lossless), so every answer, at any load, must be the same text on both.
OURS = "{python} -m speculate serve --model {model} --port {port} --dtype fp32 --max-batch {clients} " \
       "--log-level warning --drafter "


def test_servers_alternate_and_their_answers_are_compared(tiny_folders):
    servers = {"plain": OURS + "none", "lookup": OURS + "lookup"}
    # 10 requests a cell over the 6 copy prompts: four prompts asked twice in each cell.
    record = peers.run(servers, str(tiny_folders[0]), clients=[2, 1], requests=10, max_tokens=12, prompts="copy",
                       rounds=2, threads=1, ready_timeout=120)
    # One up at a time, the order reversed every other round; each start's memory sampled (a Python with torch).
    assert [(s["round"], s["server"]) for s in record["starts"]] == [(1, "plain"), (1, "lookup"), (2, "lookup"),
                                                                       (2, "plain")]
    assert all(0.1 < s["peak_memory_gb"] < 8 for s in record["starts"])
    # Fewest clients first, every cell of every start, each with the requests' tokens and timings.
    assert [(r["server"], r["round"], r["clients"]) for r in record["rows"]] == [
        ("plain", 1, 1), ("plain", 1, 2), ("lookup", 1, 1), ("lookup", 1, 2),
        ("lookup", 2, 1), ("lookup", 2, 2), ("plain", 2, 1), ("plain", 2, 2)]
    for row in record["rows"]:
        assert row["requests"] == 10 and 10 <= row["tokens"] <= 120
        assert row["tokens_per_second"] == pytest.approx(row["tokens"] / row["seconds"], rel=0.02)
        assert 0 < row["ttft_p50"] <= row["ttft_p95"] <= row["seconds"]
        # Exact at fp32 and lossless lookup: every answer is the server's own alone and the first server's.
        assert row["same_as_own_alone"] == 10 and row["same_as_first_server"] == 10
    summary = {(c["server"], c["clients"]): c for c in record["summary"]}
    assert set(summary) == {("plain", 1), ("plain", 2), ("lookup", 1), ("lookup", 2)}
    for (name, n), cell in summary.items():
        mine = sorted(r["tokens_per_second"] for r in record["rows"] if r["server"] == name and r["clients"] == n)
        assert cell["rounds"] == 2 and cell["tokens_per_second"] == pytest.approx(sum(mine) / 2, abs=1e-3)
        plain = summary[("plain", n)]["tokens_per_second"]
        assert cell["first_x"] == (None if name == "plain" else pytest.approx(plain / cell["tokens_per_second"],
                                                                              abs=1e-3))
    table = peers.to_markdown(record["summary"]).splitlines()
    assert len(table) == 2 + 4 and table[2].startswith("| plain | 1 | ") and "| 10/10 | 10/10 |" in table[2]
    assert record["servers"]["lookup"].endswith("--drafter lookup")
    assert set(record["answers"]) == {"plain", "lookup"} and len(record["answers"]["plain"]) == 6


def test_commands_fill_their_fields_and_name_what_is_missing():
    values = peers.fields("smollm2-135m-instruct", 16, 2, None, None)
    argv = peers.command(peers.PRESETS["speculate-plain"], values, 8123)
    assert argv[:4] == [sys.executable, "-m", "speculate", "serve"] and argv[argv.index("--port") + 1] == "8123"
    assert argv[argv.index("--max-batch") + 1] == "16" and argv[-2:] == ["--drafter", "none"]
    with pytest.raises(SpeculateError, match="needs --llama-server"):
        peers.command(peers.PRESETS["llama-server"], values, 8123)
    with pytest.raises(SpeculateError, match="needs --vllm"):
        peers.command(peers.PRESETS["vllm"], values, 8123)
    with pytest.raises(SpeculateError, match=r"unknown field \{gpus\}"):
        peers.command("serve --port {port} --gpus {gpus}", values, 8123)
    vllm = peers.command(peers.PRESETS["vllm-ngram"], {**values, "vllm": "/venv/bin/python", "folder": "/m"}, 1)
    assert vllm[:3] == ["env", f"VLLM_CPU_OMP_THREADS_BIND={values['cpus']}", "VLLM_CPU_KVCACHE_SPACE=4"]
    assert vllm[-1] == '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'
    assert peers.order(["a", "b", "c"], 3) == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a"),
                                               (2, "a"), (2, "b"), (2, "c")]


def test_bad_input_is_one_line_and_a_server_that_dies_is_named(tmp_path):
    def script(*args):
        return subprocess.run([sys.executable, "-m", "speculate.bench.peers", *args], capture_output=True, text=True,
                              timeout=120)

    done = script("--servers", "tgi")
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "speculate: unknown server 'tgi'; presets: " + ", ".join(peers.PRESETS) + ", or name one with --server"]
    done = script("--servers", "llama-server")
    assert done.returncode == 2 and "needs --llama-server" in done.stderr and "Traceback" not in done.stderr
    done = script("--servers", "gone", "--server", "gone=/no/such/server --port {port}")
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == \
        "speculate: cannot start /no/such/server: No such file or directory"
    log = tmp_path / "logs"
    done = script("--servers", "dies", "--server", f"dies={sys.executable} -c 'print(42); raise SystemExit(3)'",
                  "--logs", str(log))
    assert done.returncode == 2 and "exited with code 3 before it was ready" in done.stderr
    assert (log / "dies.log").read_text().strip() == "42"


def test_memory_of_a_process_tree_counts_each_page_once():
    # A parent holding 96 MiB that starts a child holding 48 MiB: the tree's proportional set sizes sum to the
    # two allocations (and two interpreters), and no page is counted twice.
    child = "b = bytearray(48 << 20); import time; time.sleep(60)"
    parent = (f"import subprocess, sys, time; b = bytearray(96 << 20); "
              f"p = subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", parent])
    try:
        deadline = time.monotonic() + 30
        while True:
            tree = peers.descendants(proc.pid)
            total = peers.pss_bytes(tree)
            if len(tree) == 2 and total >= 144 << 20 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert tree[0] == proc.pid and len(tree) == 2
        assert 144 << 20 <= total <= 200 << 20
        peak = peers.MemoryPeak(proc.pid, every=0.05)
        time.sleep(0.5)
        assert 144 << 20 <= peak.stop() <= 200 << 20
    finally:
        for pid in peers.descendants(proc.pid)[::-1]:
            subprocess.run(["kill", "-9", str(pid)])
        proc.wait(10)
