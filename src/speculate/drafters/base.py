"""The drafter interface.

A drafter proposes up to k tokens that continue the committed sequence, with the distributions they
were drawn from, and learns the verifier's verdict through :meth:`update` (so it can roll back its own
state). The engine never special-cases a drafter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import Sampling


@dataclass
class Draft:
    tokens: torch.Tensor  # LongTensor [m], m <= k (m = 0: nothing to propose this round)
    probs: torch.Tensor | None = None  # p_draft rows [m, V]; None means one-hot on `tokens`

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


class Drafter:
    name = "base"

    def begin(self, prompt_ids: list[int], sampling: Sampling, generator: torch.Generator) -> None:
        """Start a new generation (reset any state)."""
        self.sampling, self.generator = sampling, generator

    def propose(self, tokens: list[int], k: int) -> Draft:
        """Up to k tokens continuing ``tokens`` (prompt + everything committed so far)."""
        raise NotImplementedError

    def update(self, n_accepted: int, next_token: int) -> None:
        """The verdict on the last proposal: its first ``n_accepted`` tokens were kept, then
        ``next_token`` was appended by the target."""


EMPTY = torch.empty(0, dtype=torch.long)
