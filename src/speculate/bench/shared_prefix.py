"""Time to first token when chat requests share a long system prompt but not their speculative settings: the server
with the prefix store (models/prefix_store.py) against the server without it, in the same run.

    python -m speculate.bench.shared_prefix [--model M] [--dtype q4] [--groups 4] [--system-tokens 1000]
                                            [--max-tokens 32] [--out FILE.json]
    python -m speculate.bench.shared_prefix --clients 16 [--requests 4] [--rounds 2] [--workload system|gsm8k-8shot]
                                            [--servers store,no store]

Two `speculate serve` apps on loopback ports, in this process, with the same model: ``store`` (the default: the prefix store,
1 GiB) and ``no store`` (``--prefix-cache-gib 0``: every prompt computed whole). Older records name it ``decoders only``: the
server then also kept idle decoders, and a prompt reused a prefix from one built for the same settings. Each group of requests has a system prompt
of its own (~``--system-tokens`` tokens, MT-Bench questions joined: shipped text) and sends it with four different
questions, each with other speculative settings (:data:`SETTINGS`): the first request of a group has nothing cached,
the next three find the system prompt computed by a request with other settings. Every request goes to both servers,
one after the other, in an order that alternates; each streams, and its time to first token is the time to the first
text chunk. Reported per server: TTFT of the first request of each group (uncached) and of the others, the ratio,
tokens/s over whole requests, cached prompt tokens (``usage.prompt_tokens_details``) and whether both servers gave the
same text (they must at int8 and q4).

With ``--clients N``: concurrent clients instead, each server in turn (the order alternating by round), N clients at
once, client c with the speculative settings ``SETTINGS[c % 4]``, each sending ``--requests`` requests one after the
other. ``--workload system``: every request carries the same ~``--system-tokens`` system prompt and a question of its
own; ``gsm8k-8shot``: the paper's 8-shot GSM8K prompt, the same eight examples before each question. Reported per
server: TTFT of each client's first request (the clients start together: nothing cached yet) and of the later ones,
aggregate tokens/s, cached prompt tokens over prompt tokens, and whether both servers gave the same text.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import date

from ..models import DEFAULT_MODEL, DTYPES
from ..spec import SpeculativeSpec
from . import emit, machine_header, script
from .client import chat, percentile
from .datasets import load_dataset

# Four speculative settings, one per request of a group: no two requests of a group share a decoder's settings.
SETTINGS = [{"drafter": "none"}, {"drafter": "lookup", "k": 6}, {"drafter": "lookup", "k": 3},
            {"drafter": "lookup", "k": 4, "verifier": "consultant"}]
SERVERS = {"store": 1.0, "no store": 0.0}  # --prefix-cache-gib


def system_prompts(tokenizer, groups: int, tokens: int) -> list[str]:
    """``groups`` different system prompts of about ``tokens`` tokens each: MT-Bench questions, joined."""
    questions = [s.turns[0] for s in load_dataset("mt_bench", limit=80, shots=0)]
    out, i = [], 0
    for g in range(groups):
        parts = [f"You are assistant number {g}. Keep in mind these earlier questions:"]
        while len(tokenizer(" ".join(parts))["input_ids"]) < tokens:
            parts.append(questions[i % len(questions)])
            i += 1
        out.append(" ".join(parts))
    return out


def _stream(http, url: str, model: str, system: str, question: str, speculative: dict, max_tokens: int):
    """(seconds to the first text chunk, seconds in all, text, usage) of one streamed greedy chat request."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "speculative": speculative,
            "messages": ([{"role": "system", "content": system}] if system is not None else [])
            + [{"role": "user", "content": question}]}
    answer, seconds = chat(http, url, body)
    return answer["ttft"], seconds, answer["choices"][0]["message"]["content"], answer["usage"]


