"""Heads with prompt lookup merged into their draft tree (drafters/with_lookup.py): the merge itself,
greedy decoding equal to plain decoding with lookup's branches actually verified, lookup's branch
beside the drawn chain when sampling (lossless end to end), and the shipped heads on the default model."""

from __future__ import annotations

import pytest
import torch

from speculate import SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.drafters import get_drafter
from speculate.drafters.base import Draft
from speculate.drafters.lookup import LookupDrafter
from speculate.drafters.with_lookup import WithLookup, beside, merge
from speculate.errors import SpeculateError
from speculate.heads import save_heads
from speculate.sampling import SamplingParams

from test_heads import PROMPT, plain_greedy, random_heads


def test_merge_follows_agreeing_nodes_then_branches():
    chain = Draft(torch.tensor([7, 8, 9]))
    merged = merge(chain, [7, 5, 6])  # agrees on 7, then leaves the chain at its second token
    assert merged.tokens.tolist() == [7, 8, 9, 5, 6]
    assert merged.parents == [-1, 0, 1, 0, 3]
    assert merged.probs is None

    tree = Draft(torch.tensor([1, 2, 3, 4]), None, [-1, -1, 0, 1])  # 1→3, 2→4
    merged = merge(tree, [2, 4, 9, 9])  # follows 2→4, then grows two new nodes below node 3
    assert merged.tokens.tolist() == [1, 2, 3, 4, 9, 9]
    assert merged.parents == [-1, -1, 0, 1, 3, 4]
    assert merge(tree, [1, 3]) is tree  # nothing new: the base's proposal as it was
    empty = merge(Draft(torch.empty(0, dtype=torch.long)), [4, 4])
    assert empty.tokens.tolist() == [4, 4] and empty.parents == [-1, 0]
    assert empty.depth == 2


class Oracle(LookupDrafter):
    """A "lookup" that proposes the given continuation (right, or garbage): the tiny random models copy
    nothing from their prompts, so real lookup would rarely add an accepted branch there."""

    def __init__(self, prompt, continuation):
        super().__init__()
        self.prompt, self.continuation = list(prompt), continuation

    def propose(self, tokens, k):
        done = len(tokens) - len(self.prompt)
        return Draft(torch.tensor(self.continuation[done: done + k], dtype=torch.long))


