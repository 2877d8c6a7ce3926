"""Tests of the tree verifiers (speculate.verifiers.tree).

- Chain-shaped trees: every tree rule gives exactly the chain verifier's verdict, and consumes the
  shared generator identically (same seed -> same verdict AND the same generator state afterwards).
- Hand-made trees for greedy, consultant (hand-computed EMAs) and typical.
- Losslessness of multi-candidate sampling, both drafting schemes: chi-square of the first output
  token and of the first two tokens jointly against p_target (p > ALPHA), with negative controls that
  must fail the same test (p < CONTROL_ALPHA). All generators are seeded: each run is deterministic.

Naming: p_target / p_draft (target_probs / draft_probs), never a bare p or q.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from speculate.verifiers import tree as tree_module
from speculate.verifiers.base import Verdict
from speculate.verifiers.consultant import ConsultantVerifier
from speculate.verifiers.greedy import GreedyVerifier
from speculate.verifiers.sample import SampleVerifier
from speculate.verifiers.tree import (
    chain_as_tree,
    children_of,
    depths,
    paths,
    tree_consultant,
    tree_greedy,
    tree_sample,
    tree_typical,
)
from speculate.verifiers.typical import TypicalVerifier

ALPHA = 1e-3  # a correct rule must pass every chi-square test at this level
CONTROL_ALPHA = 1e-6  # a negative control must fail it at this level
N_TRIALS = 20_000
V = 5


def dirichlet(rng: np.random.Generator, v: int, rows: int = 1, conc: float = 1.0) -> torch.Tensor:
    return torch.tensor(rng.dirichlet(np.full(v, conc), size=rows), dtype=torch.float32)


def chisq_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; cells of probability 0 must be empty (asserted), cells with
    expected count below ``min_expected`` are pooled into one."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    zero = probs <= 0
    assert counts[zero].sum() == 0, "tokens of probability 0 were output"
    counts, probs = counts[~zero], probs[~zero]
    expected = probs * counts.sum()
    small = expected < min_expected
    if small.sum() > 1:
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(stats.chisquare(counts, expected).pvalue)


def consultant_tree(tokens, parents, target, state=None, generator=None, sample_probs=None, **params):
    """Consultant's tree rule as the engine calls it: the verifier (its declared parameters) and its method."""
    return ConsultantVerifier(**params).verify_tree(tokens, parents, None, target, state, generator, sample_probs)


def typical_tree(tokens, parents, target, state=None, generator=None, sample_probs=None, **params):
    return TypicalVerifier(**params).verify_tree(tokens, parents, None, target, state, generator, sample_probs)


# ---------------------------------------------------------------------------------- tree helpers


def test_tree_helpers():
    assert chain_as_tree(0) == [] and chain_as_tree(1) == [-1] and chain_as_tree(4) == [-1, 0, 1, 2]
    parents = [-1, -1, 0, 0, 1, 3]
    assert paths(parents) == [[0, 2], [1, 4], [0, 3, 5]]
    assert paths(chain_as_tree(3)) == [[0, 1, 2]] and paths([]) == []
    assert depths(parents) == [1, 1, 2, 2, 2, 3]
    assert children_of(parents) == [[0, 1], [2, 3], [4], [], [5], [], []]


@pytest.mark.parametrize(
    "tokens,parents,target_shape,match",
    [
        (torch.tensor([1, 2]), [-1], (3, 4), "parents has 1"),
        (torch.tensor([1, 2]), [-1, 1], (3, 4), "topological"),
        (torch.tensor([1, 2]), [-1, -2], (3, 4), "topological"),
        (torch.tensor([1, 2]), [-1, 0], (2, 4), r"\[N\+1, V\]"),
        (torch.tensor([1, 9]), [-1, 0], (3, 4), r"token ids must be in \[0, 4\)"),
        (torch.tensor([1.0, 2.0]), [-1, 0], (3, 4), "1-D integer"),
        (torch.tensor([[1, 2]]), [-1, 0], (3, 4), "1-D integer"),
    ],
)
def test_validation_errors(tokens, parents, target_shape, match):
    target = torch.full(target_shape, 0.25)
    for call in (
        lambda: tree_greedy(tokens, parents, target),
        lambda: consultant_tree(tokens, parents, target),
        lambda: typical_tree(tokens, parents, target),
        lambda: tree_sample(tokens, parents, torch.full((2, target_shape[1]), 0.25), target, None),
    ):
        with pytest.raises(ValueError, match=match):
            call()


