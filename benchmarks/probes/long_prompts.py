"""Issue 42, point 8: does a short request wait behind long prompts? Its latency alone, beside one long prompt and
behind eight, on a real server (the default model, defaults but --max-batch 8), each long prompt ~3,900 tokens
with max_tokens 1, the short one 16 new tokens; medians of --repeats.

    python benchmarks/probes/long_prompts.py [--repeats 3] [--out FILE.json]

Runs with whatever `speculate` is importable: to compare two commits, run it from each (PYTHONPATH=<tree>/src).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import httpx

from speculate.bench import machine_header
from speculate.bench.speed import PARAGRAPHS
from speculate.server import ServerConfig, build_app
from speculate.server.background import BackgroundServer


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args(argv)
    config = ServerConfig(model="smollm2-135m-instruct", max_batch=8, max_queue=32)
    server = BackgroundServer(build_app(config))
    long_text = (" ".join(PARAGRAPHS) + " ") * 40

    def chat(text: str, max_tokens: int) -> float:
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/chat/completions", timeout=600, json={
            "model": config.model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "speculative": {"drafter": "none"}})
        r.raise_for_status()
        return time.perf_counter() - t0

    long_text = long_text[:17000]  # ~3,900 tokens
    n_long = len(httpx.post(server.url + "/tokenize", json={"model": config.model, "prompt": long_text}).json()["tokens"])
    chat("Say hello.", 4)  # warm-up
    result = {**machine_header(), "long_prompt_tokens": n_long, "cells": {}}
    try:
        for longs in (0, 1, 8):
            times = []
            for i in range(a.repeats):
                threads = [threading.Thread(target=chat, args=(f"{j} {i} " + long_text, 1)) for j in range(longs)]
                for t in threads:
                    t.start()
                time.sleep(0.2 if longs else 0)  # the long prompts are in first
                times.append(chat(f"Name a colour ({i}).", 16))
                for t in threads:
                    t.join()
            result["cells"][f"short beside {longs} long"] = {"median_s": round(statistics.median(times), 3),
                                                            "all_s": [round(t, 3) for t in times]}
            print(longs, result["cells"][f"short beside {longs} long"], file=sys.stderr, flush=True)
    finally:
        server.stop()
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        open(a.out, "w").write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
