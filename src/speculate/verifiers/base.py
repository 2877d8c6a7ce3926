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


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from a 1-D distribution (need not be normalised)."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def uniform(n: int, generator: torch.Generator | None, dtype=torch.float32) -> torch.Tensor:
    """n draws of U[0, 1) from the shared generator (CPU, so seeded runs reproduce anywhere)."""
    return torch.rand(n, generator=generator, dtype=dtype)
