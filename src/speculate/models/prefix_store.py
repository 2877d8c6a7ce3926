"""Prompt prefixes' KV shared by every generation on one model, whatever its speculative settings.

Without it, two requests that share a long system prompt or the same few-shot examples each computed it. The store
keeps the keys and values of prompts in full blocks of :data:`BLOCK` tokens; a block's key is the hash of its tokens
*and* of every token before it (the hash of the previous block's key and its own tokens: vLLM's automatic prefix
caching), so a block is found only after the same whole prefix. As a generation's prompt goes into its cache, its
full blocks not yet stored go into the store, and at its end its whole sequence, the tokens after its last full block
included (:meth:`PrefixStore.add`); a new generation takes the blocks of its prompt's longest cached prefix and
computes the rest (:meth:`PrefixStore.fill`). Where the cache is paged (the compiled attention,
models/paged.py) a block is not copied either way: the store holds the generation's very block (counted, never written
again: a table that would write into a shared block copies it first), and a later generation maps it into its block
table, so a prefix that any number of running requests share is held once. The PyTorch attentions' contiguous caches
copy rows out and in (a memcpy; computing them is a forward of every layer).

One store serves every model of a process (the server's target and draft model): a chain of keys starts from a
root of its own per model (:func:`_root`), so two models' blocks of the same tokens are two entries, under one
budget.

A prompt that shares only part of a block with a stored one (the chat template and the first words of a question, a
system prompt of 100 tokens) takes that part too: after its last full cached block, the stored block that continues
the same prefix and shares the most leading tokens with the prompt's next ones gives those rows, copied into the
generation's own block (:data:`MIN_PARTIAL` tokens at least), so the store's granularity is a token, not a block.

A hash never decides alone: each entry keeps its tokens and its parent's key, and a lookup takes a block only when
both match what it looks for, so two prefixes whose keys collide are never confused (the tests force a tiny hash
space to check it). The store holds at most ``budget`` bytes; the least recently used blocks go first, and a prefix's
blocks are used deepest first, so that eviction shortens a cached prefix from its end (a block whose parent went
could no longer be reached).

Exactness: at int8 and q4 a row's keys and values do not depend on the other rows of the forward that computed them
(batch-invariant kernels, models/exactness.py), so a stored block has the bits a fresh prefill would give, the kernel
reads a block wherever it sits, and a generation's tokens are the same with or without the store. At fp32 they may differ in the last bits, so a
near-tie may resolve otherwise.
The Hugging Face path's caches (models/kv.py, HFKVModel) copy rows out and in too.
"""

from __future__ import annotations

import array
import hashlib
import os
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from .paged import BLOCK  # tokens per block: the paged cache's, so that a stored block is one of its blocks

# The fewest leading tokens of a block worth taking from a stored block that shares only part of it (a copy of that
# many rows against their prefill).
MIN_PARTIAL = 8