def test_sample_validation_errors():
    tokens, parents, target = torch.tensor([0, 1]), [-1, -1], torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="needs draft_probs"):
        tree_sample(tokens, parents, None, target, None)
    with pytest.raises(ValueError, match=r"draft_probs must be \[N, V\] = \[2, 4\]"):
        tree_sample(tokens, parents, torch.full((2, 5), 0.2), target, None)
    draft = torch.tensor([[0.25] * 4, [0.1, 0.2, 0.3, 0.4]])
    with pytest.raises(ValueError, match="siblings 0 and 1 have different draft_probs"):
        tree_sample(tokens, parents, draft, target, None)  # without replacement: one shared row
    tree_sample(tokens, parents, draft, target, None, replacement=True)  # independent draws: a row each
    with pytest.raises(ValueError, match="eps"):  # (parameters are checked by the verifier's declaration)
        consultant_tree(tokens, parents, target, eps=0.0)
    with pytest.raises(ValueError, match="delta"):
        typical_tree(tokens, parents, target, delta=-1.0)


# ------------------------------------------------------------------------ chain-shaped trees


def random_chain_case(rng, k, v=6, conc=0.5):
    target = dirichlet(rng, v, rows=k + 1, conc=conc)
    draft = dirichlet(rng, v, rows=k, conc=conc)
    # Half the drafts are the target argmax, so greedy / consultant / typical accept some.
    x = torch.where(torch.tensor(rng.random(k) < 0.5), target[:k].argmax(1), torch.tensor(rng.integers(0, v, size=k)))
    return x, draft, target


def test_chain_equivalence_deterministic_rules():
    rng = np.random.default_rng(0)
    lengths = []
    for trial in range(300):
        k = int(rng.integers(0, 6))
        x, _, target = random_chain_case(rng, k)
        parents = chain_as_tree(k)
        state = None if trial % 3 == 0 else float(rng.uniform(0, 4))
        g = GreedyVerifier().verify(x, None, target)
        tg = tree_greedy(x, parents, target)
        assert (tg.path, tg.next_token) == (list(range(g.n_accepted)), g.next_token)
        lengths.append(g.n_accepted)
        eps, beta = float(rng.uniform(0.5, 3)), float(rng.uniform(0, 0.9))
        for greedy in (True, False):
            # consultant, with the carried state; greedy=False draws from sample_probs (or target_probs)
            sample_probs = dirichlet(rng, target.shape[1], rows=k + 1) if trial % 2 else None
            gen_chain, gen_tree = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
            c = ConsultantVerifier(eps, beta, greedy).verify(x, None, target, state, gen_chain, sample_probs)
            cd = ConsultantVerifier(eps, beta, greedy)
            tc = tree_consultant(x, parents, target, state, cd, gen_tree, sample_probs)
            assert (tc.path, tc.next_token, tc.state) == (list(range(c.n_accepted)), c.next_token, c.state)
            assert torch.equal(gen_chain.get_state(), gen_tree.get_state())
            # typical
            teps, delta = float(rng.uniform(0.05, 0.4)), float(rng.uniform(0.1, 0.8))
            c = TypicalVerifier(teps, delta, greedy).verify(x, None, target, state, gen_chain, sample_probs)
            tt = tree_typical(x, parents, target, state, TypicalVerifier(teps, delta, greedy), gen_tree, sample_probs)
            assert (tt.path, tt.next_token, tt.state) == (list(range(c.n_accepted)), c.next_token, c.state)
            assert torch.equal(gen_chain.get_state(), gen_tree.get_state())
    assert len(set(lengths)) >= 4  # the cases do cover partial and full acceptance


