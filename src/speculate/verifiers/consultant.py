"""Consultant Decoding (CD), Algorithm 1 of "Consultant Decoding: Yet Another Synergistic Mechanism"
(arXiv 2506.02391, section 3.2).

The draft token is judged by its negative log-likelihood under the target, not by a likelihood ratio:

- eq. 6:  V_CD(x_i) = eps - (-log p_target(x_i)); accept when V_CD > 0 (the beta = 0 case).
- eq. 7-8 (smooth version): r_i = EMA_beta(r_{i-1}, -log p_target(x_i))
  = beta * r_{i-1} + (1 - beta) * (-log p_target(x_i)); accept x_i while r_i <= eps (Algorithm 1,
  lines 9-11); at the first failure stop (the failing token's NLL does not enter r).
- Algorithm 1, lines 16-17: the target supplies x'_{n+1} from row n (n = number accepted, row k =
  bonus when all are accepted), and r_{n+1} = EMA_beta(r_n, -log p_target(x'_{n+1})) is carried into
  the next round as the verifier state (a float; state=None at the start of a generation: r_0 = 0).

With beta = 0 the rule is "accept while p_target(x_i) >= e^-eps", a dynamic nucleus (section 3.4).

``argmax=True`` is OUR extension, not the paper's: a draft token is also accepted when it is the target's argmax
at its row, whatever its NLL (the EMA still takes its NLL, as Algorithm 1 updates r on every acceptance). Why:
where the target is unsure, even its own argmax can have NLL > eps, and the paper's rule then rejects the very
token greedy decoding would emit (on the default model with prompt lookup, HumanEval: τ 2.11 against exact
matching's 4.57). With the clause, every draft prefix that greedy verification accepts is accepted too (by
induction over the positions: each of them is the argmax), so a round never keeps fewer drafts than ``greedy``.
The argmax is the one greedy decoding takes (the warped rows' at temperature 0, ``sample_probs``).

``raw_target = True``: ``target_probs`` must be the UNWARPED (temperature 1) target distribution, the
one the NLL is defined on. The correction token is the argmax of ``target_probs`` when
``greedy=True``; otherwise it is drawn from ``sample_probs`` (the engine's temperature / top-p warped
rows, [k+1, V], same indexing as target_probs) when given, else from ``target_probs``. Its NLL always
comes from ``target_probs``.
"""

from __future__ import annotations

from . import tree
from .base import Verdict, Verifier, target_token
from ..params import Param
from .rows import argmax_rows, ema, gather_drafted, nll


class ConsultantVerifier(Verifier):
    """Consultant Decoding, Algorithm 1 (eqs. 6-8). See the module docstring.

    Parameters: ``eps`` > 0, the NLL threshold (the paper's generic setting is 2.0); ``beta`` in
    [0, 1), the EMA decay weight of eq. 8; ``argmax``: also accept the target's argmax (our extension);
    ``greedy``: correction token = argmax p_target (True) or a draw from ``sample_probs`` / ``target_probs``
    (False).
    """

    name = "consultant"
    needs_draft_probs = False
    raw_target = True
    params = (
        Param("eps", 2.0, "an NLL threshold", low=0.0, low_open=True,
              auto="the target's mean NLL on a calibration text"),
        Param("beta", 0.2, "EMA decay weight", low=0.0, high=1.0),
        Param("argmax", False, "also accept a draft token that is the target's argmax (our extension of the paper's "
              "rule: never fewer drafts kept than greedy verification)"),
        Param("greedy", True, "correction token = the target's argmax, else a draw", user=False),
    )

    def verify(self, draft_tokens, draft_probs, target_probs, state=None, generator=None, sample_probs=None):
        beta, eps = self.beta, self.eps
        r = 0.0 if state is None else float(state)
        k = draft_tokens.shape[0]
        n = 0
        if k:
            top = argmax_rows(target_probs, sample_probs)[:k].tolist() if self.argmax else None
            for i, p in enumerate(gather_drafted(target_probs, draft_tokens)):  # lines 7-15
                r_i = ema(beta, r, nll(p))
                if not r_i <= eps and not (top is not None and top[i] == int(draft_tokens[i])):
                    break
                r = r_i
                n += 1
        # Lines 16-17: the target's token at row n and its NLL into the carried state.
        token = target_token(target_probs, sample_probs, n, self.greedy, generator)
        r = ema(beta, r, nll(float(target_probs[n, token])))
        return Verdict(n_accepted=n, next_token=token, state=r)

    def verify_tree(self, tokens, parents, draft_probs, target_probs, state=None, generator=None, sample_probs=None,
                    *, replacement=False):
        """Algorithm 1 along every root-to-leaf path (:func:`~speculate.verifiers.tree.tree_consultant`)."""
        return tree.tree_consultant(tokens, parents, target_probs, state, verifier=self, generator=generator,
                                    sample_probs=sample_probs)
