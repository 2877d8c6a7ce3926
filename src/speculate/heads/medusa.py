"""Medusa heads (Cai et al. 2024): K residual blocks on the target's last hidden state, decoded through
the target's own frozen LM head.

Head i (0-based) maps the final-normed hidden row h_t — whose LM-head output predicts token t+1 — to
a row whose LM-head output predicts token t+2+i: head 0 drafts the token after the one the target is
about to commit, head 1 the one after that, and so on. Each head is ``n_layers`` residual blocks
``x ← x + SiLU(W x + b)``; W starts at zero (Medusa's init), so an untrained head repeats the target's
own next-token prediction.

``vocab``: optional FR-Spec subset (Zhao et al. 2025): the S most frequent token ids. The heads then
score only those rows of the LM head (S·H instead of V·H per row) and never draft another token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MedusaHeads(nn.Module):
    kind = "medusa"

    def __init__(self, hidden_size: int, n_heads: int = 4, n_layers: int = 1, vocab: torch.Tensor | None = None,
                 zero_init: bool = True):
        super().__init__()
        if n_heads < 1 or n_layers < 1:
            raise ValueError("MedusaHeads needs n_heads >= 1 and n_layers >= 1")
        self.hidden_size, self.n_heads, self.n_layers = hidden_size, n_heads, n_layers
        self.blocks = nn.ModuleList(
            nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(n_layers)) for _ in range(n_heads))
        if zero_init:
            for block in self.blocks:
                for lin in block:
                    nn.init.zeros_(lin.weight)
                    nn.init.zeros_(lin.bias)
        self.register_buffer("vocab", None if vocab is None else vocab.to(torch.long).clone())

    def config(self) -> dict:
        return {"kind": self.kind, "hidden_size": self.hidden_size, "n_heads": self.n_heads,
                "n_layers": self.n_layers, "vocab_subset": None if self.vocab is None else int(self.vocab.numel())}

    @classmethod
    def from_config(cls, cfg: dict, vocab: torch.Tensor | None = None) -> "MedusaHeads":
        return cls(cfg["hidden_size"], cfg["n_heads"], cfg["n_layers"], vocab, zero_init=False)

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] → [..., K, H]: each head's row, ready for the LM head."""
        outs = []
        for block in self.blocks:
            x = hidden
            for lin in block:
                x = x + F.silu(lin(x))
            outs.append(x)
        return torch.stack(outs, dim=-2)

    def logits(self, hidden: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
        """[..., H] → [..., K, S] logits over the drafting vocabulary (S = V, or the FR-Spec subset;
        ``lm_weight`` must already be :func:`subset_weight` of the target's LM head)."""
        return F.linear(self.features(hidden), lm_weight)


def subset_weight(lm_weight: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """The LM-head rows a head scores: all of them, or the FR-Spec subset's (a contiguous copy)."""
    return lm_weight if vocab is None else lm_weight.index_select(0, vocab).contiguous()


def expand_rows(rows: torch.Tensor, vocab: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[n, S] probabilities over the subset → [n, V] over the whole vocabulary (zeros outside it)."""
    if vocab is None:
        return rows
    out = torch.zeros(rows.shape[0], vocab_size, dtype=rows.dtype)
    return out.index_copy_(1, vocab, rows)
