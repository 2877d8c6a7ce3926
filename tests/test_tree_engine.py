"""Tree drafts in the engine: one target forward over the whole tree, the verifier's tree rule, the
accepted path kept in both caches. Tiny random models, exact token equality with plain decoding."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from scipy import stats as sstats

import speculate.verifiers.tree as tree_rules
from speculate import SpeculateError, SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.drafters import get_drafter
from speculate.drafters.base import Draft, Drafter
from speculate.drafters.model_tree import ModelTreeDrafter
from speculate.sampling import SamplingParams, warp
from speculate.stats import Stats
from speculate.verifiers import Verifier
from speculate.verifiers.tree import children_of
from conftest import noisy_copy


def random_prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def plain(model, prompt, n, **kw):
    return SpeculativeDecoder(model, SpeculativeSpec("none")).generate(prompt, max_new_tokens=n, **kw)


def off_first_branch(parents, path) -> bool:
    """Whether the accepted path goes through a node that is not its parent's first child."""
    children = children_of(parents)
    return any(children[parents[node] + 1][0] != node for node in path)


class Recording(ModelTreeDrafter):
    """model-tree, remembering each round's tree and accepted path."""

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.rounds = []

    def propose(self, tokens, k):
        draft = super().propose(tokens, k)
        self.last_parents = draft.parents
        return draft

    def update(self, n_accepted, next_token, path=None):
        self.rounds.append((self.last_parents, list(path)))
        super().update(n_accepted, next_token, path)

    def sibling_accepts(self) -> int:
        return sum(off_first_branch(parents, path) for parents, path in self.rounds)


class TreeOracle(Drafter):
    """A tree of depth ``depth`` whatever k is: ``wrong`` top-level branches of corrupted tokens first,
    then the true greedy continuation (itself corrupted at rate ``corrupt``) as the last sibling."""

    name = "tree-oracle"
    tree = True

    def __init__(self, prompt_len, reference, depth=8, wrong=1, corrupt=0.0, seed=0, vocab=259):
        self.prompt_len, self.reference, self.depth, self.wrong = prompt_len, reference, depth, wrong
        self.corrupt, self.vocab, self.rng = corrupt, vocab, random.Random(seed)

    def propose(self, tokens, k):
        done = len(tokens) - self.prompt_len
        truth = list(self.reference[done: done + self.depth])
        truth += [self.rng.randrange(self.vocab) for _ in range(self.depth - len(truth))]
        branches = []
        for _ in range(self.wrong):
            wrong = [self.rng.randrange(self.vocab) for _ in range(self.depth)]
            if wrong[0] == truth[0]:
                wrong[0] = (truth[0] + 1) % self.vocab
            branches.append(wrong)
        branches.append([self.rng.randrange(self.vocab) if self.rng.random() < self.corrupt else t for t in truth])
        tokens_out, parents = [], []
        for branch in branches:  # each branch a chain under the root
            for d, token in enumerate(branch):
                parents.append(-1 if d == 0 else len(tokens_out) - 1)
                tokens_out.append(token)
        return Draft(torch.tensor(tokens_out, dtype=torch.long), None, parents)


# ------------------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("branch", [2, 3])
def test_greedy_model_tree_equals_plain_decoding(tiny, k, branch):
    target = tiny[0]
    draft = noisy_copy(target, 0.2)
    drafter = Recording(draft, target, branch=branch)
    decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=k), drafter=drafter)
    siblings = accepted = 0
    for seed in range(3):
        prompt = random_prompt(seed, 6) * 4
        ref = plain(target, prompt, 48)
        out = decoder.generate(prompt, max_new_tokens=48)
        assert out.token_ids == ref.token_ids
        assert out.stats.new_tokens == 48
        assert max(len(parents) for parents, _ in drafter.rounds) == drafter.max_nodes(k) == branch * k
        siblings += drafter.sibling_accepts()
        accepted += out.stats.accepted_draft_tokens
    assert accepted > 0
    assert siblings > 0  # a second (or third) top-level alternative was accepted: tree paths exercised


