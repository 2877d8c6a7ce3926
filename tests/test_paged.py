"""The paged KV cache (models/paged.py): the kernel reads a block table, a block's place in memory changes no bit,
blocks are shared by reference between the prefix store and running generations, and a shared block is never
written (copy on write)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from speculate import SpeculativeDecoder, load_model
from speculate.models import kernel
from speculate.models.paged import BLOCK
from speculate.models.prefix_store import PrefixStore
from speculate.spec import SpeculativeSpec

from test_prefix_cache import Counted


@pytest.fixture(scope="module")
def fn():
    f = kernel.load()
    if f is None:
        pytest.skip("no C compiler here: the kernel cannot be built")
    return f


def test_a_rows_bits_do_not_depend_on_where_its_blocks_sit(fn):
    """The same keys and values in blocks laid out in memory in order, reversed and shuffled: every row's output is
    the same bits, for a causal chain and for a tree mask (sums run in slot order whatever block holds a slot)."""
    g = torch.Generator().manual_seed(0)
    kv_heads, heads, d, blocks = 2, 6, 64, 5
    capacity = blocks * BLOCK
    keys_t, values = torch.randn(kv_heads, d, capacity, generator=g), torch.randn(kv_heads, capacity, d, generator=g)
    q = torch.randn(7, heads, d, generator=g)
    length = 4 * BLOCK + 9
    chain = torch.ones(7, length, dtype=torch.bool).tril_(length - 7)
    tree = chain.clone()
    tree[3, length - 5] = tree[6, length - 2] = False  # siblings a row may not see
    orders = [list(range(blocks)), list(reversed(range(blocks))), random.Random(1).sample(range(blocks), blocks)]
    for allowed in (None, chain, tree):
        n_rows = 1 if allowed is None else 7
        outs = [kernel.attend(fn, q[:n_rows], keys_t, values, kernel.mask(allowed), length, 0.125, order=o)
                for o in orders]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        reference = torch.nn.functional.scaled_dot_product_attention(
            q[:n_rows].transpose(0, 1), keys_t.transpose(1, 2)[:, :length].repeat_interleave(3, 0),
            values[:, :length].repeat_interleave(3, 0), attn_mask=allowed, scale=0.125).transpose(0, 1)
        assert torch.allclose(outs[0], reference.reshape(n_rows, -1), atol=1e-5)


@pytest.fixture(scope="module", params=["int8", "q4"])
def target(request, tiny_folders):
    if kernel.load() is None:
        pytest.skip("no C compiler here: the cache is not paged")
    return load_model(str(tiny_folders[0] if request.param == "int8" else tiny_folders[2]), dtype=request.param)


def ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def test_running_generations_share_prompt_blocks_and_never_write_into_them(target):
    """Two generations map the store's blocks of a shared prompt (one copy, counted three times); a cache that then
    keeps its positions up to one inside a shared block and writes there copies that block first, so the store's
    blocks keep their bits, and its logits and every answer are a fresh cache's."""
    store = PrefixStore(1 << 30)
    shared = ids(0, 3 * BLOCK)
    first = SpeculativeDecoder(target, SpeculativeSpec("lookup", k=3), prefix_store=store)
    first_kv = Counted(first)  # (holds the run's cache after its end)
    first.generate(shared + ids(1, 5), max_new_tokens=4)
    stored = [first_kv.kv.paged.table[j] for j in range(3)]
    before = [(b.keys.clone(), b.values.clone()) for b in stored]
    second = SpeculativeDecoder(target, SpeculativeSpec("none"), prefix_store=store)
    second_kv = Counted(second)
    second.generate(shared + ids(2, 5), max_new_tokens=4)
    assert all(second_kv.kv.paged.table[j] is stored[j] for j in range(3))
    assert [b.refs for b in stored] == [3, 3, 3]  # the first generation's table, the store, the second's table
    # A cache holding the shared blocks rolls back into block 1 and goes on with other tokens: its writes land in a
    # block that the store and both generations hold.
    kv = first.new_cache()
    kv.reset(4 * BLOCK)
    assert store.fill(kv, shared) == 3 * BLOCK and kv.paged.table[1] is stored[1]
    kv.keep(BLOCK + 10)
    rest = torch.tensor(ids(3, 40))
    logits = kv.forward(rest)
    fresh = first.new_cache()
    fresh.reset(4 * BLOCK)
    fresh.forward(torch.tensor(shared[: BLOCK + 10]))
    assert torch.equal(logits, fresh.forward(rest))
    assert kv.paged.table[0] is stored[0] and kv.paged.table[1] is not stored[1]
    for block, (keys, values) in zip(stored, before):
        assert torch.equal(block.keys, keys) and torch.equal(block.values, values)
    # The second decoder still answers from the untouched blocks as alone.
    again = second.generate(shared + ids(2, 5), max_new_tokens=4)
    fresh = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(shared + ids(2, 5), max_new_tokens=4)
    assert again.token_ids == fresh.token_ids and again.stats.reused_prompt_tokens == 3 * BLOCK


