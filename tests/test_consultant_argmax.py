"""Consultant Decoding with the argmax clause (``argmax=True``, our extension, verifiers/consultant.py): a round never
keeps fewer drafts than greedy verification, and where the clause never fires it is the paper's rule exactly."""

from __future__ import annotations

import random

import pytest
import torch

from speculate.sampling import SamplingParams, warp
from speculate.verifiers import get_verifier
from speculate.tree_shape import path_to
from speculate.verifiers.tree import tree_greedy


def rows(seed: int, k: int, v: int = 12, sharp: float = 3.0):
    """Raw target rows [k+1, V] (softmax of random logits), the greedy-warped rows, and the logits."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(k + 1, v, generator=g) * sharp
    return logits.softmax(-1), warp(logits, SamplingParams()), logits


def cd(eps, beta, argmax):
    return get_verifier("consultant", eps=eps, beta=beta, argmax=argmax, greedy=True)


@pytest.mark.parametrize("eps,beta", [(0.3, 0.0), (1.0, 0.2), (2.0, 0.5), (0.05, 0.9)])
def test_never_fewer_drafts_than_greedy_and_never_fewer_than_the_papers_rule(eps, beta):
    greedy = get_verifier("greedy")
    rng = random.Random(0)
    fired = 0
    for seed in range(400):
        k = rng.randrange(1, 7)
        raw, warped, logits = rows(seed, k, sharp=rng.choice([0.5, 1.0, 3.0]))
        # Drafts that follow the argmax for a while, then anything: long greedy prefixes and rejections.
        top = logits.argmax(-1)
        cut = rng.randrange(0, k + 1)
        tokens = torch.tensor([int(top[i]) if i < cut else rng.randrange(12) for i in range(k)])
        state = rng.choice([None, 0.0, rng.uniform(0, 4)])
        ours = cd(eps, beta, True).verify(tokens, None, raw, state, sample_probs=warped)
        paper = cd(eps, beta, False).verify(tokens, None, raw, state, sample_probs=warped)
        exact = greedy.verify(tokens, None, warped)
        assert ours.n_accepted >= exact.n_accepted and ours.n_accepted >= paper.n_accepted
        fired += ours.n_accepted > paper.n_accepted
    assert fired > 20  # the clause made a difference in many rounds


def test_where_the_clause_never_fires_it_is_the_papers_rule_state_and_all():
    rng = random.Random(1)
    for seed in range(300):
        k = rng.randrange(1, 7)
        raw, warped, logits = rows(1000 + seed, k, sharp=1.0)
        top = logits.argmax(-1)
        # Never the argmax: the clause cannot fire.
        tokens = torch.tensor([(int(top[i]) + rng.randrange(1, 12)) % 12 for i in range(k)])
        state = rng.uniform(0, 3)
        for eps, beta in ((0.5, 0.0), (2.0, 0.2), (3.0, 0.6)):
            ours = cd(eps, beta, True).verify(tokens, None, raw, state, sample_probs=warped)
            paper = cd(eps, beta, False).verify(tokens, None, raw, state, sample_probs=warped)
            assert (ours.n_accepted, ours.next_token, ours.state) == (paper.n_accepted, paper.next_token, paper.state)


def test_an_unsure_argmax_is_accepted_and_its_nll_enters_the_ema():
    """A flat target row: its argmax has NLL ~ log V > eps, so the paper's rule rejects it and the clause keeps it;
    the carried state is the EMA over the accepted tokens' NLLs and the next token's, as Algorithm 1 updates it."""
    v = 50
    logits = torch.zeros(3, v)
    logits[0, 7] = 0.1  # a near-uniform row whose argmax is 7
    logits[1, 3] = 9.0  # a confident row
    logits[2, 5] = 9.0
    raw, warped = logits.softmax(-1), warp(logits, SamplingParams())
    tokens = torch.tensor([7, 3])
    paper = cd(2.0, 0.2, False).verify(tokens, None, raw, 0.0, sample_probs=warped)
    ours = cd(2.0, 0.2, True).verify(tokens, None, raw, 0.0, sample_probs=warped)
    assert paper.n_accepted == 0 and ours.n_accepted == 2 and ours.next_token == 5
    nll = [-float(raw[0, 7].log()), -float(raw[1, 3].log()), -float(raw[2, 5].log())]
    r = 0.0
    for x in nll:
        r = 0.2 * r + 0.8 * x
    assert ours.state == pytest.approx(r)


def test_trees_never_keep_a_shorter_path_than_greedy():
    rng = random.Random(2)
    fired = 0
    for seed in range(300):
        n = rng.randrange(1, 9)
        parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
        raw, warped, logits = rows(5000 + seed, n, sharp=rng.choice([0.7, 2.0]))
        top = logits.argmax(-1)
        # Each node the argmax of its parent's row half the time.
        tokens = torch.tensor([int(top[p + 1]) if rng.random() < 0.5 else rng.randrange(12) for p in parents])
        exact = tree_greedy(tokens, parents, warped, None)
        ours = cd(1.0, 0.3, True).verify_tree(tokens, parents, None, raw, None, sample_probs=warped)
        paper = cd(1.0, 0.3, False).verify_tree(tokens, parents, None, raw, None, sample_probs=warped)
        assert len(ours.path) >= len(exact.path) and len(ours.path) >= len(paper.path)
        assert ours.path == path_to(parents, ours.path[-1]) if ours.path else True
        fired += len(ours.path) > len(paper.path)
    assert fired > 10
