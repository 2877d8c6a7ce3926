r"""Mentored Decoding (Tran-Thien 2023, "An optimal lossy variant of speculative decoding").

Consultant Decoding paper, section 3.1, eqs. 4-5 (the paper writes the target p_i and the draft q_i;
here p_target and p_draft). Mentored decoding trades a bounded distance from p_target for a higher
acceptance rate: per position the output distribution o is the one of largest acceptance
probability with KL(p_target || o) about D.

For 0 < alpha <= 1 <= beta the rule

- eq. 4: accept x with probability min(1, p_target(x) / (alpha * p_draft(x))), tested as
  ``u * alpha * p_draft(x) < p_target(x)``, u ~ U[0,1);
- eq. 5: on rejection draw the correction from
  ``pi(x) = max(0, p_target(x)/beta - p_draft(x)) / (1 - sum_y min(p_draft(y), p_target(y)/alpha))``

outputs (acceptances plus corrections)

    o(x) = min(p_draft(x), p_target(x)/alpha) + max(0, p_target(x)/beta - p_draft(x))
         = clip(p_draft(x), p_target(x)/beta, p_target(x)/alpha)

provided beta is fixed by sum_x o(x) = 1 (then the residual mass equals the rejection probability
and eq. 5's denominator is its normaliser). With r(x) = p_target(x) / p_draft(x),

    f(beta) = (1/beta) sum_{r > beta} p_target + sum_{alpha <= r <= beta} p_draft
              + (1/alpha) sum_{r < alpha} p_target  =  1,

f is continuous and decreasing in beta, f(1) >= 1 and f(inf) <= 1, so beta >= 1 exists; it is solved
exactly from cumulative sums over the tokens sorted by r (one sort per position, O(log V) per alpha).
On the same sorted arrays

    KL(p_target || o) = log(alpha) sum_{r < alpha} p_target + log(beta) sum_{r > beta} p_target
                        + sum_{alpha <= r <= beta} p_target log r.

alpha = 1 gives beta = 1, o = p_target (plain speculative sampling, KL 0); alpha -> 0 gives
o -> p_draft (accept everything). Per draft position i, with one u:

(a) accept if ``u * p_draft(x) < p_target(x)`` (the lossless SD test, eqs. 1-2);
(b) else accept if KL(p_target || p_draft) <= D (1 + tol): o = p_draft is already close enough;
(c) else bisect alpha in (0, 1] until KL(p_target || o_alpha) is in [D (1 - tol), D (1 + tol)],
    accept iff ``u * alpha * p_draft(x) < p_target(x)`` (the same u as (a): the events nest, so the
    acceptance probability is exactly min(1, r(x)/alpha)), and on rejection draw from the eq. 5
    residual and stop.

All k accepted: the bonus token is drawn from p_target row k. ``target_probs`` must already be the
distribution to sample from (warped): ``raw_target = False``; ``sample_probs`` is ignored.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .base import Verdict, Verifier, sample_from, uniform
from ..params import Param
from .rows import RESIDUAL_EPS, gather_drafted

_BISECT_STEPS = 60
# p_target mass below this counts as none (rounding of cumulative sums), see _SortedRatios.solve.
_MASS_EPS = 1e-14


def _as_numpy(row: torch.Tensor) -> np.ndarray:
    """A 1-D row as a normalised float64 numpy array (a copy)."""
    x = row.detach().to("cpu", torch.float64).numpy().copy()
    s = x.sum()
    if not s > 0:
        raise ValueError("mentored: a probability row sums to 0")
    x /= s
    return x


def kl_divergence(target: np.ndarray, other: np.ndarray) -> float:
    """KL(target || other) = sum_{target > 0} target log(target / other); +inf when ``other`` misses
    part of target's support."""
    m = target > 0
    t = target[m]
    with np.errstate(divide="ignore"):
        return float(np.sum(t * (np.log(t) - np.log(other[m]))))


