"""Tests of the verification rules: exact values on crafted inputs and distributional tests.

Statistical tests use a fixed significance level ALPHA = 1e-3 per assertion: a correct verifier fails
one with probability 1e-3 (all generators are seeded, so a given run is deterministic anyway), and
every distributional test is paired with a wrong variant that must fail it (the negative control),
so the tests have power. Vocabularies are small (V = 3..8) so 20k verify calls take a couple of
seconds. Naming: p_target / p_draft (target_probs / draft_probs), never a bare p or q.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from speculate.verifiers import (
    VERIFIERS,
    Verdict,
    get_verifier,
    mentored_output_distribution,
)
from speculate.verifiers.consultant import ConsultantVerifier
from speculate.verifiers.greedy import GreedyVerifier
from speculate.verifiers.mentored import MentoredVerifier
from speculate.verifiers.base import sample_from as draw
from speculate.verifiers.sample import SampleVerifier, residual_distribution
from speculate.verifiers.typical import TypicalVerifier

ALPHA = 1e-3  # significance level of every statistical assertion
N = 20_000  # verify calls per distributional test


# ----------------------------------------------------------------------------------------- helpers


def dirichlet(rng: np.random.Generator, v: int, rows: int = 1, conc: float = 1.0) -> torch.Tensor:
    return torch.tensor(rng.dirichlet(np.full(v, conc), size=rows), dtype=torch.float32)


def chisq_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit of ``counts`` to ``probs``. Cells with expected count below
    ``min_expected`` are pooled (so the chi-square approximation holds); cells of probability 0 must
    be empty, which is asserted here (an exact check, not a statistical one)."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    zero = probs <= 0
    assert counts[zero].sum() == 0, f"tokens of probability 0 were output: {counts[zero]}"
    counts, probs = counts[~zero], probs[~zero]
    n = counts.sum()
    expected = probs * n
    small = expected < min_expected
    if small.any():
        obs = np.append(counts[~small], counts[small].sum())
        exp = np.append(expected[~small], expected[small].sum())
    else:
        obs, exp = counts, expected
    if exp[-1] < min_expected and len(exp) > 2:  # the pooled cell is still thin: merge it on
        i = int(np.argmin(exp[:-1]))
        obs[i] += obs[-1]
        exp[i] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def binom_pvalue(successes: int, n: int, p: float) -> float:
    return float(stats.binomtest(int(successes), int(n), float(p)).pvalue)


def first_output_tokens(verifier, draft_probs, target_probs, n_runs, seed):
    """Run ``n_runs`` rounds with drafts x_i ~ p_draft row i; return (first output token, n_accepted)
    arrays. The first output token is x_1 if accepted, else the correction token."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(draft_probs, n_runs, replacement=True, generator=gen).T.contiguous()  # [n, k]
    first = np.empty(n_runs, dtype=np.int64)
    accepted = np.empty(n_runs, dtype=np.int64)
    for j in range(n_runs):
        v = verifier.verify(drafts[j], draft_probs, target_probs, generator=gen)
        accepted[j] = v.n_accepted
        first[j] = int(drafts[j, 0]) if v.n_accepted >= 1 else v.next_token
    return first, accepted


class WrongSampleVerifier(SampleVerifier):
    """Negative control: on rejection resample from p_target instead of the residual. Not lossless:
    the output is sum_x min(p_draft, p_target) mass from the drafts plus (1 - alpha) p_target."""

    def correction_distribution(self, target_row, draft_row):
        return target_row.double() / target_row.double().sum()


# ------------------------------------------------------------------------------------------ greedy


def test_greedy_all_accepted_takes_bonus_argmax():
    target = torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    v = GreedyVerifier().verify(torch.tensor([1, 0]), None, target)
    assert (v.n_accepted, v.next_token) == (2, 2)


def test_greedy_first_mismatch():
    target = torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.5, 0.4, 0.1]])
    v = GreedyVerifier().verify(torch.tensor([1, 2, 2]), None, target)  # row 1's argmax is 0
    assert (v.n_accepted, v.next_token) == (1, 0)
    v = GreedyVerifier().verify(torch.tensor([0, 0, 2]), None, target)
    assert (v.n_accepted, v.next_token) == (0, 1)


def test_greedy_k1():
    target = torch.tensor([[0.1, 0.7, 0.2], [0.6, 0.3, 0.1]])
    assert GreedyVerifier().verify(torch.tensor([1]), None, target) == Verdict(1, 0, None)
    assert GreedyVerifier().verify(torch.tensor([2]), None, target) == Verdict(0, 1, None)