@pytest.mark.parametrize("name", ["eagle", "eagle-chain", "medusa", "medusa-chain"])
def test_greedy_with_lookup_merged_equals_plain(tiny, tmp_path, name):
    """Merged trees verify to exactly plain decoding's tokens, whether lookup's branch is right (then
    it is what gets accepted: a round per k + 1 tokens) or garbage (then the heads' nodes are judged as
    without it), and lookup's branch is really added to the heads' proposal."""
    loaded = tiny[2]
    kind = name.split("-")[0]
    save_heads(tmp_path, random_heads(kind, loaded, seed=3), loaded.name, 259)
    n, k = 40, 5
    expected = plain_greedy(loaded, PROMPT, n)
    ungated = {"min_confidence": 0.0} if name == "eagle-chain" else {}  # random heads are never sure
    alone = SpeculativeDecoder(loaded, SpeculativeSpec(verifier="greedy", k=2),
                               drafter=get_drafter(name, None, loaded, heads=tmp_path, **ungated))
    a = alone.generate(list(PROMPT), max_new_tokens=n)
    garbage = [(t + 1) % 259 for t in expected]
    for continuation in (expected, garbage):
        base = get_drafter(name, None, loaded, heads=tmp_path, **ungated)
        drafter = WithLookup(base, base_k=2, lookup=Oracle(PROMPT, continuation))
        sizes = []
        propose = drafter.propose
        drafter.propose = lambda tokens, k: sizes.append(len(d := propose(tokens, k))) or d
        g = SpeculativeDecoder(loaded, SpeculativeSpec(verifier="greedy", k=k),
                               drafter=drafter).generate(list(PROMPT), max_new_tokens=n)
        assert g.token_ids == expected
        assert max(sizes) > base.max_nodes(2)  # lookup's nodes were in the verified trees
        if continuation is expected:
            assert g.stats.target_calls == -(-n // (k + 1))
        else:
            assert g.stats.target_calls == a.stats.target_calls  # the heads' own drafts, judged alike


def test_sampling_puts_lookup_beside_the_drawn_chain():
    rows = torch.softmax(torch.randn(2, 6), -1)
    chain = Draft(torch.tensor([4, 2]), rows)
    both = beside(chain, [4, 5])  # never merged into the equal drawn node 4: its own branch
    assert both.tokens.tolist() == [4, 2, 4, 5] and both.parents == [-1, 0, -1, 2] and both.replacement
    assert torch.equal(both.probs[:2], rows) and torch.equal(both.probs[2:], torch.eye(6)[[4, 5]])
    no_replacement = Draft(torch.tensor([1, 2]), rows, [-1, -1], replacement=False)
    assert beside(no_replacement, [3]) is no_replacement  # its siblings have their own rule: alone
    certain = beside(Draft(torch.tensor([4])), [5])  # a draft without rows is one-hot: so is the merge
    assert certain.parents == [-1, -1] and certain.probs is None and certain.replacement
    alone = beside(Draft(torch.empty(0, dtype=torch.long)), [3, 3])
    assert alone.tokens.tolist() == [3, 3] and alone.parents is None and alone.probs is None


def test_sampling_with_lookup_is_lossless_end_to_end(tiny, tmp_path):
    """eagle-chain + lookup at temperature 1, top-k 3: the first three sampled tokens follow the exact
    warped target distribution (chi-square, 1e-3), while lookup's branch (here: guesses of the greedy
    continuation, each with a one-hot row) is verified beside the heads' drawn chain and accepted."""
    from test_tree_engine import sampled_prefix_pvalue

    loaded = tiny[0]
    save_heads(tmp_path, random_heads("eagle", loaded, seed=3), loaded.name, 259)
    greedy = plain_greedy(loaded, PROMPT, 3)
    drafter = WithLookup(get_drafter("eagle-chain", None, loaded, heads=tmp_path, min_confidence=0.0), 2,
                         Oracle(PROMPT, greedy))
    through_lookup = []
    propose, update = drafter.propose, drafter.update

    def spy_propose(tokens, k):
        drafter.last = propose(tokens, k)
        return drafter.last

    def spy_update(n_accepted, next_token, path=None):
        roots = [] if drafter.last.parents is None else [i for i, q in enumerate(drafter.last.parents) if q == -1]
        through_lookup.append(len(roots) == 2 and bool(path) and path[0] == roots[1])  # lookup's branch
        update(n_accepted, next_token, path)
    drafter.propose, drafter.update = spy_propose, spy_update
    decoder = SpeculativeDecoder(loaded, SpeculativeSpec(verifier="sample", k=3), drafter=drafter)
    assert sampled_prefix_pvalue(loaded, PROMPT, SamplingParams(temperature=1.0, top_k=3), decoder, 1000) > 1e-3
    assert any(through_lookup)


def test_merged_drafter_names_and_refusals(tiny, tmp_path):
    loaded = tiny[2]
    save_heads(tmp_path, random_heads("eagle", loaded, seed=3), loaded.name, 259)
    save_heads(tmp_path / "medusa", random_heads("medusa", loaded, seed=3), loaded.name, 259)
    drafter = get_drafter("eagle+lookup", None, loaded, heads=tmp_path)
    assert drafter.name == "eagle+lookup" and drafter.base_k == 2 and drafter.tree
    assert drafter.max_nodes(6) == drafter.base.max_nodes(2) + 6  # sizes the caches; prices --k auto
    medusa = get_drafter("medusa-chain+lookup", None, loaded, heads=tmp_path / "medusa", base_k=1)
    assert medusa.name == "medusa-chain+lookup" and medusa.base_k == 1 and not medusa.base.tree
    model = get_drafter("model", loaded, loaded)
    with pytest.raises(SpeculateError, match="rolls back its own state"):
        WithLookup(model)


COPY_PROMPTS = [
    "Repeat the following sentence exactly: The old lighthouse keeper climbed the spiral stairs every evening "
    "to light the lamp for passing ships.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
    "clips did Natalia sell altogether in April and May?",
]


@pytest.mark.slow
def test_shipped_heads_with_lookup_on_the_default_model(default_model):
    """With the shipped heads at fp32: exactly plain greedy decoding, and fewer target calls than the
    heads alone on a prompt to copy and a question whose answer reuses its numbers."""
    plain = SpeculativeDecoder(default_model, SpeculativeSpec("none"))
    for name, alone_name, k in (("eagle+lookup", "eagle", 2), ("eagle-chain+lookup", "eagle-chain", 2)):
        merged = SpeculativeDecoder(default_model, SpeculativeSpec(name, verifier="greedy", k=6))
        alone = SpeculativeDecoder(default_model, SpeculativeSpec(alone_name, verifier="greedy", k=k))
        calls = {"merged": 0, "alone": 0}
        for prompt in COPY_PROMPTS:
            ref = plain.generate(prompt, max_new_tokens=48).token_ids
            for key, decoder in (("merged", merged), ("alone", alone)):
                g = decoder.generate(prompt, max_new_tokens=48)
                assert g.token_ids == ref, name
                calls[key] += g.stats.target_calls
        assert calls["merged"] < calls["alone"], (name, calls)