class _SortedRatios:
    """One position's p_target / p_draft sorted by r = p_target / p_draft, with prefix sums, so that
    beta(alpha) and KL(alpha) cost O(log V) each."""

    def __init__(self, target: np.ndarray, draft: np.ndarray):
        with np.errstate(divide="ignore", invalid="ignore"):
            # +inf where p_draft = 0 < p_target, 0 where p_target = 0 < p_draft, NaN where both are 0
            # (weightless; argsort and searchsorted put NaN after +inf).
            r = target / draft
        order = np.argsort(r)
        self.r = r = r[order]
        pt = target[order]
        pd = draft[order]
        n = r.shape[0]
        self.cum_t = cum_t = np.empty(n + 1)
        self.cum_d = cum_d = np.empty(n + 1)
        self.cum_tlogr = cum_tlogr = np.empty(n + 1)
        cum_t[0] = cum_d[0] = cum_tlogr[0] = 0.0
        np.cumsum(pt, out=cum_t[1:])
        np.cumsum(pd, out=cum_d[1:])
        with np.errstate(divide="ignore", invalid="ignore"):
            plogr = pt * np.log(r)
            # Non-finite terms: r = 0 (p_target = 0, term 0), r = inf or NaN (never in the middle band).
            plogr[~np.isfinite(plogr)] = 0.0
            np.cumsum(plogr, out=cum_tlogr[1:])
            self.total_t = total_t = cum_t[-1]
            # G(b) = (1/b) sum_{r > b} p_target + sum_{r <= b} p_draft, continuous and non-increasing
            # in b, at every breakpoint b = r_j (ties give the same value by continuity).
            g = (total_t - cum_t[1:]) / r + cum_d[1:]
        g[np.isnan(g)] = np.inf  # r = 0: G -> inf as b -> 0
        # r = inf / NaN are not breakpoints: they never enter {r <= b} for a finite b.
        g[~np.isfinite(r)] = -np.inf
        # -G is non-decreasing (up to rounding, which only moves the crossing found below by a few
        # ulps), so searchsorted finds the segment of the solution.
        self.neg_g = np.negative(g, out=g)

    def solve(self, alpha: float) -> tuple[float, float]:
        """(beta, KL(p_target || o_alpha)) for one alpha in (0, 1]."""
        a = int(np.searchsorted(self.r, alpha, side="left"))  # tokens with r < alpha
        # f(beta) = G(beta) + K(alpha), K = sum_{r < alpha} (p_target/alpha - p_draft) <= 0.
        target_g = 1.0 - (self.cum_t[a] / alpha - self.cum_d[a])
        m = int(np.searchsorted(self.neg_g, -target_g, side="right"))  # breakpoints with G >= target
        m = max(m, a)
        tail = self.total_t - self.cum_t[m]  # p_target mass with r > beta
        kl = math.log(alpha) * self.cum_t[a] + (self.cum_tlogr[m] - self.cum_tlogr[a])
        if tail > _MASS_EPS:
            denom = target_g - self.cum_d[m]
            beta = max(tail / denom, 1.0) if denom > 0 else math.inf
            kl += tail * math.log(beta)  # +inf when beta = inf: o = 0 on part of p_target's support
        else:  # no p_target mass above beta (up to rounding): f(beta) = 1 only as beta -> inf
            beta = math.inf
        return beta, kl


def _solve(target: np.ndarray, draft: np.ndarray, D: float, tol: float, kl_draft: float | None = None):
    """(alpha, beta); alpha = 0.0, beta = inf when KL(p_target || p_draft) <= D (1 + tol)."""
    hi_kl, lo_kl = D * (1.0 + tol), D * (1.0 - tol)
    if kl_draft is None:
        kl_draft = kl_divergence(target, draft)
    if kl_draft <= hi_kl:
        return 0.0, math.inf
    ratios = _SortedRatios(target, draft)
    # Invariant: KL(lo) > hi_kl (alpha -> 0 gives KL(p_target || p_draft)), KL(hi) < lo_kl (alpha = 1
    # gives 0). KL is continuous in alpha, so bisection keeps a crossing bracketed.
    lo, hi = 0.0, 1.0
    best = (1.0, 1.0)
    for _ in range(_BISECT_STEPS):
        mid = 0.5 * (lo + hi)
        beta, kl = ratios.solve(mid)
        if kl > hi_kl:
            lo = mid
        else:
            hi, best = mid, (mid, beta)
            if kl >= lo_kl:
                break
    return best


