"""Probe: where a server's time goes at many clients, speculation against plain decoding (issue 41's "speculation
at 16 clients loses to plain"), round by round.

    python benchmarks/probes/server_rounds.py [--model qwen2.5-coder-1.5b-instruct] [--clients 16] [--order spec plain spec]
        [--max-tokens 64] [--keep DIR]

Each server of ``--order`` is started in turn (``spec``: the defaults; ``plain``: ``--drafter none``) through this
file with ``--serve``, which wraps the scheduler's round to log each round's running and prefilling generations, rows,
seconds, the drafting (``engine._propose``) and target-forward (``engine.forward_many``) seconds and the first tokens
it gave. The client warms the prefix store (2 requests, then the 16 MT-Bench prompts at 4 clients), then sends the
16 prompts from ``--clients`` clients at once (greedy, ``--max-tokens``), and prints the cell (tokens/s, TTFT), the
/metrics differences over it (rounds, rows, drafted tokens), the cell's rounds summed (drafting, forward, the rest) and
its first rounds from the log.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def time_the_round(engine, spent: dict) -> None:
    """Wrap ``engine._propose`` and ``engine.forward_many`` so that each call adds its seconds to ``spent["propose"]``
    and ``spent["forward"]`` (round_overhead.py too)."""

    def timed(name, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t
        return call

    engine._propose, engine.forward_many = timed("propose", engine._propose), timed("forward", engine.forward_many)


def serve(argv: list[str]) -> int:
    """The server, its rounds logged to $ROUND_LOG."""
    from speculate import engine
    from speculate.cli import main
    from speculate.server import scheduler

    log = open(os.environ["ROUND_LOG"], "a", buffering=1)
    spent = {"propose": 0.0, "forward": 0.0}
    time_the_round(engine, spent)
    plain_round = scheduler.Scheduler._round

    def round_logged(self):
        prefilling = [r.run.prompt_end - r.run.filled for r in self._running if r.run.prefilling]
        running, before = len(self._running), sum(1 for r in self._running if r.first)
        spent["propose"] = spent["forward"] = 0.0
        t0 = time.perf_counter()
        plain_round(self)
        dt = time.perf_counter() - t0
        rows = sum(getattr(r.run, "rows_last", 0) for r in self._running)
        firsts = sum(1 for r in self._running if r.first) - before
        log.write(f"{t0:.3f} running {running} prefilling {prefilling} rows {rows} round {dt * 1e3:.1f} ms "
                  f"drafting {spent['propose'] * 1e3:.2f} forward {spent['forward'] * 1e3:.1f} first tokens {firsts}\n")

    scheduler.Scheduler._round = round_logged
    return main(argv)


def metrics(http, url: str) -> dict[str, float]:
    """The server's unlabelled samples by name (prometheus_client's own parser of its text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http.get(url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--order", nargs="+", default=["spec", "plain", "spec"], choices=["spec", "plain"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--keep", metavar="DIR", help="keep each server's round log in DIR (ORDER-NAME.log)")
    a = p.parse_args()
    import httpx

    from speculate.bench import machine_header
    from speculate.server.background import free_port
    from speculate.bench.peers import Server, _cell, _request
    from speculate.bench.serve_load import prompt_texts

    print(machine_header()["machine"], flush=True)
    texts = prompt_texts("mt_bench", 16)
    keys = ("round_seconds_count", "round_seconds_sum", "batch_rows_sum", "drafted_tokens_total",
            "accepted_tokens_total", "peeked_rounds_total")
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(a.order):
            log = Path(a.keep or tmp) / f"{i}-{name}.log"
            log.touch()
            os.environ["ROUND_LOG"] = str(log)
            port = free_port()
            argv = [sys.executable, __file__, "--serve", "serve", "--model", a.model, "--port", str(port),
                    "--max-batch", "16", "--max-queue", "32", "--log-level", "warning",
                    *(["--drafter", "none"] if name == "plain" else [])]
            server = Server(argv, port, 2, 900)
            try:
                with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=600) as http:
                    with ThreadPoolExecutor(2) as pool:
                        list(pool.map(lambda t: _request(http, server.url, a.model, t, 8), texts[:2]))
                    _cell(http, server.url, a.model, texts, 4, a.max_tokens)
                    before = metrics(http, server.url)
                    start = time.perf_counter()
                    row, _ = _cell(http, server.url, a.model, texts, a.clients, a.max_tokens)
                    after = metrics(http, server.url)
            finally:
                server.stop()
            diff = {k: after.get("speculate_" + k, 0) - before.get("speculate_" + k, 0) for k in keys}
            rounds = diff["round_seconds_count"] or 1
            print(f"{name}: {row['tokens_per_second']} tokens/s, TTFT p50 {row['ttft_p50']} s; {rounds:.0f} rounds, "
                  f"{1e3 * diff['round_seconds_sum'] / rounds:.1f} ms and {diff['batch_rows_sum'] / rounds:.2f} rows "
                  f"a round; drafted {diff['drafted_tokens_total']:.0f}, accepted {diff['accepted_tokens_total']:.0f}, "
                  f"peeked rounds {diff['peeked_rounds_total']:.0f}", flush=True)
            cell = [line for line in log.read_text().splitlines() if float(line.split()[0]) >= start]
            # The cell's rounds summed: what the round spent outside drafting and the target forward is the
            # scheduler's and the drafters' bookkeeping (acceptance, caches, streaming the pieces).
            spent = {k: sum(float(line.split(f" {k} ")[1].split()[0]) for line in cell)
                     for k in ("round", "drafting", "forward")}
            print(f"    the cell's {len(cell)} logged rounds: {spent['round']:.0f} ms, drafting {spent['drafting']:.0f}, "
                  f"forward {spent['forward']:.0f}, the rest {spent['round'] - spent['drafting'] - spent['forward']:.0f}",
                  flush=True)
            for line in cell[:4]:
                print("   ", line.split(" ", 1)[1], flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        sys.exit(serve(sys.argv[2:]))
    sys.exit(main())
