"""Speculation against plain decoding in one server, wave by wave: issue 41's "speculative ≥ plain at every load
(within noise: say how measured)".

    python -m speculate.bench.ab [--model M] [--clients 1 4 8 16] [--repeats 2] [--max-tokens 128]
                                 [--prompts mt_bench] [--stream] [--a JSON] [--b JSON] [--server-arg=ARG ...]
                                 [--out FILE.json]

Two servers measured one after the other compare two moments of a shared machine: on an AVX2 EPYC, four such cells at
one client (speculation, plain, plain, speculation) read 94, 96, 87 and 85 tokens/s, a drift larger than what they
compare. So here ONE ``speculate serve`` process serves both arms. A *wave* is ``clients`` prompts sent at once; each
wave runs twice back to back, once per arm, and the arm that goes first alternates from wave to wave. Arm ``a``
(``spec``) sends no ``speculative`` object (the server's defaults); arm ``b`` (``plain``) sends ``{"drafter": "none"}``.
``--a``/``--b`` set either (an A/A run, the same object on both, measures the method's own noise). The two runs of a
wave decode the same prompts greedily, so their texts must be the same where the model is exact (counted).

Reported per clients count: each arm's tokens over its waves' seconds, a ÷ b, and a 95 % interval of that ratio from
resampling the waves with replacement (a paired bootstrap: a wave's two runs stay together), the median of the waves'
own ratios, the texts that differ, and the /metrics counters over each arm's waves (rounds, drafted and accepted
tokens, rounds that peeked). A load in one server is a burst of ``clients`` requests that ends with fewer running (the
same prompts for both arms); the peers comparison (bench/peers.py) keeps the clients busy instead.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from ..errors import SpeculateError
from ..models import DEFAULT_MODEL
from . import emit, machine_header, script
from .serve_load import PROMPTS, _chat, prompt_texts

#: The /metrics counters summed over each arm's waves.
COUNTERS = ("round_seconds_count", "drafted_tokens_total", "accepted_tokens_total", "peeked_rounds_total")


def schedule(prompts: int, clients: int, repeats: int) -> list[tuple[range, tuple[str, str]]]:
    """The waves in the order they run: each a stretch of ``clients`` prompt indices, and its arms in the order
    they go (``a`` first in even waves, ``b`` first in odd ones). ``repeats`` passes over the prompts; a last stretch
    shorter than ``clients`` is left out, so that every wave is the same load."""
    if clients < 1 or repeats < 1:
        raise SpeculateError(f"--clients and --repeats must be >= 1, got {clients} and {repeats}")
    if prompts < clients:
        raise SpeculateError(f"a wave of {clients} clients needs {clients} prompts; the set has {prompts}")
    stretches = [range(s, s + clients) for s in range(0, prompts - clients + 1, clients)] * repeats
    return [(r, ("a", "b") if i % 2 == 0 else ("b", "a")) for i, r in enumerate(stretches)]


def measure(send: Callable[[list[int], str], tuple[list[str], int, float, dict]], prompts: int, clients: int,
            repeats: int) -> list[dict]:
    """Every wave of :func:`schedule`, each arm's run through ``send(prompt indices, arm)`` → (texts, tokens, seconds,
    counters): one dict per wave with each arm's tokens, seconds and counters, the order they ran and how many of its
    texts differ between the arms."""
    waves = []
    for stretch, arms in schedule(prompts, clients, repeats):
        wave, texts = {"prompts": [stretch.start, stretch.stop], "order": "".join(arms)}, {}
        for arm in arms:
            texts[arm], tokens, seconds, counters = send(list(stretch), arm)
            wave[arm] = {"tokens": tokens, "seconds": seconds, **counters}
        wave["texts_differ"] = sum(x != y for x, y in zip(texts["a"], texts["b"]))
        waves.append(wave)
    return waves


def rate(waves: list[dict], arm: str) -> float:
    """Tokens over seconds of ``arm`` summed over ``waves``."""
    return sum(w[arm]["tokens"] for w in waves) / sum(w[arm]["seconds"] for w in waves)


def summary(waves: list[dict], draws: int = 2000, seed: int = 0) -> dict:
    """Each arm's rate, a ÷ b, its 95 % paired-bootstrap interval (``draws`` resamplings of the waves, seeded), the
    median of the waves' own ratios, the texts that differ and each arm's counters summed."""
    if not waves:
        raise SpeculateError("no waves to summarise")
    rng = random.Random(seed)
    ratios = sorted(rate(s, "a") / rate(s, "b") for s in ([rng.choice(waves) for _ in waves] for _ in range(draws)))
    out = {"waves": len(waves), "a_tokens_per_second": round(rate(waves, "a"), 2),
           "b_tokens_per_second": round(rate(waves, "b"), 2),
           "a_over_b": round(rate(waves, "a") / rate(waves, "b"), 4),
           "interval_95": [round(ratios[int(0.025 * draws)], 4), round(ratios[int(0.975 * draws) - 1], 4)],
           "median_wave_ratio": round(statistics.median(rate([w], "a") / rate([w], "b") for w in waves), 4),
           "texts_differ": sum(w["texts_differ"] for w in waves)}
    for arm in ("a", "b"):
        out[f"{arm}_counters"] = {k: sum(w[arm].get(k, 0) for w in waves) for k in COUNTERS}
    return out


def counters(http, url: str) -> dict[str, float]:
    """The server's unlabelled /metrics samples of :data:`COUNTERS` (prometheus_client's parser of its own format)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = http.get(url + "/metrics")
    r.raise_for_status()
    samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples if not s.labels}
    return {k: samples.get("speculate_" + k, 0.0) for k in COUNTERS}


