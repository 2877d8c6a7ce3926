"""One decoder, many generations: each run has its own KV cache and drafter state (``SpeculativeDecoder.new_cache``,
``new_drafter``), so generations on one decoder run at once; ``prefix_cache`` gives a decoder a prefix store of its
own, from which a prompt takes what earlier generations computed — the target's blocks and the draft model's, the
prompt's and the answer's (the next turn of a chat)."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from speculate import SpeculativeDecoder, load_model
from speculate.drafters.none import NoDrafter
from speculate.engine import step
from speculate.models.paged import BLOCK
from speculate.spec import SpeculativeSpec


@pytest.fixture(scope="module")
def int8_pair(tiny_folders):
    """An int8 target and an int8 draft model (another tiny model with the same tokenizer): at int8 every
    row is computed as it would be alone, so a stored block is bit-identical to a fresh prefill."""
    return load_model(str(tiny_folders[0]), dtype="int8"), load_model(str(tiny_folders[1]), dtype="int8")


def ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def _draft_kv(drafter):
    return drafter.drafter.kv if hasattr(drafter, "drafter") else drafter.kv  # model+lookup wraps a model drafter


class Counted:
    """Records every cache ``decoder`` makes from now on — the target's (``new_cache``), or with ``draft`` its
    drafter's draft model's — and the tokens each of its forwards fed (every forward of a cache goes through its
    ``forward_many``). ``kv`` / ``fed``: the last cache's."""

    def __init__(self, decoder, draft: bool = False):
        self.caches, self.feeds = [], []
        name = "new_drafter" if draft else "new_cache"
        make = getattr(decoder, name)

        def made():
            part = make()
            self._count(_draft_kv(part) if draft else part)
            return part

        setattr(decoder, name, made)

    def _count(self, kv):
        fed, forward_many = [], kv.forward_many
        self.caches.append(kv)
        self.feeds.append(fed)

        def counted(items):
            fed.append(sum(int(item.tokens.shape[0]) for item in items if item.kv is kv))
            return forward_many(items)

        kv.forward_many = counted

    @property
    def kv(self):
        return self.caches[-1]

    @property
    def fed(self) -> list[int]:
        return self.feeds[-1]


def plain(target, prompt, n):
    return SpeculativeDecoder(target, SpeculativeSpec("none")).generate(prompt, max_new_tokens=n).token_ids


@pytest.mark.parametrize("drafter", ["model", "model-tree", "model+lookup"])
def test_a_shared_prefix_is_not_computed_again_and_the_tokens_are_a_fresh_decoders(int8_pair, drafter):
    target, draft = int8_pair
    shared = ids(0, 2 * BLOCK + 2)  # two full blocks and two tokens
    first, second = shared + ids(1, 8), shared + ids(2, 8)
    assert first[len(shared)] != second[len(shared)]
    spec = SpeculativeSpec(drafter, verifier="greedy", k=3)
    decoder = SpeculativeDecoder(target, spec, draft_model=draft, prefix_cache=True)
    decoder.generate(first, max_new_tokens=20)
    target_fed, draft_fed = Counted(decoder), Counted(decoder, draft=True)
    out = decoder.generate(second, max_new_tokens=70)
    fresh = SpeculativeDecoder(target, spec, draft_model=draft).generate(second, max_new_tokens=70)
    assert out.token_ids == fresh.token_ids == plain(target, second, 70)
    assert out.stats.reused_prompt_tokens == 2 * BLOCK and fresh.stats.reused_prompt_tokens == 0
    # The target's first forward fed only the prompt past the stored blocks (its last token the root of the first
    # draft, which went with it: Run.joins) and that draft; the draft model's first forward fed only what it did not
    # take from the store (the rest of the prompt).
    most = decoder.drafter.max_nodes(3)
    assert len(second) - 2 * BLOCK <= target_fed.fed[0] <= len(second) - 2 * BLOCK + most
    assert draft_fed.fed[0] == len(second) - 2 * BLOCK
    # The next turn of a chat: the last prompt, its answer and a new message. The answer's tokens filled a third
    # block and 15 positions of a fourth (138 + 70 - 1), stored at the end of that generation (the tail copied), by
    # the target and the draft model alike: all of it is taken.
    turn = second + out.token_ids + ids(3, 6)
    held = len(second) + len(out.token_ids) - 1  # (the last token was never fed)
    assert held == 3 * BLOCK + 15
    again = decoder.generate(turn, max_new_tokens=12)
    assert again.stats.reused_prompt_tokens == held
    assert len(turn) - held <= target_fed.fed[0] <= len(turn) - held + most
    assert 3 * BLOCK < len(turn) - draft_fed.fed[0] <= held
    assert again.token_ids == plain(target, turn, 12)


