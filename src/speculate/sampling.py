"""Sampling settings and the one warp applied to target *and* draft logits.

Speculative sampling is lossless with respect to the distribution the verifier is given, so the
target's and the draft's logits must be warped identically (temperature, then top-k, then top-p)
before the verifier sees them; the output then follows the warped target distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SpeculateError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy: the warped distribution is one-hot on the argmax
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    def __post_init__(self):
        if not 0 <= self.temperature < float("inf"):  # (inf would warp every row to uniform)
            raise SpeculateError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpeculateError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpeculateError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


SEED_END = 2**63  # seeds are 0 <= seed < 2^63: a negative seed would draw as its 2^64 complement does


def check_seed(seed: int | None) -> int | None:
    """The one rule for a seed given by a user, ``speculate generate --seed`` and a request's ``seed`` alike: None
    (a random seed), or an integer in [0, 2^63)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_END):
        raise SpeculateError(f"seed must be an integer in [0, 2^63), got {seed!r}")
    return seed


TINY_TEMPERATURE = 1e-30  # far below any meaningful temperature, far above float32's smallest normal (1.2e-38)


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """[n, V] logits → [n, V] probabilities under temperature, top-k and top-p (in that order)."""
    if s.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # Shifted by the max first, and the temperature kept a normal float32: a tiny one (5e-324, 1e-45) then gives
    # what it tends to, the argmax (ties shared), instead of inf - inf = nan.
    logits = (logits - logits.amax(-1, keepdim=True)) / max(s.temperature, TINY_TEMPERATURE)
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass *before* it already reaches top_p: the top token always stays.
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= s.top_p
        drop_sorted[..., 0] = False  # (a top_p below float32's range, 1e-300, compares as 0)
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits.softmax(-1)


def one_hot(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[k] token ids → [k, V] one-hot draft distributions (prompt lookup's drafts are certain)."""
    return torch.zeros(tokens.shape[0], vocab_size).scatter_(1, tokens[:, None], 1.0)
