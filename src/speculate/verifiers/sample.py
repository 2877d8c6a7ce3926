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

from . import tree
from .base import Verdict, Verifier, sample_from, uniform
from .rows import gather_drafted, residual_distribution


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
    lossless = True

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

    def verify_tree(self, tokens, parents, draft_probs, target_probs, state=None, generator=None, sample_probs=None,
                    *, replacement=False):
        """Multi-candidate speculative sampling (:func:`~speculate.verifiers.tree.tree_sample`)."""
        return tree.tree_sample(tokens, parents, draft_probs, target_probs, generator, sample_probs,
                                replacement=replacement, state=state, correction=self.correction_distribution)
