"""The paged KV cache of the compiled attention path: one pool of fixed-size blocks per model, and a block table
per generation (issue 37; vLLM's PagedAttention, nano-vllm's BlockManager).

A block holds :data:`BLOCK` cache positions of every layer (keys transposed, as the kernel reads them:
``[layers, kv heads, head dim, BLOCK]``; values ``[layers, kv heads, BLOCK, head dim]``). A generation's cache
(:class:`PagedCache`, held by models/fast.py's FastKVModel) is a list of blocks: position p is row p % BLOCK of
block p // BLOCK. Growing appends blocks (nothing is copied); rolling back after a rejected draft moves the length
back (the blocks stay, to be written again).

Blocks are shared by reference, counted (:attr:`Block.refs`): the prefix store (models/prefix_store.py) holds
the full blocks of prompts, and every later generation whose prompt starts with the same tokens maps those very
blocks into its table, whoever computed them and whatever that request's speculative settings; a running request
and the store, or two running requests, then hold one copy. A block is written only by a table that holds it
alone: a write into a block someone else also holds copies it first (:meth:`PagedCache.writable`, copy on
write), so a shared block never changes. A count may be too high (a holder dropped without releasing: then a
write copies once more than needed), never too low: every holder counts itself in before it holds a block.

Exactness: kernels/attention.c sums over slots in slot order whatever block holds them, so a row's bits do not
depend on where its keys sit (tests/test_paged.py shuffles a table to check it).
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import torch

from .kernel import KEYS

BLOCK = KEYS  # positions per block: the kernel's key block, so that a block of scores never spans two pages
FREE_BYTES = 128 * 2**20  # blocks nobody holds that a pool keeps for reuse, at most (KVPool)


class Block:
    """One block of positions: its keys and values for every layer, and how many tables and stores hold it."""

    __slots__ = ("keys", "values", "refs", "pool", "__weakref__")

    def __init__(self, pool: "KVPool", keys: torch.Tensor | None = None, values: torch.Tensor | None = None):
        self.pool = pool
        self.keys = torch.zeros(pool.k_shape, dtype=pool.dtype) if keys is None else keys
        self.values = torch.zeros(pool.v_shape, dtype=pool.dtype) if values is None else values
        self.refs = 1

    @property
    def nbytes(self) -> int:
        return self.pool.block_bytes

    def release(self) -> None:
        """One holder lets go (the prefix store evicting it; a table dropping it)."""
        self.pool.release(self)


class CopiedBlock:
    """A block's rows copied out of an unpaged cache (the PyTorch attentions' contiguous buffers), for the prefix
    store: the same interface as :class:`Block`, its memory its own."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def release(self) -> None:
        pass  # (dropped with the store's entry)


class KVPool:
    """The blocks of one model's caches (every generation on it, and the prefix store). ``live``: blocks held now."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype = torch.float32):
        self.k_shape = (layers, kv_heads, head_dim, BLOCK)
        self.v_shape = (layers, kv_heads, BLOCK, head_dim)
        self.dtype = dtype
        self.layer_floats = kv_heads * head_dim * BLOCK  # one layer's part of a block (the kernel's segment.layer)
        self.block_bytes = 2 * layers * self.layer_floats * torch.finfo(dtype).bits // 8
        self.live = 0
        self._lock = threading.Lock()  # (a finalizer may release blocks from whichever thread collects)
        # Memory of blocks nobody holds, kept for the next (at most FREE_BYTES): a request's cache is its own, so a
        # server allocates and frees blocks all the time, and fresh memory costs page faults and zeroing (~0.6 ms
        # a block of the default model). Its old rows are never read: the kernel reads positions below a length.
        self._free: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.keep_free = max(1, FREE_BYTES // self.block_bytes)

    def allocate(self) -> Block:
        with self._lock:
            self.live += 1
            memory = self._free.pop() if self._free else (None, None)
        return Block(self, *memory)

    def share(self, block: Block) -> Block:
        with self._lock:
            block.refs += 1
        return block

    def release(self, block: Block) -> None:
        with self._lock:
            block.refs -= 1
            if block.refs == 0:
                self.live -= 1
                if len(self._free) < self.keep_free:
                    self._free.append((block.keys, block.values))


_pools: "weakref.WeakKeyDictionary[torch.nn.Module, KVPool]" = weakref.WeakKeyDictionary()
_pools_lock = threading.Lock()


def pool_for(model: torch.nn.Module, layers: int, kv_heads: int, head_dim: int) -> KVPool:
    """The pool of ``model``'s caches (one per loaded model: every FastKVModel over it, the prefix store)."""
    with _pools_lock:
        pool = _pools.get(model)
        if pool is None:
            pool = _pools[model] = KVPool(layers, kv_heads, head_dim)
        return pool


