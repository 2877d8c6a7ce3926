"""Arithmetic on probability rows that a rule's chain form (its verifier module) and its tree form
(``tree.py``) share: drafted-token gathers, the speculative-sampling residual, NLL and its EMA, entropy.

It sits below both, so that the verifier modules can call their tree forms without an import circle.
"""

from __future__ import annotations

import math

import torch

from ..sampling import argmax

# Below this total mass the residual is treated as empty (p_draft >= p_target everywhere up to
# rounding) and the correction falls back to the p_target row. A rejection can only happen with
# probability equal to the residual mass, so this only triggers on degenerate inputs (e.g. a drafted
# token with p_draft(x) = p_target(x) = 0) or rounding noise.
RESIDUAL_EPS = 1e-12

# Probabilities are floored here before the log, so a zero-probability token gets a large but finite
# NLL (-log 1e-45 ~= 103.6, 1e-45 ~ the smallest float32 subnormal). It still fails any sane eps and,
# unlike +inf, decays out of the EMA state after a few tokens instead of blocking acceptance forever.
PROB_FLOOR = 1e-45


def gather_drafted(probs: torch.Tensor, draft_tokens: torch.Tensor) -> list[float]:
    """``[probs[i, draft_tokens[i]] for i < k]`` as Python floats (float64; one small transfer)."""
    k = draft_tokens.shape[0]
    idx = draft_tokens
    if idx.device != probs.device or idx.dtype != torch.long:
        idx = idx.to(probs.device, torch.long)
    return probs[:k].gather(1, idx.view(k, 1)).view(k).tolist()


def residual_distribution(target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """Eq. 3: ``max(0, p_target - p_draft)`` normalised, in float64 on the rows' device.

    Falls back to the (normalised) p_target row when the residual mass is below
    :data:`RESIDUAL_EPS` (p_draft == p_target, or p_draft >= p_target everywhere), so the result is
    always a valid distribution with no NaN."""
    target = target_row.to(torch.float64)
    residual = (target - draft_row.to(torch.float64)).clamp_(min=0.0)
    mass = float(residual.sum())
    if not mass > RESIDUAL_EPS:  # also catches NaN
        return target / target.sum()
    return residual / mass


def argmax_rows(target_probs: torch.Tensor, sample_probs: torch.Tensor | None) -> torch.Tensor:
    """Each row's argmax as greedy decoding takes it: of the warped rows where given (at temperature 0 the
    one-hot of the logits' argmax), else of the raw ones."""
    return argmax(sample_probs if sample_probs is not None else target_probs)


def nll(p: float) -> float:
    """-log(max(p, PROB_FLOOR)): finite, never NaN (NaN p is treated as 0)."""
    if not p > PROB_FLOOR:
        p = PROB_FLOOR
    return -math.log(p)


def ema(beta: float, r_prev: float, value: float) -> float:
    """Consultant Decoding's eq. 8: beta * r_prev + (1 - beta) * value."""
    return beta * r_prev + (1.0 - beta) * value


def entropy(rows: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row of [m, V] probabilities, 0 log 0 = 0, as CPU float64 [m]."""
    return torch.special.entr(rows.float()).sum(dim=-1).to("cpu", torch.float64)


__all__ = ["PROB_FLOOR", "RESIDUAL_EPS", "ema", "entropy", "gather_drafted", "nll", "residual_distribution"]