def test_every_stored_block_holds_committed_tokens(int8_pair):
    """What the store keeps at a generation's end is the tokens it committed, never a rejected draft's: each block of
    the target's and the draft model's is a block of one of the generations' sequences, and its keys are the ones a
    fresh prefill of that sequence computes."""
    target, draft = int8_pair
    decoder = SpeculativeDecoder(target, SpeculativeSpec("model", verifier="greedy", k=4), draft_model=draft,
                                 prefix_cache=True)
    sequences = []
    for seed in range(3):
        prompt = ids(10 + seed, 70)
        sequences.append(prompt + decoder.generate(prompt, max_new_tokens=80, stop=[]).token_ids)
    store = decoder.prefix_store
    entries = list(store._entries.values())
    assert len(entries) >= 2 * 3 * 2  # (two models, three sequences of 150 tokens: two blocks each)
    by_parent = {}
    for key, entry in store._entries.items():
        by_parent[key] = entry
    for entry in entries:
        chain = [entry]
        while chain[-1].parent in by_parent:
            chain.append(by_parent[chain[-1].parent])
        tokens = [t for e in reversed(chain) for t in e.tokens]
        assert any(seq[: len(tokens)] == tokens for seq in sequences)
    # Bits: the target's stored blocks of the first sequence equal a fresh cache's rows.
    fresh = decoder.new_cache()
    fresh.reset(len(sequences[0]))
    fresh.forward(torch.tensor(sequences[0][: 2 * BLOCK]))
    taken = decoder.new_cache()
    taken.reset(len(sequences[0]))
    assert store.fill(taken, sequences[0][: 2 * BLOCK]) == 2 * BLOCK
    for mine, theirs in zip(taken.rows(0, 2 * BLOCK), fresh.rows(0, 2 * BLOCK)):
        assert torch.equal(mine, theirs)


def test_generations_on_one_decoder_run_at_once(int8_pair):
    """A decoder holds no generation's state: runs started on it, stepped together, each give the tokens they give
    alone — a draft model's drafter included (each run's own draft cache), and with the decoder's store."""
    target, draft = int8_pair
    for drafter in ("model", "lookup"):
        decoder = SpeculativeDecoder(target, SpeculativeSpec(drafter, verifier="greedy", k=3), draft_model=draft,
                                     prefix_cache=True)
        prompts = [ids(20, 30), ids(21, 75), ids(20, 30) + ids(22, 5)]
        runs = [decoder.start(p, max_new_tokens=24) for p in prompts]
        assert len({id(r.kv) for r in runs}) == 3 and len({id(r.drafter) for r in runs}) == 3
        assert runs[0].drafter is decoder.drafter
        while not all(r.done for r in runs):
            step(runs)
        assert [r.generation.token_ids for r in runs] == [plain(target, p, 24) for p in prompts], drafter
        assert all(r.kv is None and r.drafter is None for r in runs)  # given up at the end
    # The decoder's own drafter is lent to one run at a time (the first), forks to the others; it comes back at the
    # run's end, and from a run or a stream its caller dropped unfinished.
    assert decoder.start(ids(23, 10), max_new_tokens=4).drafter is decoder.drafter
    gc.collect()  # (that run, dropped)
    stream = decoder.stream(ids(24, 10), max_new_tokens=20)
    next(iter(stream))
    assert decoder.start(ids(23, 10), max_new_tokens=4).drafter is not decoder.drafter  # the stream holds it
    del stream
    gc.collect()
    assert decoder.start(ids(23, 10), max_new_tokens=4).drafter is decoder.drafter


def test_off_by_default_and_the_heads_get_the_rows_they_read(int8_pair):
    target, _ = int8_pair
    prompt = ids(4, BLOCK + 10)
    decoder = SpeculativeDecoder(target, SpeculativeSpec("lookup", verifier="greedy", k=3))
    assert decoder.prefix_store is None
    decoder.generate(prompt, max_new_tokens=8)
    assert decoder.generate(prompt, max_new_tokens=8).stats.reused_prompt_tokens == 0

    class Observing(NoDrafter):  # stands for EAGLE's head: it observes every prompt row's features
        wants_hidden = True

        def observe(self, hidden):
            self.rows.append(hidden.clone())

    drafter = Observing()
    decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=3), drafter=drafter, prefix_cache=True)
    seen = []
    for _ in range(2):
        drafter.rows = []
        out = decoder.generate(prompt, max_new_tokens=4)
        seen.append(torch.cat(drafter.rows)[: len(prompt) - 1])
    # The second generation took the stored block, with the hidden rows the first one computed for it.
    assert out.stats.reused_prompt_tokens == BLOCK
    assert torch.equal(seen[0], seen[1])


def test_the_hugging_face_path_takes_stored_blocks_too(tiny, monkeypatch):
    """Models the lean path does not take run on Hugging Face's modules with a DynamicCache: blocks are copied out
    of it and appended into it. (fp32: equality with a fresh decoder is what this tiny model gives on this path, not
    a guarantee in general; see SpeculativeDecoder's docstring.)"""
    monkeypatch.setattr("speculate.models.fast.supports", lambda model: False)
    target = tiny[0]
    decoder = SpeculativeDecoder(target, SpeculativeSpec("lookup", verifier="greedy", k=3), prefix_cache=True)
    fed = Counted(decoder)
    shared = ids(5, BLOCK + 2)
    decoder.generate(shared + ids(6, 5), max_new_tokens=10)
    assert type(fed.kv).__name__ == "HFKVModel"
    out = decoder.generate(shared + ids(7, 5), max_new_tokens=10)
    assert out.stats.reused_prompt_tokens == BLOCK and fed.fed[0] == 2 + 5  # (lookup: no draft here)
    assert out.token_ids == plain(target, shared + ids(7, 5), 10)
