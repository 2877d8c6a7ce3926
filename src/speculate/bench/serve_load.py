"""Server throughput: requests/s and tokens/s at several numbers of concurrent clients, with and
without speculation, against a real `speculate serve` app on a loopback port (in this process).

    python -m speculate.bench.serve_load [--model M] [--dtype fp32] [--clients 1 4 8] [--requests 16]
                                         [--max-tokens 64] [--max-concurrency 1] [--drafters none lookup]
                                         [--no-prefix-cache] [--out FILE.json]

Each client sends greedy chat requests (the copy-heavy prompts of bench/speed.py) one after another;
the drafters alternate per concurrency level so that machine noise hits all. Every answer is checked
against the single-request answer for its prompt (plain decoding's).
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date

from ..drafters import ALL_DRAFTERS, MODEL_DRAFTERS
from ..models import DEFAULT_MODEL, DTYPES
from . import emit, machine_header, script
from .speed import PROMPT_SETS


def _chat(client, url, model, prompt, drafter, max_tokens):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "speculative": {"drafter": drafter}}
    while True:
        r = client.post(url + "/v1/chat/completions", json=body, timeout=600)
        if r.status_code != 429:  # back-pressure: wait as told, then retry
            r.raise_for_status()
            return r.json()
        time.sleep(float(r.headers.get("Retry-After", 1)))


def run(model: str, clients: list[int], requests: int, max_tokens: int, max_concurrency: int,
        drafters: list[str] = ("none", "lookup"), dtype: str = "fp32", prefix_cache: bool = True) -> dict:
    machine = machine_header()  # at the start: the threads and load as the run begins
    import httpx

    from ..server import ServerConfig, build_app
    from ..server.background import BackgroundServer

    config = ServerConfig(model=model, max_concurrency=max_concurrency, max_queue=max(clients) * 2, dtype=dtype,
                          prefix_cache=prefix_cache)
    server = BackgroundServer(build_app(config))  # as `speculate serve` builds it
    prompts = PROMPT_SETS["copy"]
    rows = []
    try:
        with httpx.Client() as http:
            reference = {p: _chat(http, server.url, model, p, "none", max_tokens)["choices"][0]["message"]["content"]
                         for p in prompts}
            for n_clients in clients:
                for drafter in drafters:
                    jobs = [prompts[i % len(prompts)] for i in range(requests)]
                    t0 = time.perf_counter()
                    with ThreadPoolExecutor(n_clients) as pool:
                        answers = list(pool.map(lambda p: _chat(http, server.url, model, p, drafter, max_tokens), jobs))
                    dt = time.perf_counter() - t0
                    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
                    same = sum(a["choices"][0]["message"]["content"] == reference[p] for a, p in zip(answers, jobs))
                    rows.append({"clients": n_clients, "drafter": drafter, "requests": requests,
                                 "seconds": round(dt, 2), "requests_per_second": round(requests / dt, 3),
                                 "tokens_per_second": round(tokens / dt, 2), "identical_answers": f"{same}/{requests}"})
                    print(f"  {rows[-1]}", file=sys.stderr)
    finally:
        server.stop()
    return {"date": date.today().isoformat(), **machine,
            "model": model, "dtype": dtype, "prefix_cache": prefix_cache, "max_tokens": max_tokens,
            "max_concurrency": max_concurrency, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.serve_load", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--requests", type=int, default=16, help="requests per (clients, drafter) cell")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=1, help="the server's generation workers")
    p.add_argument("--drafters", nargs="+", default=["none", "lookup"], choices=[d for d in ALL_DRAFTERS if d not in MODEL_DRAFTERS],
                   help="drafters to alternate (requests name them; default none lookup)")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--no-prefix-cache", action="store_true", help="as `speculate serve --no-prefix-cache`")
    p.add_argument("--out")
    a = p.parse_args(argv)
    return emit(run(a.model, a.clients, a.requests, a.max_tokens, a.max_concurrency, a.drafters, a.dtype,
                    not a.no_prefix_cache), a.out)


if __name__ == "__main__":
    sys.exit(script(main))