def _row(ttft: float, seconds: float, text: str, usage: dict, **where) -> dict:
    """One request's record: where it ran (server, group or client, request...), its times, tokens and text."""
    return {**where, "ttft_seconds": round(ttft, 4), "seconds": round(seconds, 4),
            "completion_tokens": usage["completion_tokens"], "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "text": text}


def _server_summary(mine: list[dict]) -> dict:
    """TTFT of the first requests (request 0) and of the later ones, and the prompt tokens a server found cached."""
    first = [r["ttft_seconds"] for r in mine if r["request"] == 0]
    later = [r["ttft_seconds"] for r in mine if r["request"] > 0]
    return {"ttft_first_median": round(statistics.median(first), 4),
            "ttft_later_median": round(statistics.median(later), 4) if later else None,
            "ttft_later_p95": round(percentile(later, 0.95), 4) if later else None,
            "ttft_later_over_first": round(statistics.median(later) / statistics.median(first), 3) if later else None,
            "cached_prompt_tokens": sum(r["cached_tokens"] for r in mine),
            "prompt_tokens": sum(r["prompt_tokens"] for r in mine)}


def _summaries(rows: list[dict], names, seconds, *keys: str) -> dict:
    """Per server: :func:`_server_summary` and tokens/s over ``seconds(name, its rows)``; and the same-text count of
    the requests named by ``keys``."""
    summary = {}
    for name in names:
        mine = [r for r in rows if r["server"] == name]
        summary[name] = {**_server_summary(mine), "tokens_per_second": round(
            sum(r["completion_tokens"] for r in mine) / seconds(name, mine), 2)}
    summary["same_text_on_both"] = _same_text(rows, *keys)
    return summary


def _same_text(rows: list[dict], *keys: str) -> str:
    """How many requests (by ``keys``) got the same text from both servers."""
    texts = {}
    for r in rows:
        texts.setdefault(tuple(r[k] for k in keys), set()).add(r["text"])
    return f"{sum(len(t) == 1 for t in texts.values())}/{len(texts)}"


def run(model: str, dtype: str, groups: int, system_tokens: int, max_tokens: int) -> dict:
    machine = machine_header()  # at the start: the threads and load as the run begins
    import httpx

    from ..server import ServerConfig, build_app
    from ..server.background import BackgroundServer

    apps = {name: build_app(ServerConfig(model=model, dtype=dtype, spec=SpeculativeSpec("lookup"), max_batch=4,
                                         prefix_cache_gib=gib)) for name, gib in SERVERS.items()}
    servers = {name: BackgroundServer(app) for name, app in apps.items()}
    tokenizer = apps["store"].state.target.tokenizer
    systems = system_prompts(tokenizer, groups + 1, system_tokens)
    questions = [s.turns[0] for s in load_dataset("gsm8k", limit=4 * (groups + 1), shots=0)]
    rows = []
    try:
        with httpx.Client() as http:
            # Warm-up, not timed: each setting's first decoder on each server, on a system prompt of its own.
            for name, server in servers.items():
                for j, speculative in enumerate(SETTINGS):
                    _stream(http, server.url, model, systems[-1], questions[-1 - j], speculative, 4)
            for g in range(groups):
                for j, speculative in enumerate(SETTINGS):
                    order = list(servers) if (g * len(SETTINGS) + j) % 2 == 0 else list(servers)[::-1]
                    for name in order:
                        ttft, seconds, text, usage = _stream(http, servers[name].url, model, systems[g],
                                                             questions[g * len(SETTINGS) + j], speculative, max_tokens)
                        rows.append(_row(ttft, seconds, text, usage, server=name, group=g, request=j,
                                         speculative=speculative))
    finally:
        for server in servers.values():
            server.stop()
    summary = _summaries(rows, servers, lambda name, mine: sum(r["seconds"] for r in mine), "group", "request")
    return {"date": date.today().isoformat(), **machine, "model": model, "dtype": dtype, "groups": groups,
            "system_tokens": system_tokens, "max_tokens": max_tokens, "settings": SETTINGS, "summary": summary,
            "rows": rows}


def run_concurrent(model: str, dtype: str, clients: int, requests: int, rounds: int, workload: str,
                   system_tokens: int, max_tokens: int, names=tuple(SERVERS)) -> dict:
    """The --clients mode (module docstring); ``names``: the servers of :data:`SERVERS` to run (--servers)."""
    machine = machine_header()
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from ..server import ServerConfig, build_app
    from ..server.background import BackgroundServer

    apps = {name: build_app(ServerConfig(model=model, dtype=dtype, spec=SpeculativeSpec("lookup"), max_batch=clients,
                                         max_queue=2 * clients, prefix_cache_gib=SERVERS[name],
                                         max_connections_per_client=0))
            for name in names}  # (every client from one address: no per-address cap)
    servers = {name: BackgroundServer(app) for name, app in apps.items()}
    n = clients * requests
    if workload == "system":
        system = system_prompts(next(iter(apps.values())).state.target.tokenizer, 1, system_tokens)[0]
        questions = [s.turns[0] for s in load_dataset("gsm8k", limit=n * rounds + 4, shots=0)]
        asks = [(system, q) for q in questions]
    else:  # gsm8k-8shot: the examples in the user turn, before the question
        asks = [(None, s.turns[0]) for s in load_dataset("gsm8k", limit=n * rounds + 4, shots=8)]
    rows = []

    def client(name: str, round_: int, c: int) -> list[dict]:
        out = []
        with httpx.Client() as http:
            for i in range(requests):
                system, question = asks[round_ * n + c * requests + i]
                ttft, seconds, text, usage = _stream(http, servers[name].url, model, system, question,
                                                     SETTINGS[c % len(SETTINGS)], max_tokens)
                out.append(_row(ttft, seconds, text, usage, server=name, round=round_, client=c, request=i))
        return out

    try:
        with httpx.Client() as http:  # warm-up, not timed: each setting's first decoder on each server
            for server in servers.values():
                for j, speculative in enumerate(SETTINGS):
                    system, question = asks[-1 - j]
                    _stream(http, server.url, model, system, question, speculative, 4)
        walls = {name: [] for name in servers}
        for round_ in range(rounds):
            for name in (list(servers) if round_ % 2 == 0 else list(servers)[::-1]):
                start = time.perf_counter()
                with ThreadPoolExecutor(clients) as pool:
                    for part in pool.map(lambda c: client(name, round_, c), range(clients)):
                        rows.extend(part)
                walls[name].append(time.perf_counter() - start)
    finally:
        for server in servers.values():
            server.stop()
    summary = _summaries(rows, servers, lambda name, mine: sum(walls[name]), "round", "client", "request")
    for name in servers:
        summary[name]["wall_seconds"] = [round(w, 2) for w in walls[name]]
    return {"date": date.today().isoformat(), **machine, "model": model, "dtype": dtype, "clients": clients,
            "requests": requests, "rounds": rounds, "workload": workload, "system_tokens": system_tokens,
            "max_tokens": max_tokens, "settings": SETTINGS, "summary": summary, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.shared_prefix", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="q4", choices=list(DTYPES))
    p.add_argument("--groups", type=int, default=4, help="system prompts, each sent with four questions")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--clients", type=int, default=0, help="concurrent clients (0: the sequential groups)")
    p.add_argument("--requests", type=int, default=4, help="with --clients: requests per client, one after another")
    p.add_argument("--rounds", type=int, default=2, help="with --clients: rounds, the servers' order alternating")
    p.add_argument("--workload", default="system", choices=["system", "gsm8k-8shot"])
    p.add_argument("--servers", default=",".join(SERVERS), help="with --clients: which of them, comma-separated "
                   "(store: an old-against-new run of the store alone)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    names = [n.strip() for n in a.servers.split(",") if n.strip()]
    if not names or any(n not in SERVERS for n in names):
        p.error(f"--servers takes a comma-separated list of: {', '.join(SERVERS)}")
    if names != list(SERVERS) and not a.clients:
        p.error("--servers needs --clients (the sequential groups always compare both servers)")
    if a.clients:
        return emit(run_concurrent(a.model, a.dtype, a.clients, a.requests, a.rounds, a.workload, a.system_tokens,
                                   a.max_tokens, names), a.out)
    return emit(run(a.model, a.dtype, a.groups, a.system_tokens, a.max_tokens), a.out)


if __name__ == "__main__":
    raise SystemExit(script(main))