def pool_bytes(model: torch.nn.Module) -> int:
    """Bytes of the blocks held now in ``model``'s pool (0 where it has none: no paged cache made yet)."""
    pool = _pools.get(model)
    return 0 if pool is None else pool.live * pool.block_bytes


def _release_all(table: list[Block]) -> None:
    for block in table:
        block.release()
    table.clear()


class PagedCache:
    """One generation's block table over a :class:`KVPool`."""

    def __init__(self, pool: KVPool):
        self.pool = pool
        self.table: list[Block] = []
        self._pointers = None
        # A dropped cache (a decoder let go) gives its blocks back when it is collected.
        self._finalizer = weakref.finalize(self, _release_all, self.table)

    @property
    def capacity(self) -> int:
        return len(self.table) * BLOCK

    @property
    def nbytes(self) -> int:
        return len(self.table) * self.pool.block_bytes

    @property
    def own_bytes(self) -> int:
        """Bytes of the blocks no one else holds (not the prefix store's, not another table's)."""
        return sum(block.refs == 1 for block in self.table) * self.pool.block_bytes

    def ensure(self, needed: int) -> None:
        """Blocks for positions < needed (appended: what is cached stays where it is)."""
        while len(self.table) * BLOCK < needed:
            self.table.append(self.pool.allocate())
            self._pointers = None

    def writable(self, start: int, end: int) -> None:
        """Make the blocks of positions start..end-1 this table's alone (copy on write), before a write there."""
        for j in range(start // BLOCK, min(-(-end // BLOCK), len(self.table))):
            block = self.table[j]
            if block.refs > 1:
                own = self.pool.allocate()
                own.keys.copy_(block.keys)
                own.values.copy_(block.values)
                self.table[j] = own
                block.release()
                self._pointers = None

    def pointers(self) -> tuple[ctypes.Array, ctypes.Array]:
        """The kernel's block table: each block's key and value addresses (made again when the table changes)."""
        if self._pointers is None:
            n = len(self.table)
            self._pointers = ((ctypes.c_void_p * n)(*[b.keys.data_ptr() for b in self.table]),
                              (ctypes.c_void_p * n)(*[b.values.data_ptr() for b in self.table]))
        return self._pointers

    def move_rows(self, sources: list[int], start: int) -> None:
        """Positions ``sources`` (ascending) to positions start, start+1, ... (a tree's accepted path made a chain)."""
        moves = [(p, start + j) for j, p in enumerate(sources) if p != start + j]
        if not moves:
            return
        rows = [(self.table[p // BLOCK].keys[..., p % BLOCK].clone(), self.table[p // BLOCK].values[:, :, p % BLOCK].clone())
                for p, _ in moves]
        self.writable(moves[0][1], moves[-1][1] + 1)
        for (keys, values), (_, q) in zip(rows, moves):
            self.table[q // BLOCK].keys[..., q % BLOCK] = keys
            self.table[q // BLOCK].values[:, :, q % BLOCK] = values

    def rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of positions start..start+n-1 as contiguous keys [layers, kv heads, d, n] and values
        [layers, kv heads, n, d] (the unpaged cache's layout: tests compare the two)."""
        keys, values = [], []
        p = start
        while p < start + n:
            block, lo = self.table[p // BLOCK], p % BLOCK
            hi = min(BLOCK, lo + start + n - p)
            keys.append(block.keys[..., lo:hi])
            values.append(block.values[:, :, lo:hi])
            p += hi - lo
        return torch.cat(keys, dim=3), torch.cat(values, dim=2)

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Put :meth:`rows`' copy at positions start.. (copied; the blocks made this table's own first)."""
        n = values.shape[2]
        self.ensure(start + n)
        self.writable(start, start + n)
        p = start
        while p < start + n:
            block, lo = self.table[p // BLOCK], p % BLOCK
            hi = min(BLOCK, lo + start + n - p)
            block.keys[..., lo:hi] = keys[..., p - start: p - start + hi - lo]
            block.values[:, :, lo:hi] = values[:, :, p - start: p - start + hi - lo]
            p += hi - lo

    def block(self, j: int) -> Block:
        """Block j, shared with the caller (the prefix store holds it from now on)."""
        return self.pool.share(self.table[j])

    def map(self, j: int, block: Block) -> None:
        """Hold ``block`` as block j (a cached prompt block found in the prefix store): no copy."""
        self.ensure((j + 1) * BLOCK)
        if self.table[j] is not block:
            old = self.table[j]
            self.table[j] = self.pool.share(block)
            old.release()
            self._pointers = None