def test_greedy_argmax_is_torchs_rule_on_ties_nans_infinities_and_views():
    """sampling.argmax (numpy's, for float32 on the CPU) must give torch.argmax's index on every row: the first of
    tied maxima, a NaN as the greatest (its first index), rows of -inf, ±0; views and one row; other dtypes through
    torch. Greedy decoding's tokens are these indices."""
    from speculate.sampling import argmax

    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 4, (64, 1000), generator=g).float()  # many exact ties, anywhere in the row
    x[1] = float("-inf")
    x[2, 7], x[2, 900] = float("nan"), float("nan")
    x[3, :] = 0.0
    x[3, 10], x[3, 20] = -0.0, 0.0
    x[4, 5], x[4, 6] = float("inf"), float("inf")
    x[5, -1] = 100.0  # the last index
    x[6] = torch.linspace(1.0, -1.0, 1000)  # the first index
    for rows in (x, x[:, ::3], x.t().contiguous().t(), x[7], x[:1], torch.randn(5, 49152, generator=g)):
        assert torch.equal(argmax(rows), rows.argmax(-1))
    assert argmax(x)[:7].tolist() == [int(x[0].argmax()), 0, 7, 0, 5, 999, 0]
    assert torch.equal(argmax(x.bfloat16()), x.bfloat16().argmax(-1))
    assert argmax(x[0]).dim() == 0 and int(argmax(x[0])) == int(x[0].argmax())

# ------------------------------------------------------------------------------------------- draw


def test_draw_matches_distribution_and_skips_zeros():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = np.bincount([draw(probs * 7.0, gen) for _ in range(N)], minlength=6)  # unnormalised
    assert chisq_pvalue(counts, probs.numpy()) > ALPHA
    with pytest.raises(ValueError):
        draw(torch.zeros(4), gen)


# --------------------------------------------------------------------------- speculative sampling


def test_lesson_exercise_1_values():
    # Lesson: target (0.6, 0.1, 0.3), draft (0.5, 0.3, 0.2).
    target = torch.tensor([0.6, 0.1, 0.3])
    draft = torch.tensor([0.5, 0.3, 0.2])
    acceptance = float(torch.minimum(target, draft).sum())
    assert acceptance == pytest.approx(0.8)  # 0.5 + 0.1 + 0.2
    # max(0, p_target - p_draft) = (0.1, 0, 0.1): mass 0.2 = 1 - acceptance, normalised (0.5, 0, 0.5).
    residual = residual_distribution(target, draft)
    assert residual.tolist() == pytest.approx([0.5, 0.0, 0.5])
    assert float(residual.sum()) == pytest.approx(1.0)


def test_lesson_exercise_1_empirical():
    target = torch.tensor([[0.6, 0.1, 0.3], [1 / 3, 1 / 3, 1 / 3]])
    draft = torch.tensor([[0.5, 0.3, 0.2]])
    first, accepted = first_output_tokens(SampleVerifier(), draft, target, N, seed=1)
    emp = np.bincount(first, minlength=3) / N
    assert np.allclose(emp, [0.6, 0.1, 0.3], atol=0.015)
    assert chisq_pvalue(np.bincount(first, minlength=3), target[0].numpy()) > ALPHA
    assert binom_pvalue((accepted >= 1).sum(), N, 0.8) > ALPHA


# Several random (p_draft, p_target) pairs; k = 1, 2, 4 with a different p_draft row per position.
FIRST_TOKEN_CASES = [(11, 1), (12, 1), (13, 2), (14, 4)]


def random_rows(seed, k, v=6):
    rng = np.random.default_rng(seed)
    return dirichlet(rng, v, rows=k), dirichlet(rng, v, rows=k + 1)


@pytest.mark.parametrize("seed,k", FIRST_TOKEN_CASES)
def test_sample_first_token_is_target_distributed(seed, k):
    draft, target = random_rows(seed, k)
    first, accepted = first_output_tokens(SampleVerifier(), draft, target, N, seed=seed)
    assert chisq_pvalue(np.bincount(first, minlength=6), target[0].numpy()) > ALPHA
    # acceptance rate of position 1 = sum_x min(p_draft, p_target) (row 0)
    acceptance = float(torch.minimum(draft[0], target[0]).sum())
    assert binom_pvalue((accepted >= 1).sum(), N, acceptance) > ALPHA
    assert accepted.max() <= k


