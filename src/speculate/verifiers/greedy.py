"""Greedy exact-match verification: the output is token-for-token the target's greedy decoding."""

from __future__ import annotations

from ..sampling import argmax
from . import tree
from .base import Verdict, Verifier


class GreedyVerifier(Verifier):
    """Accept x_i while x_i = argmax p_target(· | x_<i); the next token is the argmax at the first
    mismatch, or at the bonus row k when all k drafts match. Deterministic: no state, no randomness."""

    name = "greedy"
    needs_draft_probs = False
    lossless = True  # (for greedy decoding: the engine uses it at temperature 0 only)

    @property
    def argmax_only(self) -> bool:
        """True: :meth:`verify` and :meth:`verify_tree` read nothing of ``target_probs`` but each row's argmax. Not
        for a subclass with a rule of its own (a plugin's), which may read more."""
        cls = type(self)
        return cls.verify is GreedyVerifier.verify and cls.verify_tree is GreedyVerifier.verify_tree

    def verify(self, draft_tokens, draft_probs, target_probs, state=None, generator=None, sample_probs=None):
        target_argmax = argmax(target_probs)  # [k+1]
        k = draft_tokens.shape[0]
        # Index of the first mismatch; k when every draft matches (the bonus row).
        mismatch = (draft_tokens != target_argmax[:k]).nonzero()
        n = int(mismatch[0, 0]) if mismatch.numel() else k
        return Verdict(n_accepted=n, next_token=int(target_argmax[n]), state=state)

    def verify_tree(self, tokens, parents, draft_probs, target_probs, state=None, generator=None, sample_probs=None,
                    *, replacement=False):
        """The longest path of argmax matches (:func:`~speculate.verifiers.tree.tree_greedy`)."""
        return tree.tree_greedy(tokens, parents, target_probs, state)