def test_blocks_go_back_when_nobody_holds_them(target):
    """A pool counts its live blocks: a dropped decoder and an evicting store give theirs back, and a block the store
    evicts while a generation still maps it stays with that generation."""
    pool = SpeculativeDecoder(target, SpeculativeSpec("none")).new_cache().paged.pool
    gc.collect()
    base = pool.live
    store = PrefixStore(1 << 30)
    decoder = SpeculativeDecoder(target, SpeculativeSpec("none"), prefix_store=store)
    decoder.generate(ids(5, 2 * BLOCK + 3), max_new_tokens=2)
    assert pool.live == base + 2 and store.blocks == 2  # the run's cache went; the store's two blocks stay
    caches = Counted(decoder)  # (keeps the next run's cache after its end)
    decoder.generate(ids(5, 2 * BLOCK + 3), max_new_tokens=2)
    kv = caches.kv
    held = len(kv.paged.table)
    assert held == 3 and pool.live == base + held  # two blocks mapped from the store, one its own
    block = kv.paged.table[0]
    store.budget = 0
    store.add(kv, [])  # (evicts down to the budget)
    assert store.blocks == 0 and block.refs == 1 and pool.live == base + held
    del caches, kv, decoder  # (the decoder's new_cache holds the recorder)
    gc.collect()
    assert pool.live == base and block.refs == 0


def test_a_pool_reuses_the_memory_of_blocks_nobody_holds():
    """A block whose last holder let go gives its memory to the next block allocated (no fresh pages to fault in and
    zero), up to the pool's keep_free; live counts the blocks held, not the memory kept."""
    from speculate.models.paged import KVPool

    pool = KVPool(2, 1, 4)
    pool.keep_free = 2
    blocks = [pool.allocate() for _ in range(3)]
    addresses = {b.keys.data_ptr() for b in blocks}
    assert pool.live == 3
    for b in blocks:
        b.release()
    assert pool.live == 0 and len(pool._free) == 2  # (the third block's memory went)
    again = [pool.allocate() for _ in range(3)]
    assert pool.live == 3 and sum(b.keys.data_ptr() in addresses for b in again) == 2
    shared = pool.share(again[0])
    shared.release()
    assert again[0].refs == 1 and len(pool._free) == 0  # (still held once: not free)


def test_a_store_of_smaller_blocks_copies_into_a_paged_cache(target):
    """A store whose blocks are not the pool's (16 tokens) cannot hand out the cache's blocks: it copies rows out and
    in instead, and the tokens are still a fresh decoder's."""
    store = PrefixStore(1 << 30, block=16)
    shared = ids(6, 100)
    SpeculativeDecoder(target, SpeculativeSpec("none"), prefix_store=store).generate(shared + [9], max_new_tokens=2)
    prompt = shared + ids(7, 20)
    out = SpeculativeDecoder(target, SpeculativeSpec("lookup", k=3), prefix_store=store).generate(prompt,
                                                                                                  max_new_tokens=12)
    alone = SpeculativeDecoder(target, SpeculativeSpec("lookup", k=3)).generate(prompt, max_new_tokens=12)
    assert out.token_ids == alone.token_ids and out.stats.reused_prompt_tokens == 96
