"""Sampling parameters and the one warp applied to target *and* draft logits.

Speculative sampling is lossless with respect to the distribution the verifier is given, so the
target's and the draft's logits must be warped identically (temperature, then top-k, then top-p)
before the verifier sees them; the output then follows the warped target distribution exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SpeculateError


MAX_LOGPROBS = 20  # the most alternatives a token's log-probabilities list (OpenAI's top_logprobs limit)


@dataclass(frozen=True)
class SamplingParams:
    """How one generation draws its tokens and when it ends, validated once, when made (one error line each):
    the warp (``temperature``, ``top_k``, ``top_p``: :func:`warp`), the ``seed`` of its draws (None: a random
    one; any seed torch takes, [-2^63, 2^64)), ``max_new_tokens`` and the ``stop`` strings. The engine, the
    server and the bench all describe a request with one of these (vLLM's and nano-vllm's ``SamplingParams``)."""

    temperature: float = 0.0  # 0 means greedy: the warped distribution is one-hot on the argmax
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()  # a string or a list of strings is accepted and kept as a tuple
    # Log-probabilities of the raw model (temperature 1, no top-k / top-p, as vLLM reports them) from the target's
    # own rows: ``logprobs`` for each new token, ``prompt_logprobs`` for each prompt token after the first. None: not
    # wanted; K: the chosen token's and the K most likely tokens' (0..MAX_LOGPROBS).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # A grammar every new token follows (llguidance's; grammar.json_schema_grammar makes one from a JSON schema).
    grammar: str | None = None

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < float("inf"):  # (inf would warp every row to uniform)
            raise SpeculateError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise SpeculateError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise SpeculateError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < 0:
            raise SpeculateError(f"top_k must be >= 0, got {self.top_k}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not -2**63 <= seed < 2**64):
            raise SpeculateError(f"seed must be an integer in [-2^63, 2^64), got {seed}")  # torch's seed range
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise SpeculateError(f"max_new_tokens must be an integer >= 0, got {n}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) for s in stop):
            raise SpeculateError(f"stop must be a string or a list of strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                raise SpeculateError(f"{name} must be an integer in 0..{MAX_LOGPROBS} (the most likely tokens "
                                     f"reported beside each one), got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self) -> torch.Generator:
        """A new generator for this generation's draws: seeded with :attr:`seed`, else with a random seed."""
        generator = torch.Generator()
        generator.manual_seed(self.seed if self.seed is not None else int(torch.randint(0, 2**62, ()).item()))
        return generator


SEED_END = 2**63  # seeds are 0 <= seed < 2^63: a negative seed would draw as its 2^64 complement does


def check_seed(seed: int | None) -> int | None:
    """The one rule for a seed given by a user, ``speculate generate --seed`` and a request's ``seed`` alike: None
    (a random seed), or an integer in [0, 2^63)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_END):
        raise SpeculateError(f"seed must be an integer in [0, 2^63), got {seed!r}")
    return seed


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the last axis, by ``torch.argmax``'s rule (the first index of the greatest value; a NaN
    counts as the greatest, its first index): greedy decoding's token. Through numpy's vectorized argmax (the same
    rule) for float32 CPU tensors, ~10x faster than torch's on a row of the default model's 49,152 logits, and the
    greedy rows of every decode step take it (docs/benchmarks.md, "Around the forward, cold"); torch's for the rest."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.requires_grad or not x.dim():
        return x.argmax(-1)
    return torch.as_tensor(x.numpy().argmax(-1))  # (a row: a numpy scalar)


TINY_TEMPERATURE = 1e-30  # far below any meaningful temperature, far above float32's smallest normal (1.2e-38)


def warp(logits: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    """[n, V] logits → [n, V] probabilities under temperature, top-k and top-p (in that order)."""
    if s.greedy:
        probs = torch.zeros_like(logits)
        return probs.scatter_(-1, argmax(logits)[..., None], 1.0)
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
