"""``model+lookup``: lookup drafts the rounds it can copy, the draft model the rest (drafters/model_lookup.py)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from scipy import stats as sstats

from speculate import SpeculateError, SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.engine import step
from speculate.cli import main
from speculate.drafters import get_drafter, parse_options
from speculate.drafters.model_lookup import ModelWithLookup
from speculate.sampling import SamplingParams, warp
from conftest import noisy_copy


class Recording(ModelWithLookup):
    """model+lookup, remembering each round: (drafted by lookup?, tokens drafted, tokens accepted), and
    counting the draft model's forwards."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.rounds, self.forwards = [], 0
        forward_many = self.drafter.kv.forward_many  # (every forward of the lean path goes through it)

        def counted(items):
            self.forwards += 1
            return forward_many(items)

        self.drafter.kv.forward_many = counted

    def propose(self, tokens, k):
        draft = super().propose(tokens, k)
        self.rounds.append([self.copied, len(draft), None])
        return draft

    def update(self, n_accepted, next_token):
        self.rounds[-1][2] = n_accepted
        super().update(n_accepted, next_token)


def repetitive_prompt(seed, n=6, times=4):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)] * times


@pytest.mark.parametrize("k,min_match,lookup_k", [(1, 3, None), (3, 3, 10), (4, 1, 8), (6, 2, None), (3, 5, 10)])
def test_greedy_equals_plain_decoding_with_both_kinds_of_rounds(tiny, k, min_match, lookup_k):
    target = tiny[0]
    draft = noisy_copy(target, 0.1)
    kinds = Counter()
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        ref = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(prompt, max_new_tokens=48)
        drafter = Recording(draft, target, min_match=min_match, lookup_k=lookup_k)
        out = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=k),
                                 drafter=drafter).generate(prompt, max_new_tokens=48)
        assert out.token_ids == ref.token_ids
        kinds.update(copied for copied, _, _ in drafter.rounds)
        # The draft model ran only in its own rounds: k forwards each (the first also feeds the unseen
        # committed tokens), none in lookup's.
        model_rounds = [r for r in drafter.rounds if not r[0]]
        assert drafter.forwards == sum(n for _, n, _ in model_rounds)
        # Lookup's first copy is up to lookup_k (or k) tokens; later ones may have grown (drafters/lookup.py),
        # never past what the KV caches were sized for.
        copies = [n for copied, n, _ in drafter.rounds if copied]
        assert not copies or (copies[0] <= (lookup_k or k) and max(copies) <= drafter.max_nodes(k))
    assert kinds[True] > 0 and kinds[False] > 0  # both kinds of rounds happened


def test_the_draft_model_catches_up_after_lookup_rounds(tiny):
    """With the target itself as the draft model every draft-model round is accepted whole, also right
    after rounds drafted by lookup (which the draft model did not see): its cache follows the committed
    tokens. Lookup's own copies are often wrong on a random model."""
    target = tiny[1]
    for seed in range(3):
        prompt = repetitive_prompt(seed + 10, n=5, times=3)
        drafter = Recording(noisy_copy(target, 0.0), target, min_match=1)
        out = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=3),
                                 drafter=drafter).generate(prompt, max_new_tokens=40)
        ref = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(prompt, max_new_tokens=40)
        assert out.token_ids == ref.token_ids
        model_rounds = [(n, acc) for copied, n, acc in drafter.rounds if not copied]
        after_copy = [i for i in range(1, len(drafter.rounds)) if drafter.rounds[i - 1][0] and not drafter.rounds[i][0]]
        assert model_rounds and after_copy
        assert all(acc == n for n, acc in model_rounds)
        assert any(acc < n for copied, n, acc in drafter.rounds if copied)  # lookup was wrong at times


def test_k_auto_learns_only_from_the_draft_models_rounds(tiny, tmp_path, monkeypatch):
    """``--k auto`` sizes the draft model's rounds, so its α estimate counts only those: lookup's copies,
    of their own length and acceptance, are left out (they would pull k towards lookup's rate)."""
    from speculate.policy.auto import AutoK

    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path))  # the cost profile is measured into a scratch cache
    target = tiny[0]
    drafter = Recording(noisy_copy(target, 0.1), target, min_match=1)
    decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k="auto"), drafter=drafter)
    prompt = repetitive_prompt(3)
    run = decoder.start(prompt, max_new_tokens=48)
    while not run.done:
        step([run])
    assert run.generation.token_ids == \
        SpeculativeDecoder(target, SpeculativeSpec("none")).generate(prompt, max_new_tokens=48).token_ids
    policy = run.policy  # (each run's own: the decoder's is the prior it starts from)
    assert isinstance(policy, AutoK)
    prior_successes, prior_failures = policy.alpha0 * policy.prior_weight, (1 - policy.alpha0) * policy.prior_weight
    model_rounds = [(n, acc) for copied, n, acc in drafter.rounds if not copied and n]
    copies = [(n, acc) for copied, n, acc in drafter.rounds if copied]
    assert model_rounds and copies
    assert policy.successes == pytest.approx(prior_successes + sum(acc for _, acc in model_rounds))
    assert policy.failures == pytest.approx(prior_failures + sum(acc < n for n, acc in model_rounds))


