"""Does --kv-memory bound the server's memory under load? 64 concurrent completions of 1,500-token prompts and 256 new
tokens against the default model (q4), one server process per budget, run one after another:

    python benchmarks/probes/kv_memory.py [--budgets 1 0] [--requests 64] [--prompt 1500] [--tokens 256] [--shared 0]

Each budget runs in a process of its own (its peak RSS is that server's): the app as `speculate serve` builds it
(max_batch = requests, so only the budget limits the batch), one warm-up request, then the requests at once, each a
distinct token-id prompt (a header naming the request, then shipped paragraphs) so that no prefix is shared; with
``--shared N`` every prompt starts with the same N tokens (the paragraphs), then its own header and text. Printed:
the budget, seconds, answers (all must be 200), new tokens, the most KV reserved at once (/metrics, polled), the most
requests running at once, the peak RSS above the RSS before the requests (VmHWM − VmRSS, /proc/self/status), the
requests preempted for memory, and a digest of the answers (greedy: two servers that agree give the same digest). Run
it with ``PYTHONPATH=<another tree>/src`` to measure another version of the server on the same workload.
"""

import argparse
import hashlib
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor


def rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def one(budget: float, requests: int, prompt_tokens: int, tokens: int, shared: int = 0) -> dict:
    import httpx

    from speculate.bench.speed import PARAGRAPHS
    from speculate.server import ServerConfig
    from speculate.server.background import BackgroundServer
    from speculate.server.main import build_app
    from speculate.spec import SpeculativeSpec

    config = ServerConfig(model="smollm2-135m-instruct", dtype="q4", spec=SpeculativeSpec("auto"), max_batch=requests,
                          max_queue=2 * requests, max_tokens=0, kv_memory_gib=budget,
                          max_connections=4 * requests, max_connections_per_client=0)  # (one client address)
    app = build_app(config)
    server = BackgroundServer(app)
    tok = app.state.target.tokenizer
    text = " ".join(PARAGRAPHS * 20)
    common = tok.encode(text, add_special_tokens=False)[:shared]
    prompts = [common + tok.encode(f"Request {i}: continue this text.\n\n{text}",
                                   add_special_tokens=False)[: prompt_tokens - shared] for i in range(requests)]
    url = server.url + "/v1/completions"
    scheduler = app.state.scheduler
    try:  # the paged pool's blocks (a server before the paged cache has none)
        from speculate.models.paged import pool_bytes
    except ImportError:
        def pool_bytes(model):
            return 0
    try:
        httpx.post(url, json={"model": config.model, "prompt": prompts[0][:50], "max_tokens": 4}, timeout=600)
        before = rss("VmRSS:")
        most = {"reserved": 0, "running": 0, "pool": 0}
        stop = threading.Event()

        def poll():
            while not stop.is_set():
                most["reserved"] = max(most["reserved"], scheduler.kv_reserved)
                most["running"] = max(most["running"], scheduler.running)
                most["pool"] = max(most["pool"], pool_bytes(app.state.target.model))
                time.sleep(0.05)

        watcher = threading.Thread(target=poll, daemon=True)
        watcher.start()
        t0 = time.perf_counter()
        try:
            with httpx.Client(limits=httpx.Limits(max_connections=requests)) as http, ThreadPoolExecutor(requests) as pool:
                answers = list(pool.map(lambda p: http.post(url, timeout=3600, json={
                    "model": config.model, "prompt": p, "max_tokens": tokens, "temperature": 0}), prompts))
        finally:
            stop.set()
        seconds = time.perf_counter() - t0
        watcher.join()
        ok = [a for a in answers if a.status_code == 200]
        texts = json.dumps([a.json()["choices"][0]["text"] if a.status_code == 200 else None for a in answers])
        return {"answers_sha256": hashlib.sha256(texts.encode()).hexdigest()[:16],
                "preempted": getattr(scheduler, "preempted", None),  # (None: a server without preemption)
                "kv_memory_gib": budget, "budget_bytes": scheduler.kv_budget, "seconds": round(seconds, 1),
                "answered": f"{len(ok)}/{requests}", "new_tokens": sum(a.json()["usage"]["completion_tokens"] for a in ok),
                "most_kv_reserved_gib": round(most["reserved"] / 2**30, 3), "most_running": most["running"],
                "most_kv_pool_gib": round(most["pool"] / 2**30, 3),
                "rss_before_gib": round(before / 2**30, 3),
                "peak_rss_above_before_gib": round((rss("VmHWM:") - before) / 2**30, 3)}
    finally:
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=1500)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--shared", type=int, default=0, help="prompt tokens every request shares (its first ones)")
    p.add_argument("--one", type=float, help=argparse.SUPPRESS)  # (a child process: one budget)
    a = p.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.one, a.requests, a.prompt, a.tokens, a.shared)))
        return
    from speculate.bench import machine_header
    print(json.dumps(machine_header()), flush=True)
    for budget in a.budgets:
        out = subprocess.run([sys.executable, __file__, "--one", str(budget), "--requests", str(a.requests),
                              "--prompt", str(a.prompt), "--tokens", str(a.tokens), "--shared", str(a.shared)],
                             capture_output=True, text=True)
        print(out.stdout.strip().splitlines()[-1] if out.returncode == 0 else out.stderr[-2000:], flush=True)


if __name__ == "__main__":
    main()
