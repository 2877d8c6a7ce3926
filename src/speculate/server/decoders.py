"""Decoders kept between requests, so that a prompt reuses the KV of the prefix it shares with an earlier
request's tokens — the earlier turns of a chat, a long system prompt, few-shot examples
(``SpeculativeDecoder(target, spec, prefix_cache=True)``, models/kv.py ``PrefixReuse``).

A decoder holds per-generation state and serves one request at a time: :meth:`Decoders.take` hands out an
idle decoder built for the same speculative settings — the one whose cached tokens share the longest
prefix with the prompt — or builds one; :meth:`Decoders.give_back` returns it when its generation ends.
At most ``keep`` idle decoders are kept (each holds a KV cache sized to its longest generation); the least
recently returned goes first. A decoder whose generation failed is not returned.
"""

from __future__ import annotations

import threading
from typing import Callable

from ..engine import SpeculativeDecoder
from ..models.kv import shared_prefix
from ..spec import SpeculativeSpec


class Decoders:
    """``spec``: a :class:`~speculate.spec.SpeculativeSpec` (frozen, compared by value: the key)."""

    def __init__(self, build: Callable[[SpeculativeSpec], SpeculativeDecoder], keep: int):
        self.build, self.keep = build, keep
        self._idle: list[tuple[SpeculativeSpec, SpeculativeDecoder]] = []  # oldest first
        self._lock = threading.Lock()

    def take(self, spec: SpeculativeSpec, ids: list[int]) -> SpeculativeDecoder:
        with self._lock:
            mine = [i for i, (k, _) in enumerate(self._idle) if k == spec]
            if mine:
                best = max(mine, key=lambda i: (shared_prefix(self._idle[i][1].prefix_reuse.tokens, ids), i))
                return self._idle.pop(best)[1]
        return self.build(spec)

    def trim(self, most: int) -> None:
        """Drop idle decoders, the least recently returned first, until their KV caches hold at most ``most`` bytes
        (the scheduler's --kv-memory admission makes room so)."""
        with self._lock:
            while self._idle and sum(_kv_bytes(d) for _, d in self._idle) > max(most, 0):
                del self._idle[0]

    def give_back(self, spec: SpeculativeSpec, decoder: SpeculativeDecoder) -> None:
        with self._lock:
            self._idle.append((spec, decoder))
            del self._idle[: max(0, len(self._idle) - self.keep)]


def _kv_bytes(decoder: SpeculativeDecoder) -> int:
    """The KV bytes a decoder holds: the target's cache and its drafter's (a draft model's, Drafter.cache_bytes)."""
    return decoder.kv.nbytes + decoder.drafter.cache_bytes()
