r"""Entropy-gated loose acceptance: the entropy gate of FLy (Li et al. 2025, "Training-Free Loosely
Speculative Decoding", arXiv 2511.22972), without its deferred window. Lossy.

Greedy verification rejects every draft that is not the target's argmax, even where the target itself
hesitates between several continuations. Here draft token x_i at row i (p = p_target row i) is accepted
while

    x_i = argmax p,   or   H(p) >= theta  and  p(x_i) >= rho * max p,     H(p) = -sum_x p(x) log p(x),

i.e. a mismatch is forgiven only where the target is uncertain (entropy at least ``theta`` nats) and the
drafted token is nearly as likely as the target's own choice (within the factor ``rho``). At the first
failure, row n (or the bonus row k when all k pass), the target supplies the next token: its argmax when
``greedy``, else a draw from ``sample_probs`` row n (the engine's warped rows), else from
``target_probs`` row n.

Lossless extremes: ``theta`` above log V (every row's entropy is at most log V) never opens the gate,
and ``rho = 1`` admits only tokens tied with the max; with ``greedy`` both give greedy verification's
verdicts. ``theta = 0`` with a small ``rho`` accepts nearly any token the target gives mass to.

``raw_target = True``: the test and the entropy use the unwarped (temperature 1) target rows. The
defaults (theta 1.0 nat, rho 0.5) are a starting point, not a measured optimum. Tree form: the same test
at every node (:func:`~speculate.verifiers.tree.tree_per_token`).
"""

from __future__ import annotations

import torch

from . import tree
from .base import Verdict, Verifier, target_token
from ..params import Param
from ..sampling import argmax as first_argmax
from .rows import entropy, gather_drafted


class LooseVerifier(Verifier):
    """Accept x_i while it is the target's argmax, or H(p_target row i) >= theta and
    p_target(x_i) >= rho * max p_target row i. See the module docstring; ``state`` passes through."""

    name = "loose"
    needs_draft_probs = False
    raw_target = True
    params = (
        Param("theta", 1.0, "entropy gate: forgive a mismatch only where the target's entropy is at least "
                            "this many nats", low=0.0),
        Param("rho", 0.5, "a forgiven token's target probability is at least rho times the max",
              low=0.0, high=1.0, low_open=True, high_open=False),
        Param("greedy", True, "correction token = the target's argmax, else a draw", user=False),
    )

    def accepts(self, row: torch.Tensor, token: int, p_x: float) -> bool:
        """The test for one drafted ``token`` of probability ``p_x`` in the target ``row`` [V]."""
        argmax = int(first_argmax(row))  # (the first of tied maxima, as greedy verification's)
        if token == argmax:
            return True
        if not p_x >= self.rho * float(row[argmax]):
            return False
        return float(entropy(row[None])[0]) >= self.theta  # (an O(V) pass, only for near-ties)

    def verify(self, draft_tokens, draft_probs, target_probs, state=None, generator=None, sample_probs=None):
        k = draft_tokens.shape[0]
        n = k
        if k:
            tokens = draft_tokens.tolist()
            for i, p_x in enumerate(gather_drafted(target_probs, draft_tokens)):
                if not self.accepts(target_probs[i], tokens[i], p_x):
                    n = i
                    break
        token = target_token(target_probs, sample_probs, n, self.greedy, generator)
        return Verdict(n_accepted=n, next_token=token, state=state)

    def verify_tree(self, tokens, parents, draft_probs, target_probs, state=None, generator=None, sample_probs=None,
                    *, replacement=False):
        """The same test at every node, along every root-to-leaf path (ties: the likelier path)."""
        return tree.tree_per_token(tokens, parents, target_probs,
                                   lambda row, token, p_x: self.accepts(target_probs[row], token, p_x),
                                   self.greedy, generator, sample_probs, state, who="tree_loose")