def test_sampling_is_lossless(tiny):
    """The first three sampled tokens against the exact warped target distribution (chi-square at 1e-3):
    the prompt repeats, so rounds are drafted by lookup (one-hot rows) and by the draft model."""
    target = tiny[2]
    draft = noisy_copy(target, 0.3)
    s = SamplingParams(temperature=1.0, top_k=3)

    def rows(prefixes):
        with torch.no_grad():
            return warp(target.model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1], s)

    # A prompt whose first copied token (the one after the last token's earlier occurrence: the first
    # token again) the target may sample, so that a copy is accepted at times and rejected at others.
    for seed in range(100):
        prompt = repetitive_prompt(seed, n=4, times=2)
        if 0.1 < rows([()])[0, prompt[0]] < 0.9:
            break
    else:
        pytest.fail("no prompt whose copied token the target samples")

    exact = {(): 1.0}
    for _ in range(3):
        prefixes = list(exact)
        probs = rows(prefixes)
        exact = {(*p, int(t)): exact[p] * float(probs[i, t]) for i, p in enumerate(prefixes)
                 for t in probs[i].nonzero()[:, 0]}
    drafter = Recording(draft, target, min_match=1)
    decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="sample", k=2), drafter=drafter)
    n = 3000
    counts = Counter(tuple(decoder.generate(prompt, max_new_tokens=3, temperature=1.0, top_k=3, seed=i).token_ids)
                     for i in range(n))
    assert set(counts) <= set(exact)
    keys = sorted(exact)
    total = sum(exact.values())
    assert sstats.chisquare([counts.get(key, 0) for key in keys], [exact[key] / total * n for key in keys]).pvalue > 1e-3
    kinds = Counter(copied for copied, _, _ in drafter.rounds)
    assert kinds[True] > 100 and kinds[False] > 100


def test_options_and_refusals(tiny, tiny_folders, capsys):
    target = tiny[0]
    assert parse_options("model+lookup", ["min_match=2", "lookup_k=10"]) == {"min_match": 2, "lookup_k": 10}
    default = get_drafter("model+lookup", target, target)
    assert (default.min_match, default.lookup_k) == (3, 10)  # copies may run longer than k (docs/benchmarks.md,
    # "Prompt lookup beside the draft model")
    drafter = get_drafter("model+lookup", target, target, min_match=2, lookup_k=10, max_copy=0)
    assert (drafter.min_match, drafter.lookup_k, drafter.max_nodes(4), drafter.max_nodes(12)) == (2, 10, 10, 12)
    assert default.max_nodes(4) == 32  # copies accepted whole grow up to 32 (drafters/lookup.py)
    with pytest.raises(SpeculateError, match="needs a draft model"):
        get_drafter("model+lookup", target=target)
    with pytest.raises(SpeculateError, match="min_match must be 1..8"):
        get_drafter("model+lookup", target, target, min_match=9)
    assert get_drafter("model+lookup", target, target, min_match=5).lookup.max_ngram == 5
    with pytest.raises(SpeculateError, match="lookup_k must be >= 1"):
        get_drafter("model+lookup", target, target, lookup_k=0)
    with pytest.raises(SpeculateError, match="takes: min_match, lookup_k"):
        parse_options("model+lookup", ["branch=2"])
    # The command line: the draft model is accepted for model+lookup, and its options reach it.
    folder = str(tiny_folders[0])
    assert main(["generate", "abc abc abc", "--model", folder, "--drafter", "model+lookup", "--draft-model", folder,
                 "--drafter-opt", "min_match=1", "--max-new-tokens", "8", "--json", "--no-chat"]) == 0
    assert main(["generate", "abc", "--model", folder, "--drafter", "lookup", "--draft-model", folder]) == 2
    assert "--draft-model needs --drafter model, model-tree, model+lookup" in capsys.readouterr().err