@pytest.mark.parametrize("seed,k", [FIRST_TOKEN_CASES[0], FIRST_TOKEN_CASES[3]])
def test_negative_control_resampling_from_target_is_detected(seed, k):
    # Same inputs, same N, same test as above: the wrong variant must fail it.
    draft, target = random_rows(seed, k)
    first, accepted = first_output_tokens(WrongSampleVerifier(), draft, target, N, seed=seed)
    assert chisq_pvalue(np.bincount(first, minlength=6), target[0].numpy()) < ALPHA
    # (its acceptance test is the correct one: only the correction distribution is wrong)
    assert binom_pvalue((accepted >= 1).sum(), N, float(torch.minimum(draft[0], target[0]).sum())) > ALPHA


def joint_counts(verifier, draft_rows, target_rows, k, seed, n_runs=N):
    """A minimal engine over a context-free model: p_target / p_draft at output position s are the
    fixed rows target_rows[s] / draft_rows[s]. Each run does rounds until two tokens are out and
    counts the pair (first, second). A round starting at position s drafts x_j ~ draft_rows[s + j]."""
    gen = torch.Generator().manual_seed(seed)
    v = target_rows.shape[1]
    # Drafts for rounds starting at position 0 and 1, drawn in bulk: [n_runs, k] each.
    drafts = [torch.multinomial(draft_rows[s : s + k], n_runs, replacement=True, generator=gen).T.contiguous() for s in (0, 1)]
    counts = np.zeros((v, v), dtype=np.int64)
    for j in range(n_runs):
        out: list[int] = []
        while len(out) < 2:
            s = len(out)
            x = drafts[s][j]
            verdict = verifier.verify(x, draft_rows[s : s + k], target_rows[s : s + k + 1], generator=gen)
            out.extend(x[: verdict.n_accepted].tolist())
            out.append(verdict.next_token)
        counts[out[0], out[1]] += 1
    return counts


def joint_case(k, v=5):
    rng = np.random.default_rng(100 + k)
    return dirichlet(rng, v, rows=k + 2), dirichlet(rng, v, rows=k + 3)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_sample_joint_of_first_two_tokens(k):
    draft_rows, target_rows = joint_case(k)
    counts = joint_counts(SampleVerifier(), draft_rows, target_rows, k, seed=k)
    expected = np.outer(target_rows[0].numpy(), target_rows[1].numpy())
    assert chisq_pvalue(counts, expected) > ALPHA


class OffByOneBonusVerifier(SampleVerifier):
    """Negative control: the bonus token is drawn from p_target row k-1 instead of row k. Every
    first output token is still exactly p_target row 0 distributed; only the joint test can see it."""

    def verify(self, draft_tokens, draft_probs, target_probs, state=None, generator=None, sample_probs=None):
        k = draft_tokens.shape[0]
        shifted = target_probs.clone()
        shifted[k] = target_probs[k - 1]
        return super().verify(draft_tokens, draft_probs, shifted, state, generator, sample_probs)


