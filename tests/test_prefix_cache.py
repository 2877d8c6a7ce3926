"""``prefix_cache``: a decoder keeps the KV of the prefix a new prompt shares with its last generation
(models/kv.py, PrefixReuse), for the target and the draft model."""

from __future__ import annotations

import random

import pytest
import torch

from speculate import SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.drafters.none import NoDrafter
from speculate.models.kv import PrefixReuse


@pytest.fixture(scope="module")
def int8_pair(tiny_folders):
    """An int8 target and an int8 draft model (another tiny model with the same tokenizer): at int8 every
    row is computed as it would be alone, so a kept prefix is bit-identical to a fresh prefill."""
    return load_model(str(tiny_folders[0]), dtype="int8"), load_model(str(tiny_folders[1]), dtype="int8")


def ids(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


class Counted:
    """Wraps a lean KV model's forward (every forward goes through ``forward_many``), recording how many tokens each
    call fed."""

    def __init__(self, kv):
        self.fed, forward_many = [], kv.forward_many

        def counted(items):
            self.fed.append(sum(int(item.tokens.shape[0]) for item in items if item.kv is kv))
            return forward_many(items)

        kv.forward_many = counted


@pytest.mark.parametrize("drafter", ["model", "model-tree", "model+lookup"])
def test_a_shared_prefix_is_not_computed_again_and_the_tokens_are_a_fresh_decoders(int8_pair, drafter):
    target, draft = int8_pair
    shared = ids(0, 40)
    first, second = shared + ids(1, 8), shared + ids(2, 8)
    assert first[40] != second[40]
    decoder = SpeculativeDecoder(target, SpeculativeSpec(drafter, verifier="greedy", k=3), draft_model=draft,
                                 prefix_cache=True)
    decoder.generate(first, max_new_tokens=20)
    target_fed, draft_fed = Counted(decoder.kv), Counted(_draft_kv(decoder.drafter))
    out = decoder.generate(second, max_new_tokens=20)
    fresh = SpeculativeDecoder(target, SpeculativeSpec(drafter, verifier="greedy", k=3), draft_model=draft)
    fresh = fresh.generate(second, max_new_tokens=20)
    plain = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(second, max_new_tokens=20)
    assert out.token_ids == fresh.token_ids == plain.token_ids
    assert out.stats.reused_prompt_tokens == 40 and fresh.stats.reused_prompt_tokens == 0
    # The target prefilled only the prompt past the shared prefix (all but its last token); the draft
    # model's first forward fed only what its cache did not keep (the rest of the prompt).
    assert target_fed.fed[0] == len(second) - 40 - 1
    assert draft_fed.fed[0] == len(second) - 40
    # The next turn of a chat: the prompt is the last one, its answer and a new message.
    turn = second + out.token_ids + ids(3, 6)
    again = decoder.generate(turn, max_new_tokens=12)
    assert again.stats.reused_prompt_tokens >= len(second)
    assert again.token_ids == SpeculativeDecoder(target,
                                                 SpeculativeSpec("none")).generate(turn, max_new_tokens=12).token_ids


def _draft_kv(drafter):
    return drafter.drafter.kv if hasattr(drafter, "drafter") else drafter.kv  # model+lookup wraps a model drafter


def test_off_by_default_and_for_drafters_that_read_the_targets_features(int8_pair):
    target, _ = int8_pair
    prompt = ids(4, 30)
    plain = SpeculativeDecoder(target, SpeculativeSpec("lookup", verifier="greedy", k=3))
    plain.generate(prompt, max_new_tokens=8)
    assert plain.generate(prompt, max_new_tokens=8).stats.reused_prompt_tokens == 0

    class Observing(NoDrafter):  # stands for the heads: they observe every prompt row's features
        wants_hidden = True

        def observe(self, hidden):
            self.rows = getattr(self, "rows", 0) + hidden.shape[0]

    drafter = Observing()
    decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=3), drafter=drafter, prefix_cache=True)
    assert decoder.prefix_cache is False
    decoder.generate(prompt, max_new_tokens=4)
    drafter.rows = 0
    assert decoder.generate(prompt, max_new_tokens=4).stats.reused_prompt_tokens == 0
    assert drafter.rows >= len(prompt) - 1  # it saw the whole prompt's rows again


def test_what_a_cache_holds_is_never_past_the_committed_tokens():
    class FakeKV:
        length, kept = 0, None

        def reset(self, capacity, keep=0):
            self.kept = keep
            self.length = min(self.length, keep)

    kv, held = FakeKV(), PrefixReuse()
    committed = [5, 6, 7, 8]
    held.follow(committed)
    kv.length = 7  # e.g. stopped at a stop string inside an accepted draft: the cache ran past the list
    assert held.start(kv, [5, 6, 7, 8, 9, 10], 64, enabled=True) == 4
    held.follow([5, 6, 9])
    kv.length = 3
    assert held.start(kv, [5, 6, 7, 8], 64, enabled=True) == 2  # the shared prefix only
    held.follow([5, 6, 7, 8])
    kv.length = 4
    assert held.start(kv, [5, 6, 7, 8], 64, enabled=True) == 3  # never the last prompt token: it is fed next
    assert held.start(kv, [5, 6, 7, 8], 64, enabled=True) == 0  # start() forgets: nothing followed since
    held.follow([5, 6, 7, 8])
    kv.length = 2  # the cache holds only the first two (e.g. a draft model that had not caught up)
    assert held.start(kv, [5, 6, 7, 8, 9], 64, enabled=True) == 2


def test_the_hugging_face_path_keeps_a_prefix_too(tiny, monkeypatch):
    """Models the lean path does not take run on Hugging Face's modules with a DynamicCache: keeping a
    prefix crops it. (fp32: equality with a fresh decoder is what this tiny model gives on this path, not a
    guarantee in general; see SpeculativeDecoder's docstring.)"""
    monkeypatch.setattr("speculate.models.fast.supports", lambda model: False)
    target = tiny[0]
    decoder = SpeculativeDecoder(target, SpeculativeSpec("lookup", verifier="greedy", k=3), prefix_cache=True)
    assert type(decoder.kv).__name__ == "HFKVModel"
    shared = ids(5, 30)
    decoder.generate(shared + ids(6, 5), max_new_tokens=10)
    fed = Counted(decoder.kv)
    out = decoder.generate(shared + ids(7, 5), max_new_tokens=10)
    assert out.stats.reused_prompt_tokens == 30 and fed.fed[0] == 5 - 1
    plain = SpeculativeDecoder(target, SpeculativeSpec("none"))
    assert out.token_ids == plain.generate(shared + ids(7, 5), max_new_tokens=10).token_ids
    # A forward that failed half-way leaves some layers longer than the others: nothing is kept from that.
    kv = decoder.kv
    layer = kv.cache.layers[0]
    layer.keys, layer.values = [torch.cat([t, t[..., -1:, :]], dim=-2) for t in (layer.keys, layer.values)]
    kv.reset(64, keep=5)
    assert kv.length == 0 and kv.cache.get_seq_length() == 0
