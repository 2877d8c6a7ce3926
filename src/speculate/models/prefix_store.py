"""Prompt prefixes' KV shared by every generation on one model, whatever its speculative settings.

A generation's cache (models/kv.py, fast.py) is its own contiguous buffer, so two requests that share a long system
prompt or the same few-shot examples each computed it. The store keeps the keys and values of prompts in full blocks
of :data:`BLOCK` tokens; a block's key is the hash of its tokens *and* of every token before it (the hash of the
previous block's key and its own tokens: vLLM's automatic prefix caching), so a block is found only after the same
whole prefix. A new generation copies the blocks of its prompt's longest cached prefix into its cache and computes the
rest (:meth:`PrefixStore.fill`); once its prompt is in the cache, the blocks not yet stored are copied out
(:meth:`PrefixStore.add`). Copying a block costs a memcpy; computing it, a forward of every layer.

A hash never decides alone: each entry keeps its tokens and its parent's key, and a lookup takes a block only when
both match what it looks for, so two prefixes whose keys collide are never confused (the tests force a tiny hash
space to check it). The store holds at most ``budget`` bytes; the least recently used blocks go first, and a prefix's
blocks are used deepest first, so that eviction shortens a cached prefix from its end (a block whose parent went
could no longer be reached).

Exactness: at int8 and q4 a row's keys and values do not depend on the other rows of the forward that computed them
(batch-invariant kernels, models/exactness.py), so a copied block has the bits a fresh prefill would give and a
generation's tokens are the same with or without the store. At fp32 they may differ in the last bits (as the
decoder's own prefix reuse, engine.SpeculativeDecoder ``prefix_cache``), so a near-tie may resolve otherwise.
Only the lean Llama-family caches (models/fast.py) take part; the Hugging Face path computes its prompt.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK = 16  # tokens per block: small enough to catch most of a shared prefix, large enough that a lookup is cheap


@dataclass
class _Entry:
    parent: bytes | None  # the key of the block before it (None: the first block)
    tokens: tuple[int, ...]
    keys: torch.Tensor  # the cache's layout (FastKVModel.read_rows)
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class PrefixStore:
    """Full prompt blocks' KV of one loaded model, shared by all its generations (see the module's docstring).
    ``budget``: bytes at most; ``block``: tokens per block; ``digest_size``: bytes of each key (a test makes it tiny
    to force collisions)."""

    def __init__(self, budget: int, block: int = BLOCK, digest_size: int = 16):
        if budget < 0 or block < 1:
            raise ValueError("the prefix store needs a budget >= 0 bytes and blocks of >= 1 token")
        self.budget, self.block, self.digest_size = budget, block, digest_size
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.lookups = self.hit_tokens = self.looked_up_tokens = 0  # /metrics: the hit rate over prompt tokens
        self._lock = threading.Lock()

    def _key(self, parent: bytes | None, tokens) -> bytes:
        h = hashlib.blake2b(digest_size=self.digest_size)
        h.update(parent or b"")
        h.update(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes())
        return h.digest()

    def _chain(self, tokens: list[int]):
        """(parent key, key, block tokens, start) of each full block of ``tokens``, in order."""
        parent = None
        for start in range(0, len(tokens) - self.block + 1, self.block):
            part = tuple(tokens[start: start + self.block])
            key = self._key(parent, part)
            yield parent, key, part, start
            parent = key

    def _find(self, parent: bytes | None, key: bytes, part: tuple) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None or entry.parent != parent or entry.tokens != part:  # a collision is a miss
            return None
        return entry

    # -- a generation's side -----------------------------------------------------------------------------
    def fill(self, kv, tokens: list[int], have: int = 0) -> int:
        """Copy into ``kv`` (reset for this generation, holding its first ``have`` positions already) the cached
        blocks of the longest cached prefix of ``tokens`` (the prompt tokens the prefill would compute); returns the
        positions ``kv`` now holds: ``have``, or the end of the last block copied where that is further."""
        with self._lock:
            found = []
            for parent, key, part, start in self._chain(tokens):
                entry = self._find(parent, key, part)
                if entry is None:
                    break
                found.append((start, key, entry))
            self._touch([key for _, key, _ in found])
            self.lookups += 1
            self.looked_up_tokens += len(tokens)
            end = found[-1][0] + self.block if found else 0
            if end <= have:
                self.hit_tokens += have
                return have
            self.hit_tokens += end
            for start, _, entry in found:
                if start + self.block > have:  # (the positions below have are there already)
                    kv.write_rows(start, entry.keys, entry.values)
        kv.length = end
        return end

    def add(self, kv, tokens: list[int]) -> None:
        """Store the full blocks of ``tokens`` (whose KV ``kv`` holds at positions 0..len(tokens)-1) that are not
        stored yet, then evict the least recently used blocks beyond the budget."""
        with self._lock:
            chain = []
            for parent, key, part, start in self._chain(tokens[: kv.length]):
                if self._find(parent, key, part) is None:
                    if key in self._entries:  # a colliding key holds another prefix: keep that one, stop here
                        break
                    keys, values = kv.read_rows(start, self.block)
                    entry = _Entry(parent, part, keys, values)
                    self._entries[key] = entry
                    self.bytes += entry.nbytes
                chain.append(key)
            self._touch(chain)
            while self.bytes > self.budget:
                _, entry = self._entries.popitem(last=False)
                self.bytes -= entry.nbytes

    def _touch(self, chain: list[bytes]) -> None:
        """Mark a prefix's blocks used: the deepest first, so that its first block is the last of them to go."""
        for key in reversed(chain):
            self._entries.move_to_end(key)

    # -- what /metrics shows ----------------------------------------------------------------------------------
    @property
    def blocks(self) -> int:
        return len(self._entries)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in the store (or in a decoder's own cache) over prompt tokens looked up."""
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0