def test_negative_control_off_by_one_bonus_passes_first_token_test():
    draft_rows, target_rows = joint_case(1)
    first, _ = first_output_tokens(OffByOneBonusVerifier(), draft_rows[:1], target_rows[:2], N // 4, seed=5)
    assert chisq_pvalue(np.bincount(first, minlength=5), target_rows[0].numpy()) > ALPHA


@pytest.mark.parametrize("wrong,k", [(WrongSampleVerifier, 2), (OffByOneBonusVerifier, 1)])
def test_negative_control_joint(wrong, k):
    draft_rows, target_rows = joint_case(k)
    counts = joint_counts(wrong(), draft_rows, target_rows, k, seed=k, n_runs=N // 4)
    expected = np.outer(target_rows[0].numpy(), target_rows[1].numpy())
    assert chisq_pvalue(counts, expected) < ALPHA


def test_sample_one_hot_draft():
    # p_draft one-hot on token 2: the draft is always 2, accepted with probability p_target(2).
    target = torch.tensor([[0.3, 0.1, 0.4, 0.2], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    first, accepted = first_output_tokens(SampleVerifier(), draft, target, N, seed=3)
    assert chisq_pvalue(np.bincount(first, minlength=4), target[0].numpy()) > ALPHA
    assert binom_pvalue((accepted >= 1).sum(), N, 0.4) > ALPHA


def test_sample_draft_equals_target_accepts_everything():
    rng = np.random.default_rng(5)
    k, v = 4, 6
    target = dirichlet(rng, v, rows=k + 1)
    draft = target[:k].clone()
    gen = torch.Generator().manual_seed(5)
    bonus = []
    for _ in range(2000):
        x = torch.multinomial(draft, 1, generator=gen).view(-1)
        verdict = SampleVerifier().verify(x, draft, target, generator=gen)
        assert verdict.n_accepted == k
        bonus.append(verdict.next_token)
    assert chisq_pvalue(np.bincount(bonus, minlength=v), target[k].numpy()) > ALPHA
    # A residual of zero mass (p_draft == p_target) falls back to the p_target row, no NaN.
    res = residual_distribution(target[0], draft[0])
    assert torch.isfinite(res).all() and torch.allclose(res, target[0].double() / target[0].double().sum())


def test_sample_drafted_token_with_zero_draft_probability():
    draft = torch.tensor([[0.0, 0.5, 0.5, 0.0]])
    gen = torch.Generator().manual_seed(7)
    # p_target(0) > 0: always accepted (u * 0 < p_target(0)).
    target = torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25]])
    for _ in range(500):
        assert SampleVerifier().verify(torch.tensor([0]), draft, target, generator=gen).n_accepted == 1
    # p_target(0) = 0 too: always rejected; p_target - p_draft = (0, -0.2, -0.3, 0.5), so the
    # residual is (0, 0, 0, 1) and the correction is token 3.
    target = torch.tensor([[0.0, 0.3, 0.2, 0.5], [0.25, 0.25, 0.25, 0.25]])
    for _ in range(500):
        verdict = SampleVerifier().verify(torch.tensor([0]), draft, target, generator=gen)
        assert (verdict.n_accepted, verdict.next_token) == (0, 3)
    # p_draft == p_target with the impossible token drafted: residual empty, falls back to p_target.
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])
    outs = [SampleVerifier().verify(torch.tensor([0]), draft, target, generator=gen) for _ in range(2000)]
    assert all(o.n_accepted == 0 for o in outs)
    assert chisq_pvalue(np.bincount([o.next_token for o in outs], minlength=4), target[0].numpy()) > ALPHA


def test_sample_target_with_zeros():
    rng = np.random.default_rng(9)
    target = torch.tensor([[0.5, 0.0, 0.3, 0.0, 0.2, 0.0], [1 / 6] * 6])
    draft = dirichlet(rng, 6, rows=1)
    first, accepted = first_output_tokens(SampleVerifier(), draft, target, N, seed=9)
    assert chisq_pvalue(np.bincount(first, minlength=6), target[0].numpy()) > ALPHA  # zeros asserted empty
    assert binom_pvalue((accepted >= 1).sum(), N, float(torch.minimum(draft[0], target[0]).sum())) > ALPHA


def test_sample_needs_draft_probs():
    with pytest.raises(ValueError):
        SampleVerifier().verify(torch.tensor([0]), None, torch.full((2, 3), 1 / 3))


# -------------------------------------------------------------------------------------- consultant


def row(values, v=4):
    """A target row with the given leading probabilities, the rest spread evenly."""
    values = list(values)
    rest = (1.0 - sum(values)) / (v - len(values))
    return values + [rest] * (v - len(values))


def test_consultant_all_accepted_then_bonus_argmax_and_state():
    # p_target(x_1) = 0.5, p_target(x_2) = 0.4; bonus row argmax is token 3 with p = 0.7.
    target = torch.tensor(
        [[0.5, 0.2, 0.2, 0.1], [0.1, 0.4, 0.3, 0.2], [0.1, 0.1, 0.1, 0.7]], dtype=torch.float64
    )
    v = ConsultantVerifier(eps=2.0, beta=0.2).verify(torch.tensor([0, 1]), None, target)
    r1 = 0.2 * 0.0 + 0.8 * -math.log(0.5)  # 0.5545 <= 2: accept
    r2 = 0.2 * r1 + 0.8 * -math.log(0.4)  # 0.8439 <= 2: accept
    r3 = 0.2 * r2 + 0.8 * -math.log(0.7)  # bonus token's NLL enters the state
    assert (v.n_accepted, v.next_token) == (2, 3)
    assert v.state == pytest.approx(r3, abs=1e-12)
    assert v.state == pytest.approx(0.4541272, abs=1e-6)


