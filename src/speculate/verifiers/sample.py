"""Lossless speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

Consultant Decoding paper, section 3.1, equations 1-3 (the paper writes the target p_i and the draft
q_i; here they are p_target and p_draft):

- eq. 1-2: draft token x_i is accepted when  min(1, p_target(x_i) / p_draft(x_i)) - u > 0,  u ~ U[0, 1).
  Implemented without a division as  ``u * p_draft(x_i) < p_target(x_i)``: the same event for
  p_draft(x_i) > 0, and for p_draft(x_i) = 0 it accepts iff p_target(x_i) > 0 (no NaN, no inf).
- eq. 3: at the first rejection the correction token is drawn from the residual
  ``max(0, p_target - p_draft) / sum_y max(0, p_target(y) - p_draft(y))`` of that row, and the
  remaining drafts are discarded.
- when all k drafts are accepted, the bonus token is drawn from p_target row k.

The output is then distributed exactly as p_target, position by position, whatever p_draft is. The
expected number of accepted drafts per position is ``sum_x min(p_draft(x), p_target(x))``.

``target_probs`` must already be the distribution the user asked to sample from (temperature / top-p
applied): this verifier has ``raw_target = False`` and ignores ``sample_probs``.
"""

from __future__ import annotations


import torch

from .base import Verdict, Verifier, sample_from, uniform

# Below this total mass the residual is treated as empty (p_draft >= p_target everywhere up to
# rounding) and the correction falls back to the p_target row. A rejection can only happen with
# probability equal to the residual mass, so this only triggers on degenerate inputs (e.g. a drafted
# token with p_draft(x) = p_target(x) = 0) or rounding noise.
RESIDUAL_EPS = 1e-12


def gather_drafted(probs: torch.Tensor, draft_tokens: torch.Tensor) -> list[float]:
    """``[probs[i, draft_tokens[i]] for i < k]`` as Python floats (float64; one small transfer)."""
    k = draft_tokens.shape[0]
    idx = draft_tokens
    if idx.device != probs.device or idx.dtype != torch.long:
        idx = idx.to(probs.device, torch.long)
    return probs[:k].gather(1, idx.view(k, 1)).view(k).tolist()


def first_rejection(target_x: list[float], draft_x: list[float], u: list[float]) -> int:
    """Eqs. 1-2 along the k positions: the first i failing ``u_i * p_draft(x_i) < p_target(x_i)``,
    or k when all pass.

    ``target_x`` / ``draft_x`` are p_target(x_i) / p_draft(x_i) at the drafted tokens, ``u`` the
    uniforms. Each test passes with probability min(1, p_target(x_i) / p_draft(x_i)); when
    p_draft(x_i) = 0 it passes iff p_target(x_i) > 0."""
    for i, (t, d, ui) in enumerate(zip(target_x, draft_x, u)):
        if not ui * d < t:
            return i
    return len(target_x)


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


class SampleVerifier(Verifier):
    """Speculative sampling: lossless, the output follows p_target exactly (paper eqs. 1-3).

    Accept x_i with probability min(1, p_target(x_i) / p_draft(x_i)) (tested as
    ``u * p_draft(x_i) < p_target(x_i)``, u ~ U[0,1), one uniform per position, all drawn up front);
    at the first rejection, at row n, draw the next token from
    ``normalize(max(0, p_target[n] - p_draft[n]))`` (:func:`residual_distribution`); when all k are
    accepted, draw the bonus token from p_target row k. ``state`` is passed through unchanged.
    """

    name = "sample"
    needs_draft_probs = True
    raw_target = False

    def correction_distribution(self, target_row: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
        """Distribution of the correction token after a rejection: the eq. 3 residual."""
        return residual_distribution(target_row, draft_row)

    def verify(self, draft_tokens, draft_probs, target_probs, state=None, generator=None, sample_probs=None):
        if draft_probs is None:
            raise ValueError("the 'sample' verifier needs draft_probs (p_draft rows)")
        k = draft_tokens.shape[0]
        if k == 0:
            return Verdict(n_accepted=0, next_token=sample_from(target_probs[0], generator), state=state)
        target_x = gather_drafted(target_probs, draft_tokens)
        draft_x = gather_drafted(draft_probs, draft_tokens)
        n = first_rejection(target_x, draft_x, uniform(k, generator, dtype=torch.float64).tolist())
        if n == k:
            return Verdict(n_accepted=k, next_token=sample_from(target_probs[k], generator), state=state)
        probs = self.correction_distribution(target_probs[n], draft_probs[n])
        return Verdict(n_accepted=n, next_token=sample_from(probs, generator), state=state)