@pytest.mark.parametrize("spread", [1, 2])
def test_a_tree_drafted_by_the_target_itself_is_accepted_whole(tiny, spread):
    """Draft = the target: the first branch is always right, so every round accepts its full depth.
    This checks the draft cache's rollback to the accepted path (a stale cache would miss)."""
    target = tiny[1]
    drafter = ModelTreeDrafter(noisy_copy(target, 0.0), target, branch=2, spread=spread)
    for k in (2, 4):
        prompt = random_prompt(10 + k, 9)
        ref = plain(target, prompt, 30)
        out = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=k),
                                 drafter=drafter).generate(prompt, max_new_tokens=30)
        assert out.token_ids == ref.token_ids
        st = out.stats
        assert st.rejected_rounds == 0 and st.accepted_by_position == st.drafted_by_position
        assert st.target_calls == -(-30 // (k + 1))
        assert drafter.max_nodes(k) == sum(2 ** min(d, spread) for d in range(1, k + 1))


@pytest.mark.parametrize("verifier", ["greedy", "sample"])
@pytest.mark.parametrize("wrong", [1, 2])
def test_tree_oracle_takes_the_right_sibling_and_respects_the_budget(tiny, wrong, verifier):
    """Trees deeper than k and than the budget (the engine prunes them), the right branch last. The
    oracle's siblings are certain drafts without p_draft rows (as the heads' greedy trees are): ``sample``
    at temperature 0 must take them as greedy does."""
    model = tiny[2]
    prompt = random_prompt(7, 5)
    ref = plain(model, prompt, 40)
    for n_new in (1, 2, 3, 9, 40):
        for corrupt in (0.0, 0.3):
            drafter = TreeOracle(len(prompt), ref.token_ids, depth=8, wrong=wrong, corrupt=corrupt, seed=n_new)
            out = SpeculativeDecoder(model, SpeculativeSpec(verifier=verifier, k=3),
                                     drafter=drafter).generate(prompt, max_new_tokens=n_new)
            assert out.token_ids == ref.token_ids[:n_new]
            assert out.stats.new_tokens == n_new and out.finish_reason == "length"
            # The engine prunes a tree only to the budget (k is the drafter's to respect): depth 8, or
            # what the budget still takes.
            assert max(len(out.stats.drafted_by_position), 1) == min(8, n_new - 1) or n_new == 1
            if corrupt == 0.0:  # every round accepts the last branch
                assert out.stats.rejected_rounds == 0
                assert out.stats.target_calls == -(-n_new // 9)
                assert out.stats.accepted_draft_tokens == n_new - out.stats.target_calls


def test_stop_inside_an_accepted_tree_path(tiny):
    model = tiny[1]
    prompt = random_prompt(5, 5)
    ref = plain(model, prompt, 40)
    cut = ref.token_ids[12]
    first = ref.token_ids.index(cut)
    decoder = SpeculativeDecoder(model, SpeculativeSpec(verifier="greedy", k=8),
                                 drafter=TreeOracle(len(prompt), ref.token_ids, depth=8))
    decoder.eos = {cut}
    out = decoder.generate(prompt, max_new_tokens=40)
    assert out.token_ids == ref.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stats.new_tokens == first + 1
    text = ref.text
    stop = text[15:18]
    assert stop and text.find(stop) >= 0
    out = SpeculativeDecoder(model, SpeculativeSpec(verifier="greedy", k=8),
                             drafter=TreeOracle(len(prompt), ref.token_ids, depth=8)).generate(
        prompt, max_new_tokens=40, stop=[stop])
    assert out.text == text[: text.find(stop)] and out.finish_reason == "stop"
    assert len(out.token_ids) < 40 and out.token_ids == ref.token_ids[: len(out.token_ids)]


# --------------------------------------------------------------------------------------- sampling


def sampled_prefix_pvalue(target, prompt, sampling: SamplingParams, decoder, n: int, after=None) -> float:
    """Chi-square p-value of the first three tokens ``decoder`` samples (n seeded runs) against the exact
    warped target distribution of three-token prefixes (bins expected below 5 pooled). ``after(i)``
    runs after generation i (the caller's bookkeeping)."""
    exact = {(): 1.0}
    with torch.no_grad():
        for _ in range(3):
            prefixes = sorted(exact)
            rows = warp(target.model(torch.tensor([prompt + list(pre) for pre in prefixes])).logits[:, -1], sampling)
            exact = {pre + (int(t),): exact[pre] * float(rows[i, t])
                     for i, pre in enumerate(prefixes) for t in rows[i].nonzero()[:, 0]}
    counts = Counter()
    for i in range(n):
        counts[tuple(decoder.generate(prompt, max_new_tokens=3, temperature=sampling.temperature,
                                      top_k=sampling.top_k, seed=i).token_ids)] += 1
        if after is not None:
            after(i)
    assert set(counts) <= set(exact)
    total = sum(exact.values())
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for key in sorted(exact):
        e = exact[key] / total * n
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + counts.get(key, 0), pooled_exp + e
        else:
            observed.append(counts.get(key, 0))
            expected.append(e)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    assert len(observed) >= 10
    return sstats.chisquare(observed, expected).pvalue


def test_tree_sampling_end_to_end_matches_the_target(tiny):
    """Distribution of the first three sampled tokens: model-tree + `sample` (multi-candidate, without
    replacement) against the exact warped target distribution. Chi-square at significance 1e-3."""
    target = tiny[0]
    draft = noisy_copy(target, 0.3)
    prompt = random_prompt(3, 8)
    s = SamplingParams(temperature=1.0, top_k=3)
    drafter = Recording(draft, target, branch=2)
    decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="sample", k=3), drafter=drafter)
    siblings = []
    assert sampled_prefix_pvalue(target, prompt, s, decoder, 1000,
                                 lambda i: siblings.append(drafter.sibling_accepts())) > 1e-3
    assert sum(siblings) > 0  # second siblings were tried and accepted: the without-replacement rule was used
    st = decoder.generate(prompt, max_new_tokens=40, temperature=1.0, top_k=3, seed=0).stats
    assert 0 < st.accepted_draft_tokens < st.drafted_tokens


