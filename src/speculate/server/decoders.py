"""The server's decoders: one per speculative settings, shared by every request with those settings.

A :class:`~speculate.engine.SpeculativeDecoder` is immutable once built — the models, the settings, the built
drafter and verifier — and each request's :class:`~speculate.engine.Run` has its own KV cache and drafter state, so
any number of requests run on one decoder at once. Building one may cost (an answer store or heads loaded, a cost
profile measured, ε calibrated), so it is built at the first request with its settings and kept; at most ``keep``
are kept, the least recently used goes first. A prompt's prefix is found in the prefix store whatever decoder
computed it (models/prefix_store.py), so which decoder a request gets says nothing about its cached tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable

from ..engine import SpeculativeDecoder
from ..spec import SpeculativeSpec


class Decoders:
    """``spec``: a :class:`~speculate.spec.SpeculativeSpec` (frozen, compared by value: the key)."""

    def __init__(self, build: Callable[[SpeculativeSpec], SpeculativeDecoder], keep: int):
        self.build, self.keep = build, max(1, keep)
        self._built: OrderedDict[SpeculativeSpec, SpeculativeDecoder] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def get(self, spec: SpeculativeSpec) -> SpeculativeDecoder:
        """The decoder for ``spec``: the one kept, or a new one (raises what ``build`` raises: a 400)."""
        with self._lock:
            decoder = self._built.get(spec)
            if decoder is not None:
                self._built.move_to_end(spec)
                return decoder
        decoder = self.build(spec)  # (outside the lock: it may take seconds)
        with self._lock:
            decoder = self._built.setdefault(spec, decoder)
            self._built.move_to_end(spec)
            while len(self._built) > self.keep:
                self._built.popitem(last=False)
        return decoder