def test_consultant_rejection_carries_r_of_accepted_prefix():
    target = torch.tensor(
        [[0.9, 0.05, 0.03, 0.02], [0.01, 0.6, 0.3, 0.09], [0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1]],
        dtype=torch.float64,
    )
    v = ConsultantVerifier(eps=2.0, beta=0.2).verify(torch.tensor([0, 0, 0]), None, target)
    r1 = 0.8 * -math.log(0.9)  # 0.0843: accept
    # 0.2 * r1 + 0.8 * -log(0.01) = 3.70 > 2: reject x_2; its NLL does not enter r.
    assert 0.2 * r1 + 0.8 * -math.log(0.01) > 2.0
    r_next = 0.2 * r1 + 0.8 * -math.log(0.6)  # the target's argmax at row 1 (token 1, p = 0.6)
    assert (v.n_accepted, v.next_token) == (1, 1)
    assert v.state == pytest.approx(r_next, abs=1e-12)


def test_consultant_state_carries_over_between_rounds():
    # A draft of NLL 2.2 (p = e^-2.2): fresh, r = 0.8 * 2.2 = 1.76 <= 2, accepted; after a round
    # that left r = 3.0, r = 0.2 * 3 + 1.76 = 2.36 > 2, rejected.
    p = math.exp(-2.2)
    target = torch.tensor([row([p, 0.6]), row([0.25, 0.25, 0.25])], dtype=torch.float64)
    x = torch.tensor([0])
    cd = ConsultantVerifier(eps=2.0, beta=0.2)
    assert cd.verify(x, None, target, state=None).n_accepted == 1
    assert cd.verify(x, None, target, state=3.0).n_accepted == 0

    # The same through two real rounds: round 1 rejects a p = 0.01 draft, the target's correction has
    # p = 0.02 under the raw target (sample_probs forces it), leaving r = 0.8 * -log(0.02) = 3.13.
    round1 = torch.tensor([row([0.01, 0.02, 0.9]), row([0.25, 0.25, 0.25])], dtype=torch.float64)
    forced = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    cd_sampling = ConsultantVerifier(eps=2.0, beta=0.2, greedy=False)
    v1 = cd_sampling.verify(x, None, round1, generator=torch.Generator().manual_seed(0), sample_probs=forced)
    assert (v1.n_accepted, v1.next_token) == (0, 1)
    assert v1.state == pytest.approx(0.8 * -math.log(0.02), abs=1e-12)
    v2 = cd.verify(x, None, target, state=v1.state)
    assert v2.n_accepted == 0  # rejected because of the carried r ...
    assert cd.verify(x, None, target, state=None).n_accepted == 1  # ... accepted from a fresh start

    # The other direction: a confident round 1 (p = 0.95 twice) leaves a small r, under which a
    # borderline draft (NLL 2.45; fresh r would be 1.96) is still accepted, while a round 1 that
    # ended on a doubtful token (r = 0.8 * -log 0.05 = 2.40) gets it rejected. Since every NLL >= 0,
    # r >= 0 = r_0: no carried state is more permissive than a fresh one (acceptance is monotone in r).
    borderline = torch.tensor([row([math.exp(-2.45), 0.5]), row([0.25, 0.25, 0.25])], dtype=torch.float64)
    confident = torch.tensor([row([0.95]), row([0.95]), row([0.95])], dtype=torch.float64)
    low = cd.verify(torch.tensor([0, 0]), None, confident).state
    assert low == pytest.approx(0.2 * (0.2 * 0.8 * 0.0513 + 0.8 * 0.0513) + 0.8 * 0.0513, abs=1e-3)
    assert cd.verify(x, None, borderline, state=low).n_accepted == 1
    assert cd.verify(x, None, borderline, state=0.8 * -math.log(0.05)).n_accepted == 0


def test_consultant_beta0_is_probability_threshold():
    # beta = 0: r_i = NLL(x_i), accept while p_target(x_i) >= e^-eps (section 3.4), whatever the state.
    rng = np.random.default_rng(21)
    checked_partial = 0
    for trial in range(300):
        k, v = 4, 8
        eps = float(rng.uniform(0.3, 3.0))
        target = dirichlet(rng, v, rows=k + 1, conc=0.5)
        x = torch.tensor(rng.integers(0, v, size=k))
        verdict = ConsultantVerifier(eps=eps, beta=0.0).verify(x, None, target, state=float(rng.uniform(0, 50)))
        ok = [float(target[i, x[i]]) > math.exp(-eps) for i in range(k)]
        expected = ok.index(False) if False in ok else k
        assert verdict.n_accepted == expected
        assert verdict.next_token == int(target[expected].argmax())
        assert verdict.state == pytest.approx(-math.log(float(target[expected].max())), rel=1e-6)
        checked_partial += 0 < expected < k
    assert checked_partial > 20  # the random cases do exercise mid-sequence rejections


