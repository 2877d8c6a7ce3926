"""Server throughput with continuous batching: aggregate tokens/s at several numbers of concurrent clients, plain
and speculative, batched against one generation at a time, against a real `speculate serve` app on a loopback port
(in this process).

    python -m speculate.bench.serve_load [--model M] [--draft-model D] [--dtype int8] [--clients 1 4 8 16]
                                         [--requests 16] [--max-tokens 64]
                                         [--drafters none lookup retrieval lookup@6 lookup@server]
                                         [--k auto] [--prompts copy|paraphrase|mt_bench|json|code-edit]
                                         [--modes one batched]
                                         [--no-prefix-cache] [--out FILE.json]

One server, one generation thread: each cell (clients, drafter) runs twice, interleaved, in an order that
alternates from cell to cell — ``one``: ``max_batch`` 1, one generation at a time (the server before batching,
``--max-concurrency 1``), and ``batched``: ``max_batch`` = the number of clients. Each client sends greedy chat
requests one after another. Every answer is compared with the same prompt's answer alone (plain decoding, one at
a time): they must all be identical where the model is exact (int8, q4, and fp32 through the kernel: ``exactness``).
``--modes batched`` runs the batched mode alone (issue 41's question: does speculation ever cost against plain decoding
at the same load?). ``--prompts mt_bench``: the first 16 shipped MT-Bench first turns, where lookup finds little to
copy; ``--prompts json``: GSM8K questions each asked for a JSON record with the same fields, and ``code-edit``: HumanEval
functions each restated under another name (traffic that repeats its shape), other prompts for each clients count.
Each cell records tokens/s, requests/s, mean latency, the mean generations and rows per forward, each speculative
cell the ratio to plain decoding in the same mode, and (not streamed) tokens/s and τ of the first and the last quarter
of its requests, each over its own latency: how a drafter that learns (``suffix``) warms up. Drafters that learn share
the server's one index: compare two of them in runs of their own.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import date

from ..policy.draft_length import parse_k
from ..drafters import ALL_DRAFTERS
from ..errors import SpeculateError
from ..models import DEFAULT_MODEL, DTYPES
from ..spec import SpeculativeSpec
from . import emit, machine_header, script
from .client import chat, percentile
from .speed import PROMPT_SETS

MODES = ("one", "batched")
LEARNING = ("json", "code-edit")  # sets that get other prompts for each clients count (a learning drafter's)
PROMPTS = (*PROMPT_SETS, "mt_bench", *LEARNING)


def prompt_texts(name: str, n: int = 16) -> list[str]:
    """The prompts of a set: speed.py's copy / paraphrase sets, the first 16 MT-Bench first turns, or the first ``n``
    of bench/learning.py's workloads that repeat their shape, not their text: ``json`` (GSM8K questions each asked for
    a JSON record with the same fields) and ``code-edit`` (HumanEval functions, each restated under another name)."""
    from .datasets import load_dataset
    if name == "mt_bench":
        return [s.turns[0] for s in load_dataset("mt_bench", limit=16, shots=0)]
    if name in LEARNING:
        from .learning import workloads
        return workloads(n, (name,))[name]
    return PROMPT_SETS[name]


def _chat(client, url, model, prompt, speculative, max_tokens, stream: bool = False):
    """(the answer, seconds) of one greedy chat request; ``speculative`` None: none sent (the server's defaults);
    ``stream``: streamed, with ``ttft`` and ``gaps`` (bench/client.py)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, **({"speculative": speculative} if speculative is not None else {})}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return chat(client, url, body)


