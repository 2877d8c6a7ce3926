"""``serve --ray`` against the plain server on one machine, and prefix-affinity routing against Ray's default router.

    python -m speculate.bench.ray_load [--model M] [--clients 1 2 4 8 16] [--requests 16] [--max-tokens 64]
                                       [--drafters none lookup] [--replicas 2] [--replica-threads 1]
                                       [--prefix-rounds 2] [--out FILE.json]

Part 1, throughput: a plain ``speculate serve`` (one process, one generation thread, the machine's threads) and the
same app as Ray Serve replicas (``--replicas`` x ``--replica-threads``, behind Ray's proxy and the front), both up
at once and idle in turn: each cell (clients, drafter) runs on one and then the other, in an order that alternates
from cell to cell. Greedy streamed chat requests on the copy prompts; aggregate tokens/s, TTFT (mean, p50, p95),
and every Ray answer compared with the plain server's.

Part 2, routing: a shared-prefix workload (4 long system prompts, 8 questions each, 8 clients) on the Ray app
deployed with ``--router affinity`` and with ``--router default`` in turn (A, D, D, A for 2 rounds; each deploy
starts fresh replicas, warmed with one request per system prompt): the share of requests whose whole system
prompt was cached (prefix hits), and TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date

from ..models import DEFAULT_MODEL
from . import emit, machine_header, script
from .speed import PARAGRAPHS, PROMPT_SETS


def _stream(http, url: str, body: dict) -> dict:
    """One streamed chat request: its text, new tokens, TTFT and latency, and the replica that answered."""
    start = time.perf_counter()
    first, text, tokens, cached = None, [], 0, 0
    while True:
        with http.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True,
                                                                     "stream_options": {"include_usage": True}},
                         timeout=900) as r:
            if r.status_code == 429:  # back-pressure: wait as told, then retry (the wait counts in TTFT)
                time.sleep(float(r.headers.get("Retry-After", 1)))
                continue
            r.raise_for_status()
            replica = r.headers.get("x-speculate-replica")
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices") or ():
                    piece = choice.get("delta", {}).get("content")
                    if piece:
                        first = first or time.perf_counter()
                        text.append(piece)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                    cached = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            break
    end = time.perf_counter()
    return {"text": "".join(text), "tokens": tokens, "cached": cached, "ttft": (first or end) - start,
            "latency": end - start, "replica": replica}


def _load(http, url: str, bodies: list[dict], clients: int) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda b: _stream(http, url, b), bodies))
    return answers, time.perf_counter() - t0


def _ttft(answers: list[dict]) -> dict:
    times = sorted(a["ttft"] for a in answers)
    return {"ttft_mean": round(statistics.fmean(times), 3), "ttft_p50": round(times[len(times) // 2], 3),
            "ttft_p95": round(times[min(len(times) - 1, int(0.95 * len(times)))], 3)}


def _wait_healthy(url: str, proc=None, seconds: float = 300) -> None:
    from ..server.background import wait_healthy

    if not wait_healthy(url, seconds, lambda: proc is None or proc.poll() is None, interval=0.5):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited: {proc.stdout.read()[-2000:]}")
        raise RuntimeError(f"{url} did not become healthy")


def run(model: str, clients: list[int], requests: int, max_tokens: int, drafters: list[str], replicas: int,
        replica_threads: int, prefix_rounds: int) -> dict:
    machine = machine_header()
    import httpx
    from ray import serve

    from ..server.config import ServerConfig
    from ..server.ray_serve import APP_NAME, RayOptions, build, start_ray

    max_batch = max([*clients, 8])  # (part 2 runs 8 clients)
    config = ServerConfig(model=model, max_batch=max_batch, max_queue=2 * max_batch)
    plain_port = free_port()
    plain = subprocess.Popen([sys.executable, "-m", "speculate", "serve", "--model", model, "--port", str(plain_port),
                              "--max-batch", str(max_batch), "--max-queue", str(2 * max_batch), "--log-level",
                              "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"})
    _wait_healthy(f"http://127.0.0.1:{plain_port}", plain)  # (before Ray's processes take ports of their own)
    options = RayOptions(replicas=replicas, replica_threads=replica_threads)
    start_ray(options)
    ray_port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": ray_port})
    urls = {"plain": f"http://127.0.0.1:{plain_port}", "ray": f"http://127.0.0.1:{ray_port}"}

    def deploy(router: str) -> None:
        serve.run(build(config, RayOptions(replicas=replicas, replica_threads=replica_threads, router=router)),
                  name=APP_NAME, route_prefix="/")

    rows, routing = [], []
    try:
        deploy("default")
        texts = PROMPT_SETS["copy"]
        with httpx.Client() as http:
            def chat(prompt: str, drafter: str, system: str | None = None, tokens: int = max_tokens) -> dict:
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}]
                return {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0,
                        "speculative": {"drafter": drafter}}

            for drafter in drafters:  # warm-up, not timed: each drafter once on each server, batched
                for url in urls.values():
                    _load(http, url, [chat(p, drafter, tokens=8) for p in texts[:4]], 4)
            # --- part 1: the same cells on both servers, alternating -----------------------------------------
            cell = 0
            for n in clients:
                for drafter in drafters:
                    bodies = [chat(texts[i % len(texts)], drafter) for i in range(max(requests, n))]
                    answers = {}
                    for name in (("plain", "ray") if cell % 2 == 0 else ("ray", "plain")):
                        answers[name], seconds = _load(http, urls[name], bodies, n)
                        tokens = sum(a["tokens"] for a in answers[name])
                        rows.append({"server": name, "clients": n, "drafter": drafter, "requests": len(bodies),
                                     "seconds": round(seconds, 2), "tokens_per_second": round(tokens / seconds, 2),
                                     **_ttft(answers[name]),
                                     "replicas_used": len({a["replica"] for a in answers[name]} - {None})})
                        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
                    same = sum(a["text"] == b["text"] for a, b in zip(answers["ray"], answers["plain"]))
                    rows[-1]["identical_answers"] = rows[-2]["identical_answers"] = f"{same}/{len(bodies)}"
                    cell += 1
            # --- part 2: affinity against Ray's default router ------------------------------------------------
            # 16 conversations, each its own ~1,800-character system prompt, each asked 3 questions: the first
            # question of each in one wave, then the second ones, then the third, 8 clients. A later question hits
            # the prefix cache only on the replica that answered an earlier one of its conversation.
            systems = [f"Conversation {i}. You are a support desk assistant. Policy: " + " ".join(PARAGRAPHS)[:1800]
                       for i in range(16)]
            bodies = [chat(f"Question {q}: which rule applies to case {i}?", "none", systems[i], tokens=16)
                      for q in range(3) for i in range(len(systems))]
            order = [r for i in range(prefix_rounds) for r in (("affinity", "default") if i % 2 == 0
                                                               else ("default", "affinity"))]
            for router in order:
                deploy(router)  # fresh replicas: empty prefix stores
                _load(http, urls["ray"], [chat("Say hello.", "none", tokens=4)] * 4, 2)  # (the hop warmed up)
                answers, seconds = _load(http, urls["ray"], bodies, 8)
                most = {}  # a conversation's longest cached prefix: its system prompt's blocks
                for i, a in enumerate(answers):
                    most[i % len(systems)] = max(most.get(i % len(systems), 0), a["cached"])
                later = answers[len(systems):]
                hits = sum(a["cached"] >= 0.9 * most[i % len(systems)] > 0 for i, a in enumerate(later))
                routing.append({"router": router, "requests": len(bodies), "later_requests": len(later),
                                "prefix_hits": f"{hits}/{len(later)}", "hit_rate": round(hits / len(later), 3),
                                "seconds": round(seconds, 2), "system_prompt_tokens_cached": statistics.median(
                                    most.values()), **_ttft(answers),
                                **{"later_" + k: v for k, v in _ttft(later).items()}})
                print(f"  {routing[-1]}", file=sys.stderr, flush=True)
    finally:
        plain.terminate()
        plain.wait(60)
        serve.shutdown()
        import ray

        ray.shutdown()
    by = {(r["server"], r["clients"], r["drafter"]): r for r in rows}
    for r in rows:
        r["x_plain_server"] = round(r["tokens_per_second"] / by[("plain", r["clients"], r["drafter"])]
                                    ["tokens_per_second"], 3)
    return {"date": date.today().isoformat(), **machine, "model": model, "max_tokens": max_tokens,
            "replicas": replicas, "replica_threads": replica_threads, "rows": rows, "routing": routing}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.ray_load", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--requests", type=int, default=16, help="requests per cell, at least one per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drafters", nargs="+", default=["none", "lookup"])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-threads", type=int, default=1)
    p.add_argument("--prefix-rounds", type=int, default=2, help="affinity/default pairs in part 2 (0: skip it)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    return emit(run(a.model, a.clients, a.requests, a.max_tokens, a.drafters, a.replicas, a.replica_threads,
                    a.prefix_rounds), a.out)


if __name__ == "__main__":
    sys.exit(script(main))