def run(model: str = DEFAULT_MODEL, clients: list[int] = (1,), repeats: int = 2, max_tokens: int = 128,
        prompts: str = "mt_bench", stream: bool = False, a: dict | None = None, b: dict | None = None,
        server_args: list[str] = (), threads: int = 2, ready_timeout: float = 900) -> dict:
    """One ``speculate serve`` process (its defaults and ``server_args``) on a loopback port, every clients count's
    waves against it in turn (module docstring); the run's record."""
    import httpx

    from ..server.background import free_port
    from .peers import Server

    machine = machine_header()
    b = {"drafter": "none"} if b is None else b
    settings = {"a": a, "b": b}  # (None: no "speculative" object sent, the server's defaults)
    texts = prompt_texts(prompts, 16)
    for n in clients:  # (bad loads refused before a server starts)
        schedule(len(texts), n, repeats)
    port = free_port()
    argv = [sys.executable, "-m", "speculate", "serve", "--model", model, "--port", str(port),
            "--max-batch", str(max(clients)), "--max-queue", str(4 * max(clients)), "--log-level", "warning",
            *server_args]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    server = Server(argv, port, threads, ready_timeout)
    loads = []
    try:
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=900) as http:

            def one(prompt: str, arm: str) -> tuple[str, int]:
                answer, _ = _chat(http, server.url, model, prompt, settings[arm], max_tokens, stream)
                if not answer.get("usage"):
                    raise SpeculateError(f"{server.url} sent no usage with its answer")
                return answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"]

            def send(indices: list[int], arm: str) -> tuple[list[str], int, float, dict]:
                before = counters(http, server.url)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(len(indices)) as pool:
                    out = list(pool.map(lambda i: one(texts[i], arm), indices))
                seconds = time.perf_counter() - t0
                after = counters(http, server.url)
                return [t for t, _ in out], sum(n for _, n in out), seconds, {k: after[k] - before[k] for k in COUNTERS}

            for n in clients:
                for arm in ("a", "b"):  # warm-up, not timed: each arm's decoder, the prefix store, a batch of n
                    send(list(range(n)), arm)
                waves = measure(send, len(texts), n, repeats)
                loads.append({"clients": n, **summary(waves), "per_wave": waves})
                s = loads[-1]
                print(f"  {n} clients: a {s['a_tokens_per_second']} tokens/s, b {s['b_tokens_per_second']}; a / b "
                      f"{s['a_over_b']} (95 % {s['interval_95'][0]}-{s['interval_95'][1]}); texts that differ "
                      f"{s['texts_differ']}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return {"started": started, **machine, "model": model, "server": argv, "max_tokens": max_tokens,
            "prompts": prompts, "stream": stream, "repeats": repeats, "a": a, "b": b, "loads": loads}


def to_markdown(record: dict) -> str:
    """The record's table: one row per clients count."""
    lines = ["| clients | waves | a (tokens/s) | b (tokens/s) | a ÷ b | 95 % interval | a: drafted / accepted | "
             "texts that differ |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in record["loads"]:
        c = s["a_counters"]
        lines.append(f"| {s['clients']} | {s['waves']} | {s['a_tokens_per_second']} | {s['b_tokens_per_second']} | "
                     f"**{s['a_over_b']:.3f}×** | {s['interval_95'][0]:.3f}-{s['interval_95'][1]:.3f} | "
                     f"{c['drafted_tokens_total']:.0f} / {c['accepted_tokens_total']:.0f} | {s['texts_differ']} |")
    return "\n".join(lines)


def _arm(value: str) -> dict | None:
    """An arm's ``speculative`` object from the command line (``default``: none sent, the server's defaults)."""
    if value == "default":
        return None
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        raise SpeculateError(f"an arm must be 'default' or a JSON object, got {value!r} ({e.msg})") from None
    if not isinstance(out, dict):
        raise SpeculateError(f"an arm must be 'default' or a JSON object, got {value!r}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.ab", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=2, help="passes over the 16 prompts (default 2)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", default="mt_bench", help="a prompt set of serve_load (default mt_bench)")
    p.add_argument("--stream", action="store_true", help="stream the answers, as chat clients do")
    p.add_argument("--a", default="default", metavar="JSON",
                   help="arm a's \"speculative\" object (default: none sent, the server's defaults)")
    p.add_argument("--b", default='{"drafter": "none"}', metavar="JSON", help="arm b's (default: plain decoding)")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="an extra `speculate serve` argument (repeatable; --server-arg=--dtype --server-arg=int8)")
    p.add_argument("--out", help="write the record here (JSON, atomically)")
    a = p.parse_args(argv)
    if a.prompts not in PROMPTS:
        raise SpeculateError(f"unknown prompt set '{a.prompts}'; choose one of: {', '.join(PROMPTS)}")
    record = run(a.model, a.clients, a.repeats, a.max_tokens, a.prompts, a.stream, _arm(a.a), _arm(a.b),
                 a.server_arg)
    print(to_markdown(record), file=sys.stderr)
    return emit(record, a.out)


if __name__ == "__main__":
    sys.exit(script(main))