def test_consultant_sampling_uses_sample_probs_and_target_nll():
    target = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]], dtype=torch.float64)
    one_hot = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]])
    cd = ConsultantVerifier(eps=2.0, beta=0.5, greedy=False)
    gen = torch.Generator().manual_seed(1)
    v = cd.verify(torch.tensor([0]), None, target, state=1.0, generator=gen, sample_probs=one_hot)
    # x_1: r = 0.5 * 1 + 0.5 * -log 0.1 = 1.651 <= 2: accepted; correction from sample_probs row 1.
    r1 = 0.5 * 1.0 + 0.5 * -math.log(0.1)
    assert (v.n_accepted, v.next_token) == (1, 2)
    assert v.state == pytest.approx(0.5 * r1 + 0.5 * -math.log(0.2), abs=1e-12)
    # greedy=True ignores sample_probs and takes the argmax.
    g = ConsultantVerifier(eps=2.0, beta=0.5).verify(torch.tensor([0]), None, target, state=1.0, sample_probs=one_hot)
    assert g.next_token == 0
    # Without sample_probs the correction is drawn from target_probs.
    # (state 10 makes r = 5 + 0.5 * NLL > 2: x_1 is rejected and the draw is from row 0.)
    outs = [cd.verify(torch.tensor([3]), None, target, state=10.0, generator=gen) for _ in range(N // 4)]
    assert all(o.n_accepted == 0 for o in outs)
    outs = [o.next_token for o in outs]
    assert chisq_pvalue(np.bincount(outs, minlength=4), target[0].numpy()) > ALPHA


def test_consultant_zero_probability_no_nan():
    target = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.7, 0.1, 0.1, 0.1]])
    v = ConsultantVerifier().verify(torch.tensor([0]), None, target)
    assert (v.n_accepted, v.next_token) == (0, 1)
    assert math.isfinite(v.state)
    v2 = ConsultantVerifier().verify(torch.tensor([1]), None, target, state=v.state)
    assert math.isfinite(v2.state) and not math.isnan(v2.state)


@pytest.mark.parametrize("params", [dict(eps=0.0), dict(eps=-1.0), dict(beta=1.0), dict(beta=-0.1), dict(beta=1.5)])
def test_consultant_bad_params(params):
    with pytest.raises(ValueError):
        ConsultantVerifier(**params)
    with pytest.raises(ValueError):
        get_verifier("consultant", **params)


# --------------------------------------------------------------------------------------- mentored


def kl(target, other):
    target, other = np.asarray(target, dtype=np.float64), np.asarray(other, dtype=np.float64)
    m = target > 0
    return float(np.sum(target[m] * np.log(target[m] / other[m])))


def far_pair(seed, v):
    rng = np.random.default_rng(seed)
    while True:
        target = rng.dirichlet(np.full(v, 0.5))
        draft = rng.dirichlet(np.full(v, 0.5))
        if kl(target, draft) > 1.0:
            return torch.tensor(target), torch.tensor(draft)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("D,tol", [(0.3, 0.2), (0.1, 0.05), (0.5, 0.0)])
def test_mentored_output_distribution_hits_kl_band(seed, D, tol):
    target, draft = far_pair(seed, 8)
    o, alpha, beta = mentored_output_distribution(target, draft, D, tol)
    o = o.numpy()
    assert 0.0 < alpha <= 1.0 <= beta
    assert (o >= 0).all() and o.sum() == pytest.approx(1.0, abs=1e-9)
    assert D * (1 - tol) - 1e-9 <= kl(target.numpy(), o) <= D * (1 + tol) + 1e-9
    # o is the clip form, and beta solves sum clip(...) = 1
    t, d = target.numpy(), draft.numpy()
    assert np.allclose(o, np.clip(d, t / beta, t / alpha), atol=1e-12)
    # o never puts mass where p_target has none and never exceeds p_target / alpha
    assert (o <= t / alpha + 1e-12).all()


def test_mentored_output_distribution_large_vocab_and_zeros():
    gen = torch.Generator().manual_seed(0)
    v = 50_000
    target = torch.softmax(torch.randn(v, generator=gen) * 3, 0)
    draft = torch.softmax(torch.randn(v, generator=gen) * 3, 0)
    draft[:100] = 0.0  # p_draft misses part of p_target's support: KL(p_target || p_draft) = inf
    target[100:200] = 0.0
    draft, target = draft / draft.sum(), target / target.sum()
    o, alpha, beta = mentored_output_distribution(target, draft, 0.3, 0.2)
    o = o.numpy()
    t = target.double().numpy() / target.double().sum().item()
    assert o.sum() == pytest.approx(1.0, abs=1e-9) and (o >= 0).all()
    assert 0.24 - 1e-9 <= kl(t, o) <= 0.36 + 1e-9
    assert (o[100:200] == 0).all()  # no mass where p_target = 0
    assert (o[:100] > 0).all()  # p_target's support is kept although p_draft misses it


