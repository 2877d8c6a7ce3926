"""No drafter: plain autoregressive decoding in the same engine, the baseline of every speedup."""

from .base import EMPTY, Draft, Drafter


class NoDrafter(Drafter):
    name = "none"
    summary = "no drafts: plain decoding, the baseline of every speedup"
    rank = 0

    def propose(self, tokens, k):
        return Draft(EMPTY)

    def max_nodes(self, k: int) -> int:
        return 0  # it never drafts (so --k auto has nothing to size: the engine keeps k fixed)