def test_model_tree_draws_siblings_without_replacement(tiny):
    target = tiny[0]
    drafter = ModelTreeDrafter(noisy_copy(target, 0.3), target, branch=3, spread=2)
    tokens = [5, 6, 7]
    drafter.begin(tokens, SamplingParams(temperature=1.5), torch.Generator().manual_seed(0))
    for i in range(20):
        draft = drafter.propose(tokens, 3)
        assert len(draft) == drafter.max_nodes(3) == 3 + 9 + 9
        for kids in children_of(draft.parents):
            assert len({int(draft.tokens[c]) for c in kids}) == len(kids)  # no duplicate siblings
            assert all(torch.equal(draft.probs[c], draft.probs[kids[0]]) for c in kids)
        drafter.update(0, 10 + i, [])  # nothing accepted, the target adds one token
        tokens = tokens + [10 + i]


# ------------------------------------------------------------------------------------- consultant


def test_consultant_on_a_tree_carries_its_state_and_accepts_everything_with_a_huge_eps(tiny, monkeypatch):
    target = tiny[0]
    calls = []
    rule = tree_rules.tree_consultant

    def recording(tokens, parents, target_probs, state=None, **kw):
        verdict = rule(tokens, parents, target_probs, state, **kw)
        calls.append((state, verdict.state, len(verdict.path), max(tree_rules.depths(parents), default=0)))
        return verdict

    monkeypatch.setattr(tree_rules, "tree_consultant", recording)
    drafter = get_drafter("model-tree", noisy_copy(target, 0.5), target, branch=2)
    for temperature in (0.0, 1.0):
        calls.clear()
        decoder = SpeculativeDecoder(target, SpeculativeSpec(verifier="consultant", k=4, params={"eps": 1e9}),
                                     drafter=drafter)
        out = decoder.generate(random_prompt(4, 7), max_new_tokens=27, temperature=temperature, seed=1)
        assert out.stats.new_tokens == 27
        assert calls[0][0] is None
        for (_, state_out, _, _), (state_in, _, _, _) in zip(calls, calls[1:]):
            assert state_in == state_out and isinstance(state_out, float)  # the state is carried
        assert all(n == depth for _, _, n, depth in calls)  # the full depth, every round
        assert [depth for *_, depth in calls] == [4] * 5 + [1]  # 27 = 5 · (4 + 1) + (1 + 1)
        st = out.stats
        assert st.rejected_rounds == 0 and st.accepted_by_position == st.drafted_by_position