def test_chain_equivalence_sample_same_seed():
    # tree_sample draws uniform(N) then one sample_from, exactly as SampleVerifier: same seed -> same
    # verdict and the same generator state afterwards (exact equality, not a distributional test).
    rng = np.random.default_rng(1)
    outcomes = set()
    for trial in range(400):
        k = int(rng.integers(0, 5))
        _, draft, target = random_chain_case(rng, k, conc=1.0)
        x = torch.multinomial(draft, 1).view(k) if k else torch.zeros(0, dtype=torch.long)
        gen_chain, gen_tree = torch.Generator().manual_seed(trial), torch.Generator().manual_seed(trial)
        s = SampleVerifier().verify(x, draft, target, generator=gen_chain)
        for replacement in (False, True):  # one child per node: both rules coincide
            gen_tree.manual_seed(trial)
            t = tree_sample(x, chain_as_tree(k), draft, target, gen_tree, replacement=replacement)
            assert (t.path, t.next_token) == (list(range(s.n_accepted)), s.next_token)
            assert torch.equal(gen_chain.get_state(), gen_tree.get_state())
        outcomes.add((k, s.n_accepted))
    assert len(outcomes) >= 10


# ------------------------------------------------------------------------------- greedy on trees


def one_hot_rows(argmaxes, v=6):
    """Target rows whose argmax is ``argmaxes[r]`` (0.5 on it, the rest spread evenly)."""
    rows = torch.full((len(argmaxes), v), 0.5 / (v - 1))
    rows[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 0.5
    return rows


def test_tree_greedy_second_sibling_matches():
    #            root (argmax 3)
    #        /        |         \
    #    n0: 1      n1: 3      n2: 2
    #    |          /    \
    #    n3: 0   n4: 2   n5: 4 (argmax after n1 is 4)
    #                     |
    #                    n6: 5 (argmax after n5 is 5) -> bonus: argmax after n6 = 1
    parents = [-1, -1, -1, 0, 1, 1, 5]
    tokens = torch.tensor([1, 3, 2, 0, 2, 4, 5])
    # rows: root, n0..n6
    target = one_hot_rows([3, 0, 4, 0, 0, 0, 5, 1])
    v = tree_greedy(tokens, parents, target)
    assert v == Verdict(path=[1, 5, 6], next_token=1, state=None)
    assert v.n_accepted == 3
    # The leaf n6 no longer matches: stop after n5, next token = argmax after n5.
    v = tree_greedy(torch.tensor([1, 3, 2, 0, 2, 4, 0]), parents, target)
    assert (v.path, v.next_token) == ([1, 5], 5)
    # No root child matches: nothing accepted, next = argmax of row 0.
    v = tree_greedy(torch.tensor([1, 0, 2, 0, 2, 4, 5]), parents, target, state="s")
    assert (v.path, v.next_token, v.state) == ([], 3, "s")


def test_tree_greedy_longest_match_among_duplicates():
    # Siblings drafted with replacement can repeat a token: both n0 and n1 are token 3 (the argmax);
    # only n1's subtree continues the greedy path, and it is the longest match.
    parents = [-1, -1, 0, 1, 3]
    tokens = torch.tensor([3, 3, 1, 2, 4])
    target = one_hot_rows([3, 0, 2, 0, 4, 0])  # after n0: 0 (n2 = 1 fails); after n1: 2 (n3 ok)
    v = tree_greedy(tokens, parents, target)
    assert (v.path, v.next_token) == ([1, 3, 4], 0)
    # Equal-depth matches spell the same tokens: the first in node order is kept.
    v = tree_greedy(torch.tensor([3, 3]), [-1, -1], one_hot_rows([3, 1, 1]))
    assert (v.path, v.next_token) == ([0], 1)


def test_tree_greedy_empty_tree():
    v = tree_greedy(torch.zeros(0, dtype=torch.long), [], one_hot_rows([2]))
    assert (v.path, v.next_token) == ([], 2)


# ------------------------------------------------------------------------------ consultant on trees


def row(values, v=6):
    """A target row with the given leading probabilities, the rest spread evenly over the tail."""
    values = list(values)
    rest = (1.0 - sum(values)) / (v - len(values))
    return values + [rest] * (v - len(values))


def test_tree_consultant_two_branches_hand_computed():
    # Two branches from the root:
    #   A: n0 (p 0.6) -> n2 (p 0.5) -> n4 (p 0.01)
    #   B: n1 (p 0.3) -> n3 (p 0.4) -> n5 (p 0.2)
    # V = 8; eps = 1.5, beta = 0.5, carried state r0 = 1.0.
    eps, beta, r0 = 1.5, 0.5, 1.0
    parents = [-1, -1, 0, 1, 2, 3]
    tokens = torch.tensor([0, 1, 2, 3, 4, 5])
    target = torch.tensor(
        [
            row([0.6, 0.3], v=8),  # root: n0 = 0 (0.6), n1 = 1 (0.3)
            row([0.0, 0.0, 0.5], v=8),  # after n0: n2 = 2 (0.5)
            row([0.0, 0.0, 0.0, 0.4], v=8),  # after n1: n3 = 3 (0.4)
            row([0.0, 0.0, 0.0, 0.0, 0.01], v=8),  # after n2: n4 = 4 (0.01)
            row([0.0, 0.0, 0.0, 0.0, 0.0, 0.2], v=8),  # after n3: n5 = 5 (0.2)
            row([0.7], v=8),  # after n4
            [0.1, 0.05, 0.05, 0.6, 0.1, 0.05, 0.025, 0.025],  # after n5: argmax 3 (0.6)
        ],
        dtype=torch.float64,
    )
    ema = lambda r, p: beta * r + (1 - beta) * -math.log(p)  # noqa: E731
    # Branch A: r(n0) = 0.5 + 0.5*0.511 = 0.755; r(n2) = 0.378 + 0.347 = 0.724; r(n4) = 0.362 + 2.303 > eps.
    r_a = [ema(r0, 0.6)]
    r_a.append(ema(r_a[-1], 0.5))
    assert ema(r_a[-1], 0.01) > eps
    # Branch B: r(n1) = 0.5 + 0.602 = 1.102; r(n3) = 0.551 + 0.458 = 1.009; r(n5) = 0.505 + 0.805 = 1.309.
    r_b = [ema(r0, 0.3)]
    r_b.append(ema(r_b[-1], 0.4))
    r_b.append(ema(r_b[-1], 0.2))
    assert max(r_b) <= eps
    v = consultant_tree(tokens, parents, target, state=r0, eps=eps, beta=beta)
    # B passes to depth 3, A only to depth 2: the longer passing branch wins although A is likelier.
    assert v.path == [1, 3, 5] and v.next_token == 3
    assert v.state == pytest.approx(ema(r_b[-1], 0.6), abs=1e-12)
    # A larger carried state: B's n1 now fails (0.5 * 3 + 0.602 > 1.5), A passes n0 and n2 -> path A.
    r0_big = 2.0
    assert ema(r0_big, 0.3) > eps and ema(ema(ema(r0_big, 0.6), 0.5), 0.01) > eps
    v = consultant_tree(tokens, parents, target, state=r0_big, eps=eps, beta=beta)
    r = ema(ema(r0_big, 0.6), 0.5)
    assert v.path == [0, 2] and v.next_token == 5  # row 3 (after n2): tail 0.33 on 5, 6, 7, first argmax 5
    assert v.state == pytest.approx(ema(r, 0.99 / 3), abs=1e-12)


def test_tree_consultant_tie_goes_to_likelier_path_and_nothing_passes():
    # Two depth-1 siblings both pass; the second has the higher p_target: it wins the tie.
    target = torch.tensor([row([0.3, 0.5]), row([0.9]), row([0.0, 0.8])], dtype=torch.float64)
    v = consultant_tree(torch.tensor([0, 1]), [-1, -1], target)
    assert v.path == [1] and v.next_token == 1
    assert v.state == pytest.approx(0.2 * (0.8 * -math.log(0.5)) + 0.8 * -math.log(0.8), abs=1e-12)
    # Exact tie (same token twice, with replacement): the first in node order.
    target = torch.tensor([row([0.5]), row([0.9]), row([0.0, 0.8])], dtype=torch.float64)
    assert consultant_tree(torch.tensor([0, 0]), [-1, -1], target).path == [0]
    # Nothing passes: the target's own token at row 0, state from r0.
    target = torch.tensor([row([0.01, 0.02, 0.9]), row([0.9]), row([0.9])], dtype=torch.float64)
    v = consultant_tree(torch.tensor([0, 1]), [-1, -1], target, state=0.5)
    assert (v.path, v.next_token) == ([], 2)
    assert v.state == pytest.approx(0.2 * 0.5 + 0.8 * -math.log(0.9), abs=1e-12)


def test_tree_consultant_sampling_next_token_from_sample_probs():
    target = torch.tensor([row([0.6, 0.3]), row([0.2, 0.3, 0.1]), row([0.9])], dtype=torch.float64)
    forced = torch.zeros(3, 6)
    forced[1, 2] = 1.0  # after n0 the sampler can only give token 2
    gen = torch.Generator().manual_seed(0)
    v = consultant_tree(torch.tensor([0, 1]), [-1, -1], target, greedy=False, generator=gen, sample_probs=forced)
    assert (v.path, v.next_token) == ([0], 2)
    r = 0.8 * -math.log(0.6)
    assert v.state == pytest.approx(0.2 * r + 0.8 * -math.log(0.1), abs=1e-12)  # NLL from target_probs


# --------------------------------------------------------------------------------- typical on trees


def test_tree_typical_hand_made_tree():
    eps, delta = 0.09, 0.3
    uniform100 = torch.full((100,), 0.01)  # threshold 0.3 * e^-log 100 = 0.003
    peaked = torch.tensor([0.97] + [0.01] * 3 + [0.0] * 96)  # threshold eps = 0.09
    flat4 = torch.tensor([0.25] * 4 + [0.0] * 96)  # threshold 0.3 * e^-log 4 = 0.075
    #   root (uniform100): n0 = 7 (0.01 > 0.003 ok), n1 = 8 (ok)
    #   n0 -> n2 = 1 (peaked row: 0.01 <= 0.09, fails) -> n4 = 0
    #   n1 -> n3 = 2 (flat4: 0.25 ok) -> n5 = 0 (peaked: 0.97 ok)
    parents = [-1, -1, 0, 1, 2, 3]
    tokens = torch.tensor([7, 8, 1, 2, 0, 0])
    # rows: root, after n0, after n1, after n2, after n3, after n4, after n5
    target = torch.stack([uniform100, peaked, flat4, peaked, peaked, flat4, flat4])
    v = typical_tree(tokens, parents, target, eps=eps, delta=delta)
    assert (v.path, v.next_token) == ([1, 3, 5], 0)
    # n5 = 50 (p 0 on the peaked row) fails: depth 2 on branch B only.
    v = typical_tree(torch.tensor([7, 8, 1, 2, 0, 50]), parents, target, eps=eps, delta=delta)
    assert (v.path, v.next_token) == ([1, 3], 0)
    # Both depth-1 siblings pass on an equal footing; with n2 now passing (token 0 on the peaked row),
    # depth 3 is reached on both branches: the likelier path wins (A: 0.01*0.97*0.97 vs B: 0.01*0.25*0.97).
    v = typical_tree(torch.tensor([7, 8, 0, 2, 0, 0]), parents, target, eps=eps, delta=delta)
    assert v.path == [0, 2, 4]
    # greedy=False: the next token is drawn from sample_probs at the row after the path.
    forced = torch.zeros(7, 100)
    forced[4, 3] = 1.0
    v = typical_tree(torch.tensor([7, 8, 1, 2, 0, 50]), parents, target, eps=eps, delta=delta, greedy=False,
                     generator=torch.Generator().manual_seed(0), sample_probs=forced)
    assert (v.path, v.next_token) == ([1, 3], 3)


# ------------------------------------------------------------------- lossless multi-candidate sampling

# Tree for the losslessness tests: three siblings at depth 1, children below.
#        root
#     /   |   \
#    n0   n1   n2
#   / \   |    |
#  n3 n4  n5   n6
LOSSLESS_PARENTS = [-1, -1, -1, 0, 0, 1, 2]


class ToyModels:
    """A context-dependent toy target and draft over V tokens, two positions deep.

    Position 1: p_target = target0, p_draft = draft0. Position 2 after first token a:
    target_cond[a], draft_cond[a]. Position 3 (only a bonus row here): target_third."""

    def __init__(self, seed: int):
        rng = np.random.default_rng(seed)
        self.target0 = dirichlet(rng, V)[0]
        self.draft0 = dirichlet(rng, V, conc=0.7)[0]
        self.target_cond = dirichlet(rng, V, rows=V)
        self.draft_cond = dirichlet(rng, V, rows=V, conc=0.7)
        self.target_third = dirichlet(rng, V)[0]

    def joint(self) -> np.ndarray:
        return (self.target0[:, None] * self.target_cond).double().numpy()


def draw_siblings(rows: torch.Tensor, m: int, replacement: bool, gen: torch.Generator) -> torch.Tensor:
    """m siblings per row of ``rows`` [n, V], by the stated scheme: [n, m]."""
    return torch.multinomial(rows, m, replacement=replacement, generator=gen)


def draft_trees(models: ToyModels, n: int, replacement: bool, seed: int):
    """n draft trees (LOSSLESS_PARENTS) drafted by the scheme, with their p_draft / p_target rows."""
    gen = torch.Generator().manual_seed(seed)
    top = draw_siblings(models.draft0.expand(n, V), 3, replacement, gen)  # n0, n1, n2
    below0 = draw_siblings(models.draft_cond[top[:, 0]], 2, replacement, gen)  # n3, n4
    below1 = draw_siblings(models.draft_cond[top[:, 1]], 1, replacement, gen)  # n5
    below2 = draw_siblings(models.draft_cond[top[:, 2]], 1, replacement, gen)  # n6
    tokens = torch.cat([top, below0, below1, below2], dim=1)  # [n, 7]
    draft = torch.empty(n, 7, V)
    draft[:, 0:3] = models.draft0
    draft[:, 3:5] = models.draft_cond[top[:, 0]].unsqueeze(1)
    draft[:, 5] = models.draft_cond[top[:, 1]]
    draft[:, 6] = models.draft_cond[top[:, 2]]
    target = torch.empty(n, 8, V)
    target[:, 0] = models.target0
    target[:, 1:4] = models.target_cond[top]
    target[:, 4:8] = models.target_third
    return tokens, draft, target


def sample_first_two(models: ToyModels, replacement: bool, n: int, seed: int, verify_replacement=None):
    """Counts [V, V] of the first two output tokens over n rounds. A round that accepts nothing emits
    one token; the second then comes from a fresh round: three siblings drafted from
    draft_cond[first] by the same scheme, verified against target_cond[first]."""
    verify_replacement = replacement if verify_replacement is None else verify_replacement
    tokens, draft, target = draft_trees(models, n, replacement, seed)
    gen_draft2 = torch.Generator().manual_seed(seed + 1)
    second_round = [draw_siblings(models.draft_cond[a].expand(n, V), 3, replacement, gen_draft2) for a in range(V)]
    draft2 = [models.draft_cond[a].expand(3, V) for a in range(V)]
    target2 = [torch.stack([models.target_cond[a]] + [models.target_third] * 3) for a in range(V)]
    gen = torch.Generator().manual_seed(seed + 2)
    counts = np.zeros((V, V), dtype=np.int64)
    for j in range(n):
        x = tokens[j]
        verdict = tree_sample(x, LOSSLESS_PARENTS, draft[j], target[j], gen, replacement=verify_replacement)
        out = [int(x[c]) for c in verdict.path] + [verdict.next_token]
        if len(out) < 2:
            first = out[0]
            x2 = second_round[first][j]
            v2 = tree_sample(x2, [-1, -1, -1], draft2[first], target2[first], gen, replacement=verify_replacement)
            out.append(int(x2[v2.path[0]]) if v2.path else v2.next_token)
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("replacement", [False, True], ids=["without_replacement", "with_replacement"])
def test_tree_sample_lossless_first_and_joint(replacement):
    models = ToyModels(seed=3)
    counts = sample_first_two(models, replacement, N_TRIALS, seed=10 + replacement)
    assert chisq_pvalue(counts.sum(axis=1), models.target0.numpy()) > ALPHA
    assert chisq_pvalue(counts, models.joint()) > ALPHA


def no_residual_update(target_row, draft_row):
    """Negative control's stand-in for residual_distribution: the target row is never updated, so
    every sibling is judged against the untouched p_target (each as if it were a lone single-step
    draft) and the correction is drawn from p_target."""
    target = target_row.to(torch.float64)
    return target / target.sum()


def first_token_counts(models, draft_replacement, verify_replacement, n, seed):
    tokens, draft, target = draft_trees(models, n, draft_replacement, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    first = np.empty(n, dtype=np.int64)
    for j in range(n):
        verdict = tree_sample(tokens[j], LOSSLESS_PARENTS, draft[j], target[j], gen, replacement=verify_replacement)
        first[j] = int(tokens[j, verdict.path[0]]) if verdict.path else verdict.next_token
    return np.bincount(first, minlength=V)


@pytest.mark.parametrize("replacement", [False, True], ids=["without_replacement", "with_replacement"])
def test_negative_control_no_residual_update_is_detected(replacement, monkeypatch):
    models = ToyModels(seed=3)  # same models, same trial count as the lossless test
    monkeypatch.setattr(tree_module, "residual_distribution", no_residual_update)
    counts = first_token_counts(models, replacement, replacement, N_TRIALS, seed=20)
    assert chisq_pvalue(counts, models.target0.numpy()) < CONTROL_ALPHA


@pytest.mark.parametrize("draft_replacement", [False, True], ids=["drafted_without", "drafted_with"])
def test_negative_control_scheme_mismatch_is_detected(draft_replacement):
    # Drafting by one scheme and verifying with the other rule is biased: D_j is then not the
    # distribution sibling j was drawn from (the proof's one requirement).
    models = ToyModels(seed=3)
    counts = first_token_counts(models, draft_replacement, not draft_replacement, N_TRIALS, seed=30)
    assert chisq_pvalue(counts, models.target0.numpy()) < CONTROL_ALPHA


# ------------------------------------------- siblings from different drafters (heads + prompt lookup)

# A drawn chain (n0 ~ p_draft, n2 ~ p_draft given n0) merged with a lookup guess from the root
# (n1 = LOOKUP[0], then n3 = LOOKUP[1]), one-hot rows: drafters/with_lookup.py when sampling.
MERGED_PARENTS = [-1, -1, 0, 1]
LOOKUP = (1, 3)


def merged_first_two(models: ToyModels, n: int, seed: int, lookup_row=None):
    """Counts [V, V] of the first two output tokens over n rounds of the merged tree, verified with
    ``replacement=True`` (each sibling against its own row). ``lookup_row``: the row the lookup guess
    claims (None: its true one-hot row). A round that emits one token is followed by a fresh round of
    the same kind one position later (a drawn token and the lookup guess LOOKUP[1] as siblings)."""
    gen_draft = torch.Generator().manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    one_hot = torch.eye(V)
    first_row = one_hot[LOOKUP[0]] if lookup_row is None else lookup_row
    counts = np.zeros((V, V), dtype=np.int64)
    for _ in range(n):
        x0 = int(torch.multinomial(models.draft0, 1, generator=gen_draft))
        x2 = int(torch.multinomial(models.draft_cond[x0], 1, generator=gen_draft))
        tokens = torch.tensor([x0, LOOKUP[0], x2, LOOKUP[1]])
        draft = torch.stack([models.draft0, first_row, models.draft_cond[x0], one_hot[LOOKUP[1]]])
        target = torch.stack([models.target0, models.target_cond[x0], models.target_cond[LOOKUP[0]],
                              models.target_third, models.target_third])
        verdict = tree_sample(tokens, MERGED_PARENTS, draft, target, gen, replacement=True)
        out = [int(tokens[c]) for c in verdict.path] + [verdict.next_token]
        if len(out) < 2:
            a = out[0]
            y = int(torch.multinomial(models.draft_cond[a], 1, generator=gen_draft))
            v2 = tree_sample(torch.tensor([y, LOOKUP[1]]), [-1, -1],
                             torch.stack([models.draft_cond[a], one_hot[LOOKUP[1]]]),
                             torch.stack([models.target_cond[a], models.target_third, models.target_third]),
                             gen, replacement=True)
            out.append(int([y, LOOKUP[1]][v2.path[0]]) if v2.path else v2.next_token)
        counts[out[0], out[1]] += 1
    return counts


def test_tree_sample_siblings_from_different_drafters_is_lossless():
    """SpecInfer's MSS with each sibling judged against the row it was drawn from: a drawn sibling and
    a one-hot lookup guess side by side give exactly p_target, first token and first two jointly."""
    models = ToyModels(seed=3)
    counts = merged_first_two(models, N_TRIALS, seed=40)
    assert chisq_pvalue(counts.sum(axis=1), models.target0.numpy()) > ALPHA
    assert chisq_pvalue(counts, models.joint()) > ALPHA


def test_negative_control_lookup_judged_with_the_drawn_siblings_row():
    """Judging the lookup guess against the drawn sibling's p_draft row (the single shared row of the
    i.i.d. rule) instead of its own one-hot row over-accepts it: detected."""
    models = ToyModels(seed=3)
    counts = merged_first_two(models, N_TRIALS, seed=50, lookup_row=models.draft0)
    assert chisq_pvalue(counts.sum(axis=1), models.target0.numpy()) < CONTROL_ALPHA
