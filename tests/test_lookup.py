"""Prompt lookup's copies that grow while they are accepted whole (``max_copy``, drafters/lookup.py)."""

from __future__ import annotations

import random

import pytest

from speculate import SpeculateError, SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.cli import main
from speculate.drafters import get_drafter, parse_options
from speculate.drafters.lookup import LookupDrafter
from speculate.sampling import SamplingParams

from test_default_model import PARAGRAPH


def periodic(period=40, times=4, seed=0):
    rng = random.Random(seed)
    block = [rng.randrange(3, 259) for _ in range(period)]  # in the tiny models' vocabulary
    return block * times


def run_rounds(drafter, tokens, k, verdicts):
    """Drive ``drafter`` by hand: each round, accept ``verdict(len(draft))`` of its draft and commit those
    tokens plus one more (the continuation of the periodic text, as a copying target would write).
    Returns the draft lengths."""
    drafter.begin(list(tokens), SamplingParams(), None)
    tokens, lengths = list(tokens), []
    for verdict in verdicts:
        draft = drafter.propose(tokens, k)
        lengths.append(len(draft))
        n = verdict(len(draft))
        tokens += draft.tokens[:n].tolist()
        tokens.append(tokens[-40])  # period 40: the target's next token repeats the text
        drafter.update(n, tokens[-1])
    return lengths


def test_copies_double_while_accepted_whole_and_fall_back_at_a_rejection():
    everything, all_but_one = (lambda m: m), (lambda m: m - 1)
    drafter = LookupDrafter(max_copy=20)
    assert drafter.max_nodes(4) == 20 and drafter.max_nodes(32) == 32  # the KV caches fit the longest copy
    lengths = run_rounds(drafter, periodic(), 4, [everything] * 4 + [all_but_one] + [everything] * 2)
    # 4 → 8 → 16 → 20 (the cap) → 20, rejected → back to 4 → 8.
    assert lengths == [4, 8, 16, 20, 20, 4, 8]
    # Growing is the default (up to 32); max_copy=0 turns it off: every full-match copy is k long.
    assert run_rounds(LookupDrafter(), periodic(), 4, [everything] * 5) == [4, 8, 16, 32, 32]
    assert run_rounds(LookupDrafter(max_copy=0), periodic(), 4, [everything] * 5) == [4] * 5
    # A cap below k never shortens a copy.
    assert run_rounds(LookupDrafter(max_copy=2), periodic(), 4, [everything] * 3) == [4] * 3


def test_short_matches_neither_grow_nor_reset_the_copy_length():
    drafter = LookupDrafter(max_copy=16)
    tokens = periodic()
    drafter.begin(list(tokens), SamplingParams(), None)
    assert len(drafter.propose(tokens, 4)) == 4
    drafter.update(4, 0)
    # A context ending in a one-token match (a fresh token, then one seen before): 2^0 = 1 token, and
    # its verdict (rejected) leaves the grown length alone.
    tokens += tokens[-40:-36] + [300, tokens[7]]  # the copy accepted, then a fresh token and a seen one
    assert len(drafter.propose(tokens, 4)) == 1
    drafter.update(0, tokens[8])
    tokens += [tokens[8], tokens[9]]  # a full 3-gram match again: the grown length holds
    assert len(drafter.propose(tokens, 4)) == 8


def test_model_lookup_copies_grow_too(tiny):
    target = tiny[0]
    drafter = get_drafter("model+lookup", target, target, lookup_k=5, max_copy=30)
    assert drafter.max_nodes(4) == 30
    everything = lambda m: m  # noqa: E731
    assert run_rounds(drafter, periodic(), 4, [everything] * 4) == [5, 10, 20, 30]
    assert run_rounds(get_drafter("model+lookup", target, target, lookup_k=5, max_copy=0), periodic(), 4,
                      [everything] * 3) == [5] * 3


def test_options_and_refusals(tiny_folders, capsys):
    assert parse_options("lookup", ["max_copy=32"]) == {"max_copy": 32}
    assert parse_options("model+lookup", ["max_copy=32"]) == {"max_copy": 32}
    with pytest.raises(SpeculateError, match="max_copy must be >= 0"):
        get_drafter("lookup", max_copy=-1)
    folder = str(tiny_folders[0])
    assert main(["generate", "abc", "--model", folder, "--drafter", "lookup", "--drafter-opt", "max_copy=-1"]) == 2
    assert "max_copy must be >= 0" in capsys.readouterr().err


@pytest.mark.slow
def test_growing_copies_on_the_default_model_are_plain_decoding_in_fewer_calls(default_model):
    """SmolLM2 repeats a paragraph verbatim when asked: copies then grow past k, the output stays plain
    decoding's token for token, and the target is called fewer times than with copies of k."""
    prompt = "Repeat this paragraph exactly:\n\n" + PARAGRAPH
    ref = SpeculativeDecoder(default_model, SpeculativeSpec("none")).generate(prompt, max_new_tokens=64)
    fixed = SpeculativeDecoder(default_model, SpeculativeSpec(verifier="greedy", k=4),
                               drafter=LookupDrafter(max_copy=0)).generate(prompt, max_new_tokens=64)
    lengths = []

    class Recording(LookupDrafter):
        def propose(self, tokens, k):
            draft = super().propose(tokens, k)
            lengths.append(len(draft))
            return draft

    grown = SpeculativeDecoder(default_model, SpeculativeSpec(verifier="greedy", k=4),
                               drafter=Recording(max_copy=32)).generate(prompt, max_new_tokens=64)
    assert grown.token_ids == fixed.token_ids == ref.token_ids
    assert max(lengths) >= 16  # 4 → 8 → 16: copies were accepted whole at least twice running
    assert grown.stats.target_calls < fixed.stats.target_calls
