"""Typical acceptance (Medusa, Cai et al. 2024, section 2.3.1).

Draft token x_i is accepted while

    p_target(x_i) > min(eps, delta * exp(-H(p_target row i))),   H(p) = -sum_x p(x) log p(x),

i.e. a token is kept when it is not too unlikely under the target, with the bar lowered where the
target is uncertain (high entropy). At the first failure, row n (or the bonus row k when all k pass),
the target supplies the next token: its argmax when ``greedy=True``, else a draw from ``sample_probs``
row n (the engine's warped rows) when given, else from ``target_probs`` row n.

``raw_target = True``: the test and the entropy use the unwarped (temperature 1) target rows.
Medusa's defaults: eps (posterior_threshold) = 0.09, delta (posterior_alpha) = 0.3.
"""

from __future__ import annotations


import torch

from . import tree
from .base import Verdict, Verifier, target_token
from ..params import Param
from .rows import entropy, gather_drafted  # noqa: F401  (re-exported)


class TypicalVerifier(Verifier):
    """Medusa typical acceptance: accept while p_target(x_i) > min(eps, delta * exp(-H_i)).

    Parameters: ``eps`` > 0 (hard threshold), ``delta`` > 0 (entropy-scaled threshold), ``greedy``.
    ``state`` is passed through unchanged.
    """

    name = "typical"
    needs_draft_probs = False
    raw_target = True
    params = (
        Param("eps", 0.09, "probability threshold", low=0.0, low_open=True),
        Param("delta", 0.3, "entropy-scaled threshold", low=0.0, low_open=True),
        Param("greedy", True, "correction token = the target's argmax, else a draw", user=False),
    )

    def thresholds(self, rows: torch.Tensor) -> torch.Tensor:
        """min(eps, delta * exp(-H(row))) for each row of [m, V], CPU float64 [m]."""
        return torch.clamp(self.delta * torch.exp(-entropy(rows)), max=self.eps)

    def verify(self, draft_tokens, draft_probs, target_probs, state=None, generator=None, sample_probs=None):
        k = draft_tokens.shape[0]
        n = k
        if k:
            target_x = gather_drafted(target_probs, draft_tokens)
            # p > eps passes whatever the entropy; only the other rows need H (an O(V) pass each),
            # and only up to the first failure.
            for i, p in enumerate(target_x):
                if p > self.eps:
                    continue
                if not p > float(self.thresholds(target_probs[i : i + 1])[0]):
                    n = i
                    break
        token = target_token(target_probs, sample_probs, n, self.greedy, generator)
        return Verdict(n_accepted=n, next_token=token, state=state)

    def verify_tree(self, tokens, parents, draft_probs, target_probs, state=None, generator=None, sample_probs=None,
                    *, replacement=False):
        """Typical acceptance along every root-to-leaf path (:func:`~speculate.verifiers.tree.tree_typical`)."""
        return tree.tree_typical(tokens, parents, target_probs, state, verifier=self, generator=generator,
                                 sample_probs=sample_probs)
