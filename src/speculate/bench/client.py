"""The server benchmarks' client side (``serve_load``, ``shared_prefix``): one chat request, whole or streamed, and
the percentile rule their latency columns share."""

from __future__ import annotations

import json
import math
import time


def chat(http, url: str, body: dict) -> tuple[dict, float]:
    """(the answer, seconds) of one chat request with ``body`` to the server at ``url``. A streamed body
    (``"stream": true``) comes back as the whole answer rebuilt from its chunks (:func:`read_stream`). A 429
    (back-pressure) is retried after the server's Retry-After, and its wait counts in the seconds."""
    start = time.perf_counter()
    while True:
        if body.get("stream"):
            with http.stream("POST", url + "/v1/chat/completions", json=body, timeout=900) as r:
                if r.status_code != 429:
                    r.raise_for_status()
                    return read_stream(r, start), time.perf_counter() - start
        else:
            r = http.post(url + "/v1/chat/completions", json=body, timeout=900)
            if r.status_code != 429:
                r.raise_for_status()
                return r.json(), time.perf_counter() - start
        time.sleep(float(r.headers.get("Retry-After", 1)))


def read_stream(response, start: float) -> dict:
    """A streamed chat answer (server-sent events) as the whole one: its text and usage as a plain answer has
    them, and ``ttft`` (seconds from ``start`` to the first text; None without text) and ``gaps`` (seconds between
    text chunks)."""
    text, usage, times = [], None, []
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            piece = choice.get("delta", {}).get("content")
            if piece:
                times.append(time.perf_counter() - start)
                text.append(piece)
    return {"choices": [{"message": {"content": "".join(text)}}], "usage": usage,
            "ttft": times[0] if times else None, "gaps": [b - a for a, b in zip(times, times[1:])]}


def percentile(values, share: float) -> float | None:
    """The nearest-rank percentile: the smallest value with at least ``share`` of the values at or below it (0.95:
    p95; 0.5 of an even count: the lower middle one). None for no values."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)] if ordered else None
