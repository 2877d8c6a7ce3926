"""Quality and uncertainty for the benchmark report: ROUGE-L between texts, and percentile-bootstrap
confidence intervals for a mean and for a ratio of sums. Pure functions of numbers and strings.

Why a bootstrap over samples (prompts), and why a ratio of sums: the unit of variation in a benchmark is
the prompt — some are long, some copy-heavy — so resampling prompts (with replacement) shows how much the
headline number depends on which prompts happened to be in the set. A speedup is quoted as
sum(time_plain) / sum(time_method) (total time saved, dominated by long generations, as a user
experiences it) rather than the mean of per-prompt ratios (which a few short, noisy prompts can swing),
and its interval resamples numerator and denominator *with the same prompt indices*, keeping each
prompt's pair together: the pairing is what removes the prompt-to-prompt variation from the ratio.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import numpy as np

_TOKEN = re.compile(r"\w+")  # words: split at whitespace and punctuation


def _tokens(text: str) -> list[str]:
    """Lowercase word tokens."""
    return _TOKEN.findall(text.lower())


def _lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence, O(len(a)·len(b)) time, two rows of memory."""
    if len(b) > len(a):
        a, b = b, a  # rows as long as the shorter sequence
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0] * (len(b) + 1)
        for j, y in enumerate(b, 1):
            cur[j] = prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1])
        prev = cur
    return prev[-1]


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1: the LCS of the two texts' lowercase word tokens, as F-measure of its precision and recall.

    Both texts empty → 1.0 (identical); one empty → 0.0."""
    c, r = _tokens(candidate), _tokens(reference)
    if not c and not r:
        return 1.0
    if not c or not r:
        return 0.0
    lcs = _lcs_length(c, r)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(c), lcs / len(r)
    return 2 * precision * recall / (precision + recall)


def _check(n_resamples: int, confidence: float) -> None:
    """Reject settings that make no interval."""
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be ≥ 1, got {n_resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def _percentiles(stats: np.ndarray, confidence: float) -> tuple[float, float]:
    """The central `confidence` interval of the bootstrap distribution; NaN resamples are ignored."""
    stats = stats[~np.isnan(stats)]
    if stats.size == 0:
        return (math.nan, math.nan)
    tail = (1 - confidence) / 2 * 100
    low, high = np.percentile(stats, [tail, 100 - tail])
    return (float(low), float(high))


def bootstrap_ci(values: Sequence[float], stat: Callable = np.mean, n_resamples: int = 2000,
                 confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap confidence interval of `stat` (default: the mean) over the samples.

    Fewer than 2 values → (nan, nan): one sample says nothing about spread, and an interval of zero width
    would claim certainty; report the point estimate alone. The same seed gives the same interval."""
    _check(n_resamples, confidence)
    x = np.asarray(values, dtype=float)
    if x.ndim != 1:
        raise ValueError(f"values must be one-dimensional, got shape {x.shape}")
    if x.size < 2:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, x.size, size=(n_resamples, x.size))
    if stat is np.mean:  # the common case, vectorised
        stats = x[idx].mean(axis=1)
    else:
        stats = np.array([stat(x[row]) for row in idx], dtype=float)
    return _percentiles(stats, confidence)


def bootstrap_ratio_ci(numerators: Sequence[float], denominators: Sequence[float], n_resamples: int = 2000,
                       confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval of sum(numerators) / sum(denominators), resampling the pairs together.

    For speedup: numerators = plain-decoding times, denominators = the method's times, one pair per
    prompt. For normalised quality: numerators = the method's scores, denominators = the target's.
    A resample whose denominators sum to 0 has no ratio and is dropped (all dropped → nan). Fewer than 2
    pairs → (nan, nan), as in `bootstrap_ci`."""
    _check(n_resamples, confidence)
    num, den = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    if num.ndim != 1 or num.shape != den.shape:
        raise ValueError(f"numerators and denominators must be 1-D and of equal length, got {num.shape}, {den.shape}")
    if num.size < 2:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, num.size, size=(n_resamples, num.size))
    num_sums, den_sums = num[idx].sum(axis=1), den[idx].sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(den_sums != 0, num_sums / np.where(den_sums != 0, den_sums, 1.0), np.nan)
    return _percentiles(ratios, confidence)


def mcnemar(method: Sequence[float], reference: Sequence[float]) -> tuple[int, int, float]:
    """McNemar's exact test for paired pass/fail outcomes (HumanEval pass@1, GSM8K accuracy), one pair per
    problem: (b, c, two-sided p) with b = problems the reference solves and the method does not, c = the reverse.
    Under "the same quality" each discordant problem goes either way with probability 1/2, so p is the exact
    binomial tail: min(1, 2 · P[Binomial(b + c, 1/2) ≤ min(b, c)]); 1 without discordant problems."""
    m, r = np.asarray(method, dtype=float), np.asarray(reference, dtype=float)
    if m.shape != r.shape or m.ndim != 1 or not np.isin(np.concatenate([m, r]), (0.0, 1.0)).all():
        raise ValueError("mcnemar needs two equal-length sequences of 0/1 outcomes")
    b, c = int(((r == 1) & (m == 0)).sum()), int(((r == 0) & (m == 1)).sum())
    n = b + c
    if n == 0:
        return b, c, 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2.0 ** n
    return b, c, min(1.0, 2.0 * tail)


def keeps_quality(low: float, high: float, threshold: float = 0.97, p_value: float | None = None,
                  alpha: float = 0.05) -> str:
    """Whether a method keeps ``threshold`` of the target's quality, from the paired interval of its normalised
    quality [low, high]: "yes" (low ≥ threshold), "no" (high < threshold) or "can't tell" (the interval spans it,
    or there is none). For pass/fail tasks give McNemar's ``p_value`` too: a "no" then also needs p < ``alpha``,
    because with few solved problems the bootstrap interval can collapse to a point (one problem solved by the
    target and lost by the method gives [0, 0]) that one problem cannot support."""
    if math.isnan(low) or math.isnan(high):
        return "can't tell"
    if low >= threshold:
        return "yes"
    if high < threshold and (p_value is None or p_value < alpha):
        return "no"
    return "can't tell"