@pytest.mark.parametrize("seed", range(4))
def test_mentored_trades_kl_for_acceptance(seed):
    # Acceptance sum_x min(p_draft, p_target/alpha) is never below lossless SD's sum_x min(p_draft,
    # p_target) and grows with the allowed KL D; a tiny D gives back (almost) p_target.
    target, draft = far_pair(seed, 8)
    sd_acceptance = float(torch.minimum(draft, target).sum())
    previous = sd_acceptance
    for D in (1e-4, 0.05, 0.2, 0.5):
        o, alpha, beta = mentored_output_distribution(target, draft, D, 0.1)
        acceptance = float(torch.minimum(draft, target / alpha).sum())
        assert acceptance >= previous - 1e-12
        previous = acceptance
        if D == 1e-4:
            assert float((o - target).abs().sum()) < 0.05
    assert previous > sd_acceptance + 0.05


def test_mentored_small_kl_accepts_everything():
    rng = np.random.default_rng(4)
    k, v = 3, 6
    target = dirichlet(rng, v, rows=k + 1)
    draft = 0.97 * target[:k] + 0.03 * dirichlet(rng, v, rows=k)
    D, tol = 0.3, 0.2
    for i in range(k):
        assert kl(target[i].numpy(), draft[i].numpy()) <= D * (1 + tol)
    o, alpha, beta = mentored_output_distribution(target[0], draft[0], D, tol)
    assert alpha == 0.0 and beta == math.inf
    assert torch.allclose(o, draft[0].double() / draft[0].double().sum())
    # Draft the tokens p_draft over-weights most, which plain SD rejects often: branch (b) keeps all.
    x = (draft - target[:k]).argmax(dim=1)
    gen = torch.Generator().manual_seed(4)
    sd_rejections = 0
    for _ in range(300):
        assert MentoredVerifier(D, tol).verify(x, draft, target, generator=gen).n_accepted == k
        sd_rejections += SampleVerifier().verify(x, draft, target, generator=gen).n_accepted < k
    assert sd_rejections > 0


@pytest.mark.parametrize("seed", [0, 3])
def test_mentored_empirical_output_matches_o(seed):
    target, draft = far_pair(seed, 6)
    D, tol = 0.2, 0.1
    o, alpha, beta = mentored_output_distribution(target, draft, D, tol)
    assert alpha > 0
    target_rows = torch.stack([target, torch.full((6,), 1 / 6, dtype=torch.float64)]).float()
    draft_rows = draft.unsqueeze(0).float()
    first, accepted = first_output_tokens(MentoredVerifier(D, tol), draft_rows, target_rows, N, seed=seed)
    counts = np.bincount(first, minlength=6)
    assert chisq_pvalue(counts, o.numpy()) > ALPHA
    acceptance = float(torch.minimum(draft, target / alpha).sum())
    assert binom_pvalue((accepted >= 1).sum(), N, acceptance) > ALPHA
    # and it is lossy as intended: the output is measurably not p_target
    assert chisq_pvalue(counts, target.numpy()) < ALPHA


@pytest.mark.parametrize("params", [dict(D=0.0), dict(D=-1.0), dict(tol=1.0), dict(tol=-0.1)])
def test_mentored_bad_params(params):
    with pytest.raises(ValueError):
        MentoredVerifier(**params)
    with pytest.raises(ValueError):
        mentored_output_distribution(torch.tensor([0.5, 0.5]), torch.tensor([0.9, 0.1]), params.get("D", 0.3), params.get("tol", 0.2))


# ---------------------------------------------------------------------------------------- typical


def entropy_threshold(row, eps, delta):
    p = np.asarray(row, dtype=np.float64)
    h = -np.sum(p[p > 0] * np.log(p[p > 0]))
    return min(eps, delta * math.exp(-h))


