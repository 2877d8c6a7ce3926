"""The lesson's speedup arithmetic, done right (pure Python, no torch).

Source: the lesson "Speculative decoding" (``shared/seeds/speculative-decoding-lesson.txt``), section
"Expected speedup" and Exercises 1-2. The lesson writes the target distribution q and the draft p; here
they are always ``p_target`` and ``p_draft``.

- :func:`acceptance_rate`: α = Σ_x min(p_draft(x), p_target(x)), the probability that one drafted
  token is accepted by speculative sampling (Exercise 1).
- :func:`residual_distribution`: normalize(max(0, p_target − p_draft)), what a rejected position is
  resampled from (the lesson's "Correction" step, p_adj). Its mass before normalising is 1 − α.
- :func:`expected_tokens`: E(α, k) = (1 − α^(k+1)) / (1 − α) tokens per target call (k + 1 at α = 1),
  when each of the k drafts is accepted independently with probability α and the target adds one token
  (the correction or the bonus) after the accepted ones.
- :func:`speedup`: E(α, k) / (T(k+1)/T(1) + k·c). One round costs one target forward over k + 1 new
  tokens, T(k+1), plus k draft forwards of c·T(1) each; plain decoding costs T(1) per token. T comes
  from a measured cost curve (:mod:`speculate.policy.profile`) or is flat (T(n) = T(1), the lesson's
  "same cost as a single decode step"). c = 0 for prompt lookup.
- :func:`lesson_speedup`: the lesson's approximation (1 + kα) / (1 + k/s), s the draft speed ratio
  (s = 1/c). It counts k·α accepted tokens (linear in k) where E(α, k) saturates at 1/(1 − α), which is
  why long drafts pay far less than it promises (Exercise 2).
- :func:`best_k` / :func:`recommend_k`: the k maximising :func:`speedup` on a cost curve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..errors import SpeculateError

#: A distribution given on the command line must sum to 1 within this.
SUM_TOLERANCE = 1e-6


def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:  # also rejects NaN
        raise SpeculateError(f"alpha must be in [0, 1], got {alpha:g}")
    return alpha


def _check_k(k: int, minimum: int = 0) -> int:
    if isinstance(k, bool) or int(k) != k or k < minimum:
        raise SpeculateError(f"k must be an integer >= {minimum}, got {k}")
    return int(k)


def _check_c(c: float) -> float:
    c = float(c)
    if not 0.0 <= c < math.inf:
        raise SpeculateError(f"the draft cost ratio c must be finite and >= 0, got {c:g}")
    return c


def check_distribution(values: Sequence[float], name: str = "distribution") -> list[float]:
    """``values`` as a list of floats, if they are a probability distribution: at least one entry, all
    finite and >= 0, summing to 1 within :data:`SUM_TOLERANCE`. Raises SpeculateError otherwise."""
    out = [float(v) for v in values]
    if not out:
        raise SpeculateError(f"{name} is empty")
    for i, v in enumerate(out):
        if not 0.0 <= v < math.inf:
            raise SpeculateError(f"{name}[{i}] = {v:g}: probabilities must be finite and >= 0")
    total = math.fsum(out)
    if abs(total - 1.0) > SUM_TOLERANCE:
        raise SpeculateError(f"{name} sums to {total:.9g}, not 1 (tolerance {SUM_TOLERANCE:g})")
    return out


def _check_pair(p_target: Sequence[float], p_draft: Sequence[float]) -> tuple[list[float], list[float]]:
    target = check_distribution(p_target, "p_target")
    draft = check_distribution(p_draft, "p_draft")
    if len(target) != len(draft):
        raise SpeculateError(f"p_target has {len(target)} outcomes but p_draft has {len(draft)}")
    return target, draft


def acceptance_rate(p_target: Sequence[float], p_draft: Sequence[float]) -> float:
    """α = Σ_x min(p_draft(x), p_target(x)) (lesson, "Expected speedup" and Exercise 1).

    The probability that speculative sampling accepts one token drawn from p_draft:
    Σ_x p_draft(x) · min(1, p_target(x)/p_draft(x)). Both arguments are validated as distributions
    over the same outcomes (SpeculateError otherwise). Exercise 1: p_target = (0.6, 0.1, 0.3),
    p_draft = (0.5, 0.3, 0.2) give α = 0.5 + 0.1 + 0.2 = 0.8."""
    target, draft = _check_pair(p_target, p_draft)
    return math.fsum(min(t, d) for t, d in zip(target, draft))


def residual_distribution(p_target: Sequence[float], p_draft: Sequence[float]) -> list[float] | None:
    """normalize(max(0, p_target − p_draft)): the lesson's p_adj, sampled after a rejection.

    Its mass before normalising is Σ max(0, p_target − p_draft) = 1 − α. Returns None when that mass
    is 0 (p_draft == p_target: α = 1, nothing is ever rejected, so there is nothing to resample).
    Exercise 1: (0.6, 0.1, 0.3) − (0.5, 0.3, 0.2) → (0.1, 0, 0.1) / 0.2 = (0.5, 0, 0.5)."""
    target, draft = _check_pair(p_target, p_draft)
    residual = [max(0.0, t - d) for t, d in zip(target, draft)]
    mass = math.fsum(residual)
    if not mass > 1e-12:
        return None
    return [r / mass for r in residual]


def expected_tokens(alpha: float, k: int) -> float:
    """E(α, k) = (1 − α^(k+1)) / (1 − α): expected tokens per target call (k + 1 at α = 1).

    Lesson, "Expected speedup": with each of the k drafts accepted independently with probability α,
    the round yields the accepted prefix plus one token from the target (the correction at the first
    rejection, or the bonus token when all k pass): E = Σ_{i=0..k} α^i, computed as that sum (exact at
    α = 1, where it is k + 1, and at α = 0, where it is 1). It never reaches 1/(1 − α), however large k."""
    alpha = _check_alpha(alpha)
    k = _check_k(k)
    return math.fsum(alpha ** i for i in range(k + 1))


def verify_cost(curve: Mapping[int, float] | None, n: int) -> float:
    """T(n)/T(1) from ``curve`` (n → ratio), or 1.0 when ``curve`` is None (flat)."""
    if curve is None:
        return 1.0
    if n not in curve:
        raise SpeculateError(f"the cost curve has no T({n})/T(1) (it covers n = {min(curve)}..{max(curve)})")
    return float(curve[n])


def speedup(alpha: float, k: int, c: float = 0.0, curve: Mapping[int, float] | None = None,
            rows: int | None = None) -> float:
    """Exact expected speedup over plain decoding: E(α, k) / (T(k+1)/T(1) + k·c).

    Lesson, "Expected speedup", with the costs made explicit: a round is one target forward over the
    last accepted token + k drafts (cost T(k+1), the lesson takes it equal to T(1)) plus k draft
    forwards at c·T(1) each, and yields E(α, k) tokens; plain decoding yields one token per T(1).
    ``curve`` maps n to T(n)/T(1) (None: flat, T(n) = T(1)); ``c`` is the draft's cost per drafted
    token relative to one target forward (0 for prompt lookup; 1/s for a draft s times faster).
    ``rows``: the rows one verification scores, when not k + 1 — a draft tree of depth k and m nodes
    scores m + 1 (its α is then the per-level acceptance of its best path).
    With a flat curve and c = 0 this is E(α, k)."""
    c = _check_c(c)
    k = _check_k(k)
    return expected_tokens(alpha, k) / (verify_cost(curve, k + 1 if rows is None else rows) + k * c)


def lesson_speedup(alpha: float, k: int, speed_ratio: float) -> float:
    """The lesson's approximation (1 + kα) / (1 + k/s), s = draft speed relative to the target.

    Lesson, "Expected speedup" and Exercise 2: α = 0.8, k = 4, s = 8 give 4.2 / 1.5 = 2.8. ``speed_ratio``
    may be ``math.inf`` (a free drafter: 1 + kα). It overstates long drafts: 1 + kα grows without bound
    while the true E(α, k) stays below 1/(1 − α), and it takes verifying k + 1 tokens to cost T(1)."""
    alpha = _check_alpha(alpha)
    k = _check_k(k)
    s = float(speed_ratio)
    if not s > 0.0:  # also rejects NaN
        raise SpeculateError(f"the speed ratio must be > 0, got {s:g}")
    return (1.0 + k * alpha) / (1.0 + k / s)


def _curve_of(profile) -> Mapping[int, float]:
    """The T(n)/T(1) mapping of a Profile (anything with a ``curve`` attribute) or of a plain mapping."""
    curve = getattr(profile, "curve", profile)
    if not isinstance(curve, Mapping) or 1 not in curve or 2 not in curve:
        raise SpeculateError("a cost curve needs T(n)/T(1) for n = 1 and 2 at least")
    return curve


def best_k(profile, alpha: float, c: float, k_max: int | None = None, rows=None) -> tuple[int, float]:
    """(k, speedup) maximising :func:`speedup` over k = 1..k_max on ``profile``'s cost curve.

    ``profile`` is a :class:`~speculate.policy.profile.Profile` or a mapping n → T(n)/T(1) (None: flat,
    then ``k_max`` is required). k_max defaults to the largest k the curve covers (its largest n − 1).
    ``rows``: k → the rows a draft of depth k verifies (a tree drafter's nodes + 1; None: k + 1); k
    stops where the curve no longer covers them. Ties go to the smaller k. The speedup may be below 1:
    then no k pays and plain decoding is faster."""
    alpha = _check_alpha(alpha)
    c = _check_c(c)
    rows = rows or (lambda k: k + 1)
    if profile is None:
        curve = None
        if k_max is None:
            raise SpeculateError("best_k on a flat curve needs k_max")
    else:
        curve = _curve_of(profile)
        covered = 1
        while covered + 1 in curve:
            covered += 1
        k_max = covered - 1 if k_max is None else min(k_max, covered - 1)
        while k_max > 1 and rows(k_max) > covered:
            k_max -= 1
    k_max = _check_k(k_max, minimum=1)
    best = (1, speedup(alpha, 1, c, curve, rows(1)))
    for k in range(2, k_max + 1):
        s = speedup(alpha, k, c, curve, rows(k))
        if s > best[1]:
            best = (k, s)
    return best


def recommend_k(profile, alpha: float, c: float) -> int:
    """The draft length k maximising the exact speedup E(α, k) / (T(k+1)/T(1) + k·c) on ``profile``.

    ``profile``: a measured :class:`~speculate.policy.profile.Profile` (see :func:`load_profile`) or a
    mapping n → T(n)/T(1). ``alpha``: the expected per-token acceptance rate. ``c``: the draft's cost per
    drafted token relative to one target forward (0 for prompt lookup; ``profile.c`` for the draft model
    it was measured with). Meant for a future ``--k auto``; see :func:`best_k` for the speedup too."""
    return best_k(profile, alpha, c)[0]