def _quarters(answers: list) -> dict:
    """Per request, in the order sent: tokens over its own seconds (its latency) and tokens per target call (τ, from
    its speculative_stats), over the first and over the last quarter of the requests."""
    quarter = max(1, len(answers) // 4)
    out = {}
    for part, mine in (("first_quarter", answers[:quarter]), ("last_quarter", answers[-quarter:])):
        tokens = sum(a["usage"]["completion_tokens"] for a, _ in mine)
        calls = sum(a["speculative_stats"]["target_calls"] for a, _ in mine)
        out[part] = {"tokens_per_second": round(tokens / sum(t for _, t in mine), 2),
                     "tokens_per_call": round(tokens / max(1, calls), 3)}
    return out


def _speculative(method: str, k) -> dict:
    """A request's speculative settings: the drafter, and k for the speculative ones. ``method``: a drafter's name,
    or ``NAME@K`` with its own k (a number, ``auto``, or ``server``: the request names none, so the server's default
    applies, a cap the batch planner may lower)."""
    drafter, _, own = method.partition("@")
    k = own or k
    if drafter == "none" or k == "server":
        return {"drafter": drafter}
    return {"drafter": drafter, "k": parse_k(k)}


def run(model: str, clients: list[int], requests: int, max_tokens: int, drafters: list[str] = ("none", "lookup"),
        dtype: str = "int8", prefix_cache: bool = True, k: str | int = "auto", prompts: str = "copy",
        draft_model: str | None = None, modes: tuple[str, ...] = MODES, stream: bool = False) -> dict:
    machine = machine_header()  # at the start: the threads and load as the run begins
    import httpx

    from ..server import ServerConfig, build_app
    from ..server.background import BackgroundServer

    config = ServerConfig(model=model, spec=SpeculativeSpec("model" if draft_model else "auto"), draft_model=draft_model,
                          max_batch=max(clients), max_queue=max(clients) * 2, dtype=dtype, prefix_cache=prefix_cache)
    app = build_app(config)  # as `speculate serve` builds it: models loaded on the generation thread
    scheduler = app.state.scheduler
    rounds = []
    record_round = scheduler.on_round
    scheduler.on_round = lambda n, rows, seconds: (rounds.append((n, rows, seconds)), record_round(n, rows, seconds))
    server = BackgroundServer(app)
    # ``json``, ``code-edit``: each clients count gets prompts of its own, so that `suffix` (which learns from its
    # answers) never meets a prompt an earlier cell answered; the other sets repeat their 8-16 prompts in every cell.
    distinct = prompts in LEARNING
    texts = prompt_texts(prompts, max([requests, *clients]) * (len(clients) if distinct else 1))
    rows = []
    try:
        with httpx.Client() as http:
            scheduler.max_batch = 1
            reference = {p: _chat(http, server.url, model, p, {"drafter": "none"}, max_tokens)[0]
                         ["choices"][0]["message"]["content"] for p in texts}
            # Warm-up, not timed: each drafter's first decoder (an answer store to load, --k auto's cost profiles to
            # measure once per machine), and a batched round.
            scheduler.max_batch = 2
            for drafter in drafters:  # (share: false: the warm-up's answers do not feed a learning drafter)
                speculative = {**_speculative(drafter, k), "share": False}
                with ThreadPoolExecutor(2) as threads:
                    list(threads.map(lambda p: _chat(http, server.url, model, p, speculative, 8), texts[:2]))
            cell = 0
            for c, n_clients in enumerate(clients):
                n_jobs = max(requests, n_clients)
                base = c * max([requests, *clients]) if distinct else 0
                for drafter in drafters:
                    speculative = _speculative(drafter, k)
                    jobs = [texts[(base + i) % len(texts)] for i in range(n_jobs)]
                    for mode in (modes if cell % 2 == 0 else modes[::-1]):
                        scheduler.max_batch = 1 if mode == "one" else n_clients
                        del rounds[:]
                        t0 = time.perf_counter()
                        with ThreadPoolExecutor(n_clients) as threads:
                            answers = list(threads.map(
                                lambda p: _chat(http, server.url, model, p, speculative, max_tokens, stream), jobs))
                        dt = time.perf_counter() - t0
                        tokens = sum(a["usage"]["completion_tokens"] for a, _ in answers)
                        same = sum(a["choices"][0]["message"]["content"] == reference[p]
                                   for (a, _), p in zip(answers, jobs))
                        rows.append({
                            "clients": n_clients, "drafter": drafter, "mode": mode, "requests": len(jobs),
                            "seconds": round(dt, 2), "tokens_per_second": round(tokens / dt, 2),
                            "requests_per_second": round(len(jobs) / dt, 3),
                            "mean_latency_seconds": round(statistics.fmean(t for _, t in answers), 3),
                            "mean_generations_per_forward": round(statistics.fmean(r[0] for r in rounds), 2),
                            "mean_rows_per_forward": round(statistics.fmean(r[1] for r in rounds), 2),
                            "tokens_per_call": round(tokens / sum(r[0] for r in rounds), 3),  # τ (its prefill rounds count)
                            "rounds": len(rounds), "mean_round_ms": round(1000 * statistics.fmean(r[2] for r in rounds), 2),
                            "busy_share": round(sum(r[2] for r in rounds) / dt, 3),
                            "identical_answers": f"{same}/{len(jobs)}"})
                        if not stream:  # as a learning drafter's index warms: the first and the last quarter
                            rows[-1].update(_quarters(answers))
                        else:  # time to first text, and between text chunks (one round's tokens a chunk)
                            ttfts = [a["ttft"] for a, _ in answers if a["ttft"] is not None]
                            gaps = [g for a, _ in answers for g in a["gaps"]]
                            rows[-1].update(ttft_p50=round(statistics.median(ttfts), 4),
                                            ttft_p95=round(percentile(ttfts, 0.95), 4),
                                            chunk_gap_p50_ms=round(1000 * statistics.median(gaps), 2) if gaps else None)
                        print(f"  {rows[-1]}", file=sys.stderr, flush=True)
                    cell += 1
    finally:
        server.stop()
    by = {(r["clients"], r["drafter"], r["mode"]): r for r in rows}
    for r in rows:
        if (r["clients"], r["drafter"], "one") in by:
            one = by[(r["clients"], r["drafter"], "one")]
            r["x_one_at_a_time"] = round(r["tokens_per_second"] / one["tokens_per_second"], 3)
        if (r["clients"], "none", r["mode"]) in by:
            plain = by[(r["clients"], "none", r["mode"])]
            r["x_plain_same_mode"] = round(r["tokens_per_second"] / plain["tokens_per_second"], 3)
            for part in ("first_quarter", "last_quarter"):
                if part in r and part in plain:
                    r[part]["x_plain"] = round(r[part]["tokens_per_second"] / plain[part]["tokens_per_second"], 3)
    return {"date": date.today().isoformat(), **machine, "model": model, "draft_model": draft_model, "dtype": dtype,
            "prefix_cache": prefix_cache, "max_tokens": max_tokens, "k": k, "prompts": prompts, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.serve_load", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--draft-model", help="for the drafters that take one (model, model-tree, model+lookup)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--requests", type=int, default=16, help="requests per (clients, drafter, mode) cell, at least "
                                                            "one per client")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drafters", nargs="+", default=["none", "lookup", "retrieval"], type=_method,
                   help="drafters to compare (requests name them; default none lookup retrieval); NAME@K gives one its "
                        "own k, and NAME@server names no k (the server's --k 6 applies: a cap the planner may lower)")
    p.add_argument("--k", default="auto", help="the speculative requests' k (default auto: k by batch size; server: "
                                               "none named)")
    p.add_argument("--prompts", default="copy", choices=PROMPTS)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="one (max_batch 1) and/or batched (max_batch = the clients); default both, interleaved")
    p.add_argument("--dtype", default="int8", choices=list(DTYPES))
    p.add_argument("--no-prefix-cache", action="store_true", help="as `speculate serve --no-prefix-cache`")
    p.add_argument("--stream", action="store_true", help="streamed requests: also TTFT p50 / p95 and the gap between "
                                                             "text chunks")
    p.add_argument("--out")
    a = p.parse_args(argv)
    k = a.k if a.k == "server" else parse_k(a.k)
    return emit(run(a.model, a.clients, a.requests, a.max_tokens, a.drafters, a.dtype, not a.no_prefix_cache, k,
                    a.prompts, a.draft_model, tuple(a.modes), a.stream), a.out)


def _method(value: str) -> str:
    """--drafters' type: a drafter's name, optionally @K (a number, auto or server)."""
    drafter = value.partition("@")[0]
    if drafter not in ALL_DRAFTERS:
        raise argparse.ArgumentTypeError(f"unknown drafter {drafter!r}; choose one of: {', '.join(ALL_DRAFTERS)}")
    try:
        _speculative(value, "auto")  # (its k, read as the requests will read it)
    except SpeculateError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


if __name__ == "__main__":
    sys.exit(script(main))