def mentored_output_distribution(target_probs_row: torch.Tensor, draft_probs_row: torch.Tensor, D: float, tol: float):
    """The per-position output distribution of mentored decoding: ``(o, alpha, beta)``.

    ``o = clip(p_draft, p_target/beta, p_target/alpha)`` (CPU float64 tensor [V], sums to 1) with
    KL(p_target || o) in [D (1 - tol), D (1 + tol)] (branch (c)), or ``(p_draft, 0.0, inf)`` when
    KL(p_target || p_draft) <= D (1 + tol) already (branch (b): every draft is accepted). The rows are
    normalised first. Accepting x with probability min(1, p_target(x) / (alpha p_draft(x))) and
    correcting from ``max(0, p_target/beta - p_draft)`` yields exactly ``o``.
    """
    _check_params(D, tol)
    target = _as_numpy(target_probs_row)
    draft = _as_numpy(draft_probs_row)
    alpha, beta = _solve(target, draft, D, tol)
    if alpha == 0.0:
        return torch.from_numpy(draft), alpha, beta
    o = np.clip(draft, target / beta, target / alpha)
    return torch.from_numpy(o), alpha, beta


def _check_params(D, tol) -> tuple[float, float]:
    """D and tol checked as :class:`MentoredVerifier` declares them."""
    declared = {p.name: p for p in MentoredVerifier.params}
    return declared["D"].check("mentored", D), declared["tol"].check("mentored", tol)


class MentoredVerifier(Verifier):
    """Mentored decoding, lossy with KL(p_target || output) ~ D per position (paper eqs. 4-5). See the
    module docstring for the equations; ``state`` is passed through unchanged.

    No tree form (``verify_tree`` is the base's refusal): the KL budget is per position of one chain, and
    a multi-candidate version of eq. 5's residual is not derived here."""

    name = "mentored"
    needs_draft_probs = True
    raw_target = False
    params = (
        Param("D", 0.3, "target KL divergence, nats", low=0.0, low_open=True),
        Param("tol", 0.2, "relative tolerance on D", low=0.0, high=1.0),
    )

    def verify(self, draft_tokens, draft_probs, target_probs, state=None, generator=None, sample_probs=None):
        if draft_probs is None:
            raise ValueError("the 'mentored' verifier needs draft_probs (p_draft rows)")
        k = draft_tokens.shape[0]
        if k:
            target_x = gather_drafted(target_probs, draft_tokens)
            draft_x = gather_drafted(draft_probs, draft_tokens)
            u = uniform(k, generator, dtype=torch.float64).tolist()
            for i in range(k):
                if u[i] * draft_x[i] < target_x[i]:  # (a)
                    continue
                target = _as_numpy(target_probs[i])
                draft = _as_numpy(draft_probs[i])
                alpha, beta = _solve(target, draft, self.D, self.tol)
                if alpha == 0.0:  # (b)
                    continue
                # (c), on the normalised rows (as the solver saw them), same u as (a).
                tx, dx = target[int(draft_tokens[i])], draft[int(draft_tokens[i])]
                if u[i] * alpha * dx < tx:
                    continue
                residual = np.maximum(target / beta - draft, 0.0)
                mass = residual.sum()
                correction = residual / mass if mass > RESIDUAL_EPS else target
                return Verdict(n_accepted=i, next_token=sample_from(torch.from_numpy(correction), generator), state=state)
        return Verdict(n_accepted=k, next_token=sample_from(target_probs[k], generator), state=state)