def test_typical_thresholds():
    uniform100 = torch.full((100,), 0.01)
    peaked = torch.tensor([0.97] + [0.01] * 3 + [0.0] * 96)
    flat4 = torch.tensor([0.25] * 4 + [0.0] * 96)
    # uniform over 100: threshold = 0.3 * e^-log(100) = 0.003 < eps, so p = 0.01 < eps still passes
    assert entropy_threshold(uniform100, 0.09, 0.3) == pytest.approx(0.003)
    # peaked: H = 0.1677, 0.3 e^-H = 0.2537 > eps: threshold eps = 0.09, so p = 0.01 fails
    assert entropy_threshold(peaked, 0.09, 0.3) == pytest.approx(0.09)
    target = torch.stack([uniform100, flat4, peaked, flat4])
    tv = TypicalVerifier(eps=0.09, delta=0.3)
    assert torch.allclose(tv.thresholds(target).float(), torch.tensor([0.003, 0.075, 0.09, 0.075]), atol=1e-6)
    # x_1 = 5 (p 0.01 > 0.003) ok; x_2 = 0 (0.25 > 0.075) ok; x_3 = 1 (0.01 <= 0.09) fails.
    v = tv.verify(torch.tensor([5, 0, 1]), None, target)
    assert (v.n_accepted, v.next_token) == (2, 0)
    v = tv.verify(torch.tensor([5, 0, 0]), None, target)  # 0.97 passes: all accepted, bonus argmax
    assert (v.n_accepted, v.next_token) == (3, 0)
    v = tv.verify(torch.tensor([50]), None, target)  # p_target = 0.01 on the uniform row: passes
    assert v.n_accepted == 1
    v = tv.verify(torch.tensor([50]), None, target[1:])  # p_target = 0 on flat4: fails at row 0
    assert (v.n_accepted, v.next_token) == (0, 0)


def test_typical_random_against_closed_form_and_sampling():
    rng = np.random.default_rng(8)
    tv = TypicalVerifier(eps=0.2, delta=0.5)
    for _ in range(200):
        k, v = 4, 8
        target = dirichlet(rng, v, rows=k + 1, conc=0.3)
        x = torch.tensor(rng.integers(0, v, size=k))
        ok = [float(target[i, x[i]]) > entropy_threshold(target[i], 0.2, 0.5) for i in range(k)]
        expected = ok.index(False) if False in ok else k
        verdict = tv.verify(x, None, target)
        assert verdict.n_accepted == expected and verdict.next_token == int(target[expected].argmax())
    # greedy=False: the correction comes from sample_probs.
    target = torch.tensor([[0.02, 0.9, 0.08], [0.5, 0.3, 0.2]])
    forced = torch.tensor([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    v = TypicalVerifier(greedy=False).verify(torch.tensor([0]), None, target, generator=torch.Generator(), sample_probs=forced)
    assert (v.n_accepted, v.next_token) == (0, 2)


@pytest.mark.parametrize("params", [dict(eps=0.0), dict(eps=-0.1), dict(delta=0.0), dict(delta=-1.0)])
def test_typical_bad_params(params):
    with pytest.raises(ValueError):
        get_verifier("typical", **params)


# -------------------------------------------------------------------------------------- registry


def test_registry():
    assert set(VERIFIERS) == {"greedy", "sample", "consultant", "loose", "mentored", "typical"}
    assert list(VERIFIERS)[:2] == ["greedy", "sample"]  # lossless first
    for name, cls in VERIFIERS.items():
        v = get_verifier(name)
        assert isinstance(v, cls) and v.name == name
    assert not get_verifier("consultant").needs_draft_probs and get_verifier("consultant").raw_target
    assert not get_verifier("typical").needs_draft_probs and get_verifier("typical").raw_target
    assert get_verifier("sample").needs_draft_probs and not get_verifier("sample").raw_target
    assert get_verifier("mentored").needs_draft_probs and not get_verifier("mentored").raw_target
    cd = get_verifier("consultant", eps=3.0, beta=None, greedy=False)  # None = not given
    assert (cd.eps, cd.beta, cd.greedy) == (3.0, 0.2, False)
    md = get_verifier("mentored", D=0.5, tol=0.1)
    assert (md.D, md.tol) == (0.5, 0.1)
    assert isinstance(get_verifier("greedy", eps=None, beta=None), GreedyVerifier)


def test_registry_errors():
    with pytest.raises(ValueError) as err:
        get_verifier("nope")
    msg = str(err.value)
    assert "nope" in msg and all(name in msg for name in VERIFIERS)
    with pytest.raises(ValueError, match="eps"):
        get_verifier("greedy", eps=2.0)
    with pytest.raises(ValueError, match="D"):
        get_verifier("consultant", D=0.3)
