"""Time to first token when chat requests share a long system prompt but not their speculative settings: the server
with the prefix store (models/prefix_store.py) against the server without it, in the same run.

    python -m speculate.bench.shared_prefix [--model M] [--dtype q4] [--groups 4] [--system-tokens 1000]
                                            [--max-tokens 32] [--out FILE.json]

Two `speculate serve` apps on loopback ports, in this process, with the same model: ``store`` (the default: decoders
kept between requests, and the prefix store, 1 GiB) and ``decoders only`` (``--prefix-cache-gib 0``: a prompt reuses a
prefix only from an idle decoder built for the same speculative settings). Each group of requests has a system prompt
of its own (~``--system-tokens`` tokens, MT-Bench questions joined: shipped text) and sends it with four different
questions, each with other speculative settings (:data:`SETTINGS`): the first request of a group has nothing cached,
the next three find the system prompt computed by a request with other settings. Every request goes to both servers,
one after the other, in an order that alternates; each streams, and its time to first token is the time to the first
text chunk. Reported per server: TTFT of the first request of each group (uncached) and of the others, the ratio,
tokens/s over whole requests, cached prompt tokens (``usage.prompt_tokens_details``) and whether both servers gave the
same text (they must at int8 and q4).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import date

from ..models import DEFAULT_MODEL, DTYPES
from ..spec import SpeculativeSpec
from . import emit, machine_header, script
from .datasets import load_dataset

# Four speculative settings, one per request of a group: no two requests of a group share a decoder's settings.
SETTINGS = [{"drafter": "none"}, {"drafter": "lookup", "k": 6}, {"drafter": "lookup", "k": 3},
            {"drafter": "lookup", "k": 4, "verifier": "consultant"}]
SERVERS = {"store": 1.0, "decoders only": 0.0}  # --prefix-cache-gib


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
    """(seconds to the first text chunk, seconds in all, text, usage) of one streamed chat request."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "speculative": speculative,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    start = time.perf_counter()
    first, text, usage = None, [], None
    with http.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - start
                    text.append(piece)
    return first, time.perf_counter() - start, "".join(text), usage


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
                        rows.append({"server": name, "group": g, "request": j, "speculative": speculative,
                                     "ttft_seconds": round(ttft, 4), "seconds": round(seconds, 4),
                                     "completion_tokens": usage["completion_tokens"],
                                     "prompt_tokens": usage["prompt_tokens"],
                                     "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "text": text})
    finally:
        for server in servers.values():
            server.stop()
    summary = {}
    for name in servers:
        mine = [r for r in rows if r["server"] == name]
        first = [r["ttft_seconds"] for r in mine if r["request"] == 0]
        later = [r["ttft_seconds"] for r in mine if r["request"] > 0]
        summary[name] = {
            "ttft_first_of_group_median": round(statistics.median(first), 4),
            "ttft_later_median": round(statistics.median(later), 4),
            "ttft_later_over_first": round(statistics.median(later) / statistics.median(first), 3),
            "tokens_per_second": round(sum(r["completion_tokens"] for r in mine) / sum(r["seconds"] for r in mine), 2),
            "cached_prompt_tokens": sum(r["cached_tokens"] for r in mine),
            "prompt_tokens": sum(r["prompt_tokens"] for r in mine)}
    texts = {}
    for r in rows:
        texts.setdefault((r["group"], r["request"]), set()).add(r["text"])
    summary["same_text_on_both"] = f"{sum(len(t) == 1 for t in texts.values())}/{len(texts)}"
    return {"date": date.today().isoformat(), **machine, "model": model, "dtype": dtype, "groups": groups,
            "system_tokens": system_tokens, "max_tokens": max_tokens, "settings": SETTINGS, "summary": summary,
            "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.shared_prefix", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="q4", choices=list(DTYPES))
    p.add_argument("--groups", type=int, default=4, help="system prompts, each sent with four questions")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out")
    a = p.parse_args(argv)
    return emit(run(a.model, a.dtype, a.groups, a.system_tokens, a.max_tokens), a.out)


if __name__ == "__main__":
    raise SystemExit(script(main))
