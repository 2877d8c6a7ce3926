"""Peeks (Drafter.peek): a round that drafts nothing still learns α from the drafter's free first token.

A peek must be exactly the first token the drafter's proposal would draft, must change nothing that a later proposal or
verdict does, and each peek is one Bernoulli trial of α: the run's α (AutoK's, or a capped fixed k's in the batch
planner) moves by exactly the hits and misses."""

from __future__ import annotations

import random

import pytest
import torch

from speculate import SamplingParams, SpeculativeDecoder
from speculate.drafters import suffix
from speculate.drafters.base import Draft
from speculate.drafters.lookup import LookupDrafter
from speculate.drafters.suffix import SuffixDrafter
from speculate.engine import step
from speculate.policy.auto import ALPHA0, PRIOR_WEIGHT, AutoK
from speculate.policy.batch import BatchPlanner, _alpha, plan
from speculate.spec import SpeculativeSpec


def sequence(n: int = 400, seed: int = 5) -> list[int]:
    """Tokens that repeat themselves now and then, with edits: copies that are accepted whole, in part, or not."""
    rng = random.Random(seed)
    out = [rng.randrange(50) for _ in range(20)]
    while len(out) < n:
        if rng.random() < 0.5:  # copy an earlier stretch, perhaps with one token changed
            start = rng.randrange(len(out) - 8)
            piece = out[start: start + rng.randrange(4, 24)]
            if rng.random() < 0.5:
                piece[rng.randrange(len(piece))] = rng.randrange(50)
            out += piece
        else:
            out += [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
    return out[:n]


def replay(make, tokens: list[int], k: int = 6, prompt: int = 20):
    """Two drafters from ``make`` decode ``tokens`` as greedy verification would (each draft kept up to its first
    wrong token, then the right one): one peeks before each proposal, one never does. Returns both and the peeks."""
    peeking, plain = make(), make()
    for d in (peeking, plain):
        d.begin(tokens[:prompt], SamplingParams(), None)
    peeks, t = [], prompt
    while t < len(tokens):
        first = peeking.peek(tokens[:t])
        a, b = peeking.propose(tokens[:t], k), plain.propose(tokens[:t], k)
        assert a.tokens.tolist() == b.tokens.tolist()  # a peek changes no proposal...
        assert first == (int(a.tokens[0]) if len(a) else None)  # ...and is the proposal's first token
        peeks.append(first)
        drafted = a.tokens.tolist()
        n = 0
        while n < len(drafted) and t + n < len(tokens) and drafted[n] == tokens[t + n]:
            n += 1
        if t + n >= len(tokens):
            break
        for d in (peeking, plain):
            d.update(n, tokens[t + n])  # ...nor what a verdict does (a copy's growth)
        t += n + 1
    return peeking, plain, peeks


def test_prompt_lookups_peek_is_its_proposals_first_token_and_changes_nothing():
    tokens = sequence()
    peeking, plain, peeks = replay(LookupDrafter, tokens)
    assert sum(p is not None for p in peeks) > 20 and sum(p is None for p in peeks) > 5  # (both cases seen)
    assert peeking.growth == plain.growth


def test_the_served_index_peeks_as_it_drafts_and_a_peek_is_not_counted_as_a_lookup(tiny):
    """The suffix drafter's index drafts where the context match is short (here always: min_context past any match)."""
    tokens = sequence(300, seed=9)
    scopes = iter(["peek-a", "peek-b"])

    def make():
        drafter = SuffixDrafter(tiny[0], min_context=9, scope=next(scopes))
        drafter.served.add(sequence(300, seed=9)[:150])  # the first half, as if served before
        return drafter

    suffix._INDEXES.clear()
    peeking, plain, peeks = replay(make, tokens)
    assert sum(p is not None for p in peeks) > 10
    assert peeking.from_index == plain.from_index > 0
    assert peeking.served.lookups == plain.served.lookups and peeking.served.hits == plain.served.hits
    suffix._INDEXES.clear()


def test_retrievals_store_peeks_as_it_drafts(default_model):
    from speculate.drafters.retrieval import RetrievalDrafter

    ids = default_model.tokenizer("To find the total number of apples, we need to add the number of apples in each "
                                  "basket. Here are some tips to help you stay focused and productive.")["input_ids"]
    peeking, plain, peeks = replay(lambda: RetrievalDrafter(default_model), ids, prompt=2)
    assert peeking.from_store == plain.from_store > 0  # (the store drafted, and peeked the same first tokens)


def expected_peeks(tokens: list[int], prompt: int, new: int) -> tuple[int, int]:
    """(peeks, hits) that rounds of k = 0 make over an answer: one per token but the last (no budget left there),
    each lookup's first token against the token that came."""
    drafter = LookupDrafter()
    drafter.begin(tokens[:prompt], SamplingParams(), None)
    firsts = [drafter.peek(tokens[:prompt + j]) for j in range(new - 1)]
    hits = sum(f == tokens[prompt + j] for j, f in enumerate(firsts))
    return sum(f is not None for f in firsts), hits


def test_rounds_that_draft_nothing_peek_and_alpha_learns_exactly_their_hits(tiny):
    """Lookup runs stepped with k = 0 throughout (as a planner that drafts nothing would): each round peeks, and the
    run's α, AutoK's or a capped fixed k's, counts exactly the peeks that hit and missed; the tokens are plain
    decoding's."""
    target = tiny[0]
    prompts = [[3, 4, 5, 6] * 4, [7, 8, 9, 10, 11] * 3]
    new = 40
    plain = SpeculativeDecoder(target, SpeculativeSpec("none", verifier="greedy"))
    answers = [plain.generate(p, max_new_tokens=new, chat=False).token_ids for p in prompts]
    runs = [SpeculativeDecoder(target, SpeculativeSpec("lookup", verifier="greedy", k=k)).start(p, max_new_tokens=new)
            for p, k in zip(prompts, ["auto", 5])]
    assert isinstance(runs[0].policy, AutoK)
    runs[1].k_is_cap = True
    while not all(run.done for run in runs):
        live = [run for run in runs if not run.done]
        step(live, [0] * len(live))
    for run, prompt, answer in zip(runs, prompts, answers):
        assert run.generation.token_ids == answer
        peeks, hits = expected_peeks(prompt + answer, len(prompt), new)
        assert (run.stats.peeked_rounds, run.stats.peek_hits) == (peeks, hits)
        assert run.stats.drafted_tokens == 0
    assert sum(run.stats.peek_hits for run in runs) >= 5  # (the tiny model repeats itself: peeks hit)
    # α: hits over trials, with the prior's pseudo-rounds (AutoK's own tally; the planner's for a capped fixed k)
    for run in runs:
        s = run.stats
        want = (s.peek_hits + ALPHA0 * PRIOR_WEIGHT) / (s.peeked_rounds + PRIOR_WEIGHT)
        assert _alpha(run) == pytest.approx(want)
    assert runs[0].policy.alpha == pytest.approx(_alpha(runs[0]))


class Oracle(LookupDrafter):
    """Drafts ``answer``'s next tokens (right where ``answer`` is plain decoding's), or ``shift`` added to each."""

    name = "oracle"

    def __init__(self, answer: list[int], shift: int = 0):
        super().__init__()
        self.answer, self.shift = answer, shift

    def propose(self, tokens, k):
        chain = [t + self.shift for t in self.answer[len(tokens): len(tokens) + k]]
        return Draft(torch.tensor(chain, dtype=torch.long))

    def peek(self, tokens):
        return self.answer[len(tokens)] + self.shift if len(tokens) < len(self.answer) else None


@pytest.mark.parametrize("shift", [0, 1])
def test_a_run_planned_no_draft_is_planned_drafts_again_once_its_peeks_hit(tiny, shift):
    """Two capped runs on a curve where a draft pays only from α ≈ 0.7. After one rejected draft each (α 0.48) the
    planner drafts nothing; rounds of peeks that hit (a drafter that knows the answer) raise α until it drafts again,
    nine rounds on, and each plan is the plan for the peeks' α. Peeks that miss (the same drafter, off by one) keep it
    at k = 0 to the end. The answers are plain decoding's either way."""
    target = tiny[0]
    prompts = [[3, 4, 5, 6] * 4, [7, 8, 9, 10, 11] * 3]
    plain = SpeculativeDecoder(target, SpeculativeSpec("none", verifier="greedy"))
    answers = [p + plain.generate(p, max_new_tokens=40, chat=False).token_ids for p in prompts]
    runs = []
    for answer, prompt in zip(answers, prompts):
        decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=5),
                                     drafter=Oracle(answer, shift))
        runs.append(decoder.start(prompt, max_new_tokens=40))
        runs[-1].k_is_cap = True
    planner = BatchPlanner(target)
    planner.gate.draft = lambda key: True  # (the plan alone, not the measured gate)
    planner._curve = {1: 1.0, 2: 1.7, 256: 180.0}  # a row costs 0.7 of a step: a draft pays from α ≈ 0.7
    step(runs, [0, 0])  # the prompts go in (with a peek each)
    for run in runs:
        run.stats.rejected_rounds += 1  # (as if each had lost its joining round's draft)
    plans = []
    while not all(run.done for run in runs):
        live = [run for run in runs if not run.done]
        plans.append(planner(live))
        if len(live) == 2:
            alphas = [_alpha(run) for run in runs]
            assert plans[-1] == plan(alphas, [None] * 2, [min(5, r.budget) for r in runs], [lambda k: k + 1] * 2,
                                     [0.0] * 2, planner._curve)
        step(live, plans[-1])
    drafting = [i for i, ks in enumerate(plans) if ks and any(ks)]
    if shift:
        assert not drafting and all(run.stats.peek_hits == 0 for run in runs)
        assert all(run.stats.peeked_rounds == 39 for run in runs)  # every round but the last peeked
    else:
        # Round i has seen 1 + i peeks, all hits: α = (2.4 + 1 + i) / (4 + 1 + 1 + i). A draft pays where
        # (2 + α) / T(3) > 2 / T(2), T(3) = 1.7 + 178.3 / 254: α > 0.826, first at i = 9.
        assert drafting and drafting[0] == 9 and all(ks and ks[0] for ks in plans[9:30])
    for run, answer in zip(runs, answers):
        assert run.tokens == answer


def test_drafters_that_cannot_peek_for_free_do_not(tiny):
    """A draft model's proposal costs a forward: no peek, so its α is left as its own rounds make it."""
    decoder = SpeculativeDecoder(tiny[0], SpeculativeSpec("model", verifier="greedy", k=3), draft_model=tiny[1])
    run = decoder.start([3, 4, 5], max_new_tokens=12)
    while not run.done:
        step([run], [0])
    assert run.stats.peeked_rounds == 0 and run.stats.drafted_tokens == 0
    assert torch.equal(torch.tensor(run.generation.token_ids),
                       torch.tensor(SpeculativeDecoder(tiny[0], SpeculativeSpec("none")).generate(
                           [3, 4, 5], max_new_tokens=12, chat=False).token_ids))
