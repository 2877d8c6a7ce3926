"""Probe: prompt tokens a second, ours at q4 (two activation rows a row, as run, and one: q4a8, llama.cpp's) against
llama.cpp's llama-server on the same GGUF (its own ``timings.prompt_per_second``), 2 threads each.

    python benchmarks/probes/prefill_rate.py [--model qwen2.5-coder-1.5b-instruct] [--tokens 128] [--llama-server BIN]

Ours: one causal prefill of ``--tokens`` random tokens into a fresh cache (``KVModel.forward``), the median of 3 after
one untimed. llama-server: one slot, ``cache_prompt`` off, a prompt of random words and numbers (its token count
printed; ~1.8x ``--tokens``), ``n_predict`` 1, three requests.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request

import torch


def ours(model: str, tokens: int) -> None:
    from speculate.models import load_model, quantize
    from speculate.models.kv import KVModel

    loaded = load_model(model, dtype="q4", progress=False)
    prompt = torch.randint(100, 20000, (tokens,))
    for passes in (2, 1):  # q4 as run, then q4a8's numerics
        quantize.set_activation_passes(loaded.model, passes)
        loaded.shared.pop("lean", None)  # (a lean decoder copies each layer's passes as it is built: build anew)
        kv = KVModel(loaded)
        times = []
        for _ in range(4):
            kv.reset(tokens + 8)
            t0 = time.perf_counter()
            kv.forward(prompt)
            times.append(time.perf_counter() - t0)
        t = statistics.median(times[1:])
        print(f"ours, {passes} activation row(s) a row{' (q4, as run)' if passes == 2 else ' (q4a8)'}: {tokens} "
              f"tokens in {t:.2f} s, {tokens / t:.1f} tokens/s", flush=True)


def llama(binary: str, model: str, tokens: int) -> None:
    from speculate.bench.peers import Server, _gguf
    from speculate.server.background import free_port

    port = free_port()
    server = Server([binary, "-m", str(_gguf(model)), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-tb", "2",
                     "-np", "1", "-c", "4096", "--no-webui", "-nr"], port, threads=2, ready_timeout=300)
    try:
        rng = random.Random(0)
        words = "the of and to in is was for on that with as by at from his her an which this".split()
        for _ in range(3):
            prompt = " ".join(rng.choice(words) + str(rng.randint(0, 999)) for _ in range(tokens // 2))
            body = json.dumps({"prompt": prompt, "n_predict": 1, "cache_prompt": False}).encode()
            request = urllib.request.Request(server.url + "/completion", body, {"Content-Type": "application/json"})
            t = json.load(urllib.request.urlopen(request))["timings"]
            print(f"llama-server: {t['prompt_n']} tokens in {t['prompt_ms'] / 1e3:.2f} s, "
                  f"{t['prompt_per_second']:.1f} tokens/s", flush=True)
    finally:
        print(f"llama-server peak RSS {server.stop() / 1e9:.2f} GB", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--llama-server", metavar="BIN")
    a = p.parse_args()
    from speculate.bench import machine_header

    torch.set_num_threads(2)
    print(machine_header()["machine"], flush=True)
    ours(a.model, a.tokens)
    if a.llama_server:
        llama(a.llama_server, a.model, a.tokens)


if __name__ == "__main__":
    main()