def shared_prefix(a, b) -> int:
    """How many leading tokens the sequences ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


_ROOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a model's module -> the root of its key chains


def _root(kv) -> bytes:
    """The key before a prompt's first block in ``kv``'s model: random per model (its ``nn.Module``), so that the
    blocks of two models (a target and its draft model, a layer-skip view of the target) never match."""
    return _ROOTS.setdefault(kv.loaded.model, os.urandom(16))


@dataclass
class _Entry:
    parent: bytes  # the key of the block before it (the model's root: the first block)
    tokens: tuple[int, ...]
    block: object  # the cache's export_block: a paged.Block held by the store, or a CopiedBlock
    # The target's hidden rows of the block's positions, by the layers tapped beside the final-normed rows (an
    # EAGLE head's feature_layers: kv.hidden's width), where a generation whose drafter reads them computed it.
    hidden: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return self.block.nbytes + sum(rows.nbytes for rows in self.hidden.values())


class PrefixStore:
    """Full prompt blocks' KV of one loaded model, shared by all its generations (see the module's docstring).
    ``budget``: bytes at most; ``block``: tokens per block (a paged cache's block size: a contiguous cache takes any);
    ``digest_size``: bytes of each key (a test makes it tiny to force collisions); ``min_partial``: the fewest leading
    tokens taken from a block shared in part."""

    def __init__(self, budget: int, block: int = BLOCK, digest_size: int = 16, min_partial: int = MIN_PARTIAL):
        if budget < 0 or block < 1:
            raise ValueError("the prefix store needs a budget >= 0 bytes and blocks of >= 1 token")
        self.budget, self.block, self.digest_size, self.min_partial = budget, block, digest_size, min_partial
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recently used first
        self._children: dict[bytes, set[bytes]] = {}  # a key (or a model's root) -> the keys of the blocks after it
        self.bytes = 0
        self.lookups = self.hit_tokens = self.looked_up_tokens = 0  # /metrics: the hit rate over prompt tokens
        self.version = 0  # blocks stored so far: a run that looked up at this version has nothing new to find
        self._lock = threading.Lock()

    def _key(self, parent: bytes | None, tokens) -> bytes:
        h = hashlib.blake2b(digest_size=self.digest_size)
        h.update(parent or b"")
        h.update(array.array("q", tokens).tobytes())  # (int64s, as torch's were: the same keys, 4x faster)
        return h.digest()

    def _chain(self, kv, tokens: list[int], tail: bool = False):
        """(parent key, key, block tokens, start) of each full block of ``tokens`` in ``kv``'s model, in order; with
        ``tail``, then the tokens after them as a block of their own (at least ``min_partial``), which only a
        partial match reaches (:meth:`_partial`)."""
        parent = _root(kv)
        for start in range(0, len(tokens) - self.block + 1, self.block):
            part = tuple(tokens[start: start + self.block])
            key = self._key(parent, part)
            yield parent, key, part, start
            parent = key
        start = len(tokens) // self.block * self.block
        if tail and len(tokens) - start >= self.min_partial:
            part = tuple(tokens[start:])
            yield parent, self._key(parent, part), part, start

    def _find(self, parent: bytes, key: bytes, part: tuple) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None or entry.parent != parent or entry.tokens != part:  # a collision is a miss
            return None
        return entry

    # -- a generation's side -----------------------------------------------------------------------------
    def fill(self, kv, tokens: list[int], have: int = 0, again: bool = False, hidden: tuple | None = None,
             rows: list | None = None, count: bool = True) -> int:
        """Put into ``kv`` (reset for this generation, holding its first ``have`` positions already) the cached
        blocks of the longest cached prefix of ``tokens`` (the prompt tokens the prefill would compute: mapped where
        ``kv`` is paged, else copied), then the leading rows of a stored block that shares part of the next block
        (copied); returns the positions ``kv`` now holds: ``have``, or the end of what it took where that is further. ``again``: a second look for the same prompt (engine.Run.catch_up): its tokens
        are not counted as looked up again, and only what it takes counts as a hit. ``hidden`` (the tapped layers,
        () for none): take only blocks stored with those hidden rows, and append to ``rows`` the rows of the
        positions taken past ``have``. ``count``: False for a lookup the hit rate leaves out (a draft model's: the
        rate is the target's, over requests' prompt tokens)."""
        again = again or not count
        with self._lock:
            found = []
            for parent, key, part, start in self._chain(kv, tokens):
                entry = self._find(parent, key, part)
                if entry is None or (hidden is not None and hidden not in entry.hidden):
                    break
                found.append((start, key, entry))
            end = found[-1][0] + self.block if found else 0
            partial, taken = self._partial(found[-1][1] if found else _root(kv), tokens[end: end + self.block], hidden)
            self._touch([key for _, key, _ in found] + ([partial[0]] if partial else []))
            if not again:
                self.lookups += 1
                self.looked_up_tokens += len(tokens)
            if end + taken <= have:
                self.hit_tokens += 0 if again else have
                return have
            if count:  # (a second look counts only what it adds)
                self.hit_tokens += end + taken - (have if again else 0)
            if partial:
                found.append((end, partial[0], partial[1]))
            for start, _, entry in found:
                if start + self.block > have:  # (the positions below have are there already)
                    n = min(self.block, end + taken - start)
                    kv.import_block(start, entry.block, None if n == self.block else n)
                    if hidden is not None:
                        rows.append(entry.hidden[hidden][max(0, have - start): n])
        kv.length = end + taken
        return end + taken

    def _partial(self, parent: bytes, rest: list[int], hidden: tuple | None) -> tuple[tuple | None, int]:
        """((key, entry), leading tokens shared) of the stored block after ``parent`` that shares the most leading
        tokens with ``rest`` (at least ``min_partial``, fewer than a block); (None, 0) where none does."""
        best, most = None, self.min_partial - 1
        for key in self._children.get(parent, ()):
            entry = self._entries[key]
            if hidden is not None and hidden not in entry.hidden:
                continue
            shared = shared_prefix(entry.tokens, rest)
            if most < shared < self.block:
                best, most = (key, entry), shared
        return best, (most if best else 0)

    def add(self, kv, tokens: list[int], hidden: tuple | None = None, rows=None, tail: bool = False) -> None:
        """Store the full blocks of ``tokens`` (whose KV ``kv`` holds at positions 0..len(tokens)-1) that are not
        stored yet, then evict the least recently used blocks beyond the budget. ``rows``: the target's hidden rows
        of those positions (taps ``hidden``), kept with each block that lacks them. ``tail``: the tokens after the
        last full block too, copied (a generation that ended: the next turn of a chat starts with all of it)."""
        with self._lock:
            chain = []
            for parent, key, part, start in self._chain(kv, tokens[: kv.length], tail):
                entry = self._find(parent, key, part)
                if entry is None:
                    if key in self._entries:  # a colliding key holds another prefix: keep that one, stop here
                        break
                    entry = _Entry(parent, part, kv.export_block(start, len(part)))
                    self._entries[key] = entry
                    self._children.setdefault(parent, set()).add(key)
                    self.bytes += entry.nbytes
                    self.version += 1
                if rows is not None and hidden not in entry.hidden and rows.shape[0] >= start + self.block:
                    entry.hidden[hidden] = rows[start: start + self.block].clone()
                    self.bytes += entry.hidden[hidden].nbytes
                    self.version += 1
                chain.append(key)
            self._touch(chain)
            while self.bytes > self.budget:
                key, entry = self._entries.popitem(last=False)
                self.bytes -= entry.nbytes
                siblings = self._children[entry.parent]
                siblings.discard(key)
                if not siblings:
                    del self._children[entry.parent]
                entry.block.release()  # (a paged block still mapped by a running request stays with it)

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
        """Prompt tokens found in the store over prompt tokens looked up (a target's; a draft model's are not counted)."""
        return self.hit_tokens / self.looked_up_tokens if self.looked_up_tokens else 0.0