def test_typical_runs_on_a_tree_and_mentored_is_refused(tiny):
    target = tiny[0]
    drafter = get_drafter("model-tree", noisy_copy(target, 0.2), target)
    out = SpeculativeDecoder(target, SpeculativeSpec(verifier="typical", k=3),
                             drafter=drafter).generate(random_prompt(1, 5), max_new_tokens=20)
    assert out.stats.new_tokens == 20
    out = SpeculativeDecoder(target, SpeculativeSpec(verifier="typical", k=3),
                             drafter=drafter).generate(random_prompt(1, 5), max_new_tokens=20,
                                                                        temperature=0.7, seed=3)
    assert out.stats.new_tokens == 20
    with pytest.raises(SpeculateError, match="no tree rule"):
        SpeculativeDecoder(target, SpeculativeSpec(verifier="mentored", k=3), drafter=drafter)

    class Custom(Verifier):
        name = "custom"

    with pytest.raises(SpeculateError, match="no tree rule"):
        SpeculativeDecoder(target, SpeculativeSpec(k=3), drafter=drafter, verifier=Custom())
    with pytest.raises(SpeculateError, match="needs a draft model"):
        get_drafter("model-tree")
    with pytest.raises(SpeculateError, match="branch"):
        get_drafter("model-tree", target, target, branch=0)


# ---------------------------------------------------------------------------------- the plumbing


def test_draft_within_prunes_deep_nodes_and_reindexes():
    probs = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    #              node:  0   1  2  3   4  5       tree: 0→1→2, 0→3, 4→5
    draft = Draft(torch.tensor([10, 11, 12, 13, 14, 15]), probs, [-1, 0, 1, 0, -1, 4])
    assert draft.node_depths() == [1, 2, 3, 2, 1, 2] and draft.depth == 3
    assert draft.within(3) is draft
    two = draft.within(2)
    assert two.tokens.tolist() == [10, 11, 13, 14, 15] and two.parents == [-1, 0, 0, -1, 3]
    assert torch.equal(two.probs, probs[[0, 1, 3, 4, 5]])
    one = draft.within(1)
    assert one.tokens.tolist() == [10, 14] and one.parents == [-1, -1]
    assert len(draft.within(0)) == 0 and draft.within(0).parents == []
    chain = Draft(torch.tensor([1, 2, 3]))
    assert chain.within(2).tokens.tolist() == [1, 2] and chain.within(2).parents is None and chain.depth == 3
    # The other fields stay: a copy not sized by k is still one when the budget cuts it.
    copy = Draft(torch.tensor([1, 2, 3]), from_k=False)
    assert copy.within(2).from_k is False and len(copy.within(2)) == 2
    assert Draft(torch.tensor([1, 2]), None, [-1, 0], replacement=True).within(1).replacement is True


def test_stats_record_a_tree_by_depth():
    st = Stats()
    st.record(6, 2, 3)  # 6 nodes, depth 3, a path of 2
    st.record(4, 2, 2)
    st.record(3, 1)  # a chain of 3
    assert st.drafted_tokens == 13 and st.accepted_draft_tokens == 5 and st.rejected_rounds == 2
    assert st.drafted_by_position == [3, 3, 2] and st.accepted_by_position == [3, 2, 0]


def test_layerskip_drafts_with_the_targets_own_first_layers(tiny):
    """Early exit shares every weight with the target (nothing copied, the target untouched) and greedy
    decoding with it equals plain decoding."""
    from speculate.drafters import get_drafter
    from speculate.drafters.layerskip import early_exit_model

    target = tiny[0]
    prompt = "abcabc hello hello"
    plain = SpeculativeDecoder(target,
                               SpeculativeSpec("none")).generate(prompt, max_new_tokens=30)  # fuses the target once
    target_ptrs = {p.data_ptr() for p in target.model.parameters()}
    n_layers = len(target.model.model.layers)
    short = early_exit_model(target, 1)
    assert len(short.model.model.layers) == 1 and len(target.model.model.layers) == n_layers
    assert {p.data_ptr() for p in short.model.parameters()} <= target_ptrs
    out = SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=3),
                             drafter=get_drafter("layerskip", None, target)).generate(
        prompt, max_new_tokens=30)
    assert out.token_ids == plain.token_ids
    assert out.stats.drafted_tokens > 0
    assert {p.data_ptr() for p in target.model.parameters()} == target_ptrs  # no weight was copied
    with pytest.raises(SpeculateError, match="layerskip"):
        early_exit_model(target, n_layers)
