"""The verifier interface: a pure function of tensors plus a small state.

A verifier never sees a model. Each round the engine hands it

- ``draft_tokens``  LongTensor [k]     the drafted tokens x_1..x_k
- ``draft_probs``   FloatTensor [k, V] p_draft rows, row i is the distribution x_{i+1} was drawn from
- ``target_probs``  FloatTensor [k+1, V] p_target rows from one target forward; row k is the bonus
  position (the distribution after all k drafts)
- ``state``         whatever the previous round returned (None at the start of a generation)
- ``generator``     a seeded ``torch.Generator`` for every random draw, so seeded runs reproduce

and gets back a :class:`Verdict`: how many drafts to keep (``n_accepted``), the one token the target
adds after them (``next_token``), and the state for the next round.

Naming: the lesson writes the target distribution q and the draft p, the Consultant Decoding paper the
reverse. Here it is always ``target_probs`` / ``draft_probs`` (p_target / p_draft in docstrings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Verdict:
    n_accepted: int
    next_token: int
    state: Any = None


class Verifier:
    """Base class. Subclasses implement :meth:`verify`.

    Class attributes the engine reads (never model access, only what to hand over):

    - ``needs_draft_probs``: False when the rule ignores p_draft (greedy, consultant, typical), so a
      drafter with one-hot drafts need not materialise [k, V] rows.
    - ``raw_target``: True when the rule must see the *unwarped* (temperature 1) target distribution
      as ``target_probs`` (consultant's NLL, typical's entropy); the warped one used for sampling the
      correction token is then passed as ``sample_probs``.
    """

    name = "base"
    needs_draft_probs = True
    raw_target = False

    def verify(
        self,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor | None,
        target_probs: torch.Tensor,
        state: Any = None,
        generator: torch.Generator | None = None,
        sample_probs: torch.Tensor | None = None,
    ) -> Verdict:
        raise NotImplementedError


def positive(who: str, name: str, value, meaning: str) -> float:
    """``value`` as a float, or ValueError unless it is finite and > 0 (verifier parameters)."""
    value = float(value)
    if not value > 0 or math.isinf(value):
        raise ValueError(f"{who}: {name} must be a finite number > 0 ({meaning}), got {value}")
    return value


def fraction(who: str, name: str, value, meaning: str) -> float:
    """``value`` as a float, or ValueError unless 0 <= value < 1."""
    value = float(value)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{who}: {name} must satisfy 0 <= {name} < 1 ({meaning}), got {value}")
    return value


def uniform(n: int, generator: torch.Generator | None, dtype=torch.float32) -> torch.Tensor:
    """n draws of U[0, 1) from the shared generator (CPU, so seeded runs reproduce anywhere)."""
    return torch.rand(n, generator=generator, dtype=dtype)


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a 1-D, possibly unnormalised, non-negative row, by inverse CDF.

    Consumes the shared generator through :func:`uniform` (one draw). A float64 cumulative sum and one
    binary search: ``torch.multinomial``
    costs ~4 ms for one draw at V = 152k on CPU, this ~0.2 ms. The token is the first i with
    cumsum[i] > u * total (u in [0, 1)), so zero-probability tokens are never returned. Works for rows
    on any device (the uniform comes from the CPU generator as a Python float)."""
    cdf = probs.detach().to(torch.float64).cumsum(0)
    total = float(cdf[-1])
    if not 0.0 < total < math.inf:
        raise ValueError(f"cannot sample from a row with total mass {total}")
    v = float(uniform(1, generator, dtype=torch.float64)) * total
    i = int(torch.searchsorted(cdf, v, right=True))
    if i >= cdf.shape[0]:  # u * total rounded up to total: take the last token with mass
        i = int((probs > 0).nonzero()[-1, 0])
    return i


def target_token(target_probs: torch.Tensor, sample_probs: torch.Tensor | None, row: int, greedy: bool,
                 generator: torch.Generator | None) -> int:
    """The token the target itself contributes at ``row``, for the likelihood-judging verifiers
    (consultant, typical): its argmax when greedy, else a draw from the warped row (``sample_probs``),
    or from the raw row when no warped one was given."""
    if greedy:
        return int(target_probs[row].argmax())
    return sample_from((sample_probs if sample_probs is not None else target_probs)[row], generator)
