"""Medusa heads as a drafter (Cai et al. 2024): K heads on the target's last hidden row, each
guessing one token further ahead, decoded through the target's own LM head (heads/medusa.py).

The engine hands the drafter the hidden rows of newly committed positions (``observe``); the last one
is the row whose LM-head output predicted the current last committed token, so head i proposes the
token i+1 positions past it. No state to roll back: the next rows come with the next verdict.

Chain (default): draft j is drawn from head j-1's row (argmax when greedy; sampled from the warped
row otherwise, and that row is returned as p_draft, so the ``sample`` verifier stays lossless).
Tree (``tree=True`` or a list of Medusa "choices", each a path of ranks, e.g. ``(0, 1)`` = the
second-ranked token of head 1 under the top token of head 0): a static sparse candidate tree verified
in one target forward. Greedy: ranks are the heads' top-k. Sampling: each node's children are drawn
WITHOUT replacement from its depth's warped head row (lossless with ``tree_sample``).
"""

from __future__ import annotations

from functools import partial

import torch

from ..heads.io import HEADS, drafting_parts
from ..heads.medusa import expand_rows
from ..sampling import argmax, warp
from .base import EMPTY, TARGET, Draft, Drafter, Variant
from .with_lookup import LOOKUP, base_k, merged

# A sparse tree of 12 nodes, 4 deep: the top token of head 0 is expanded most (Medusa's trees
# put most nodes under the top-1 path too); sized for a CPU, where a forward over 13 tokens costs
# ~2× one over 1.
DEFAULT_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
                (0, 0, 0, 0))


class MedusaDrafter(Drafter):
    name = "medusa"
    summary = "Medusa heads trained on the target's hidden rows (shipped for the default model), a static tree"
    rank = 6
    needs = (TARGET,)
    params = (HEADS,)
    variants = (Variant("tree", True, "draft the static candidate tree (false: a chain)", suffix="-chain"), LOOKUP)
    wants_hidden = True
    observes_prompt = False  # (the heads read the last row only: observe keeps hidden[-1:])

    @classmethod
    def options(cls, tree=True, lookup=False):
        # Beside lookup (``python -m speculate.bench.trees``; docs/benchmarks.md, "The heads with prompt lookup
        # merged in") the chain drafts at most 2 deep; the tree is at most its 4 heads deep, so it keeps it whole.
        return cls.params + ((base_k(None if tree else 2),) if lookup else ())

    @classmethod
    def build(cls, target, draft_model=None, tree=True, lookup=False, **options):
        return merged(partial(cls, target, tree=tree), lookup, cls.variant_name(tree=tree, lookup=True), options)

    def __init__(self, target, heads=None, tree=None):
        """``target``: the LoadedModel; ``heads``: a folder (default: the heads shipped for it);
        ``tree``: None/False (chains), True (:data:`DEFAULT_TREE`) or a list of choices."""
        self.parts = parts = drafting_parts(target, "medusa", heads)
        self.heads, self.config, self.folder, self.lm, self.vocab = parts.heads, parts.config, parts.folder, \
            parts.lm, parts.vocab
        self.vocab_size = int(target.model.get_output_embeddings().out_features)
        self.choices = None
        if tree:
            self.choices = _check_choices(DEFAULT_TREE if tree is True else tree)
        self.tree = self.choices is not None
        self.last = None

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.last = None

    def observe(self, hidden: torch.Tensor) -> None:
        if hidden.shape[0]:
            self.last = self.parts.features(hidden[-1:])[0].clone()  # int8: unsmoothed

    def relative_cost(self):
        """All heads run in one product per round, whatever k is: per drafted token, that cost split over
        the heads (bound by the weights read, :func:`weight_bytes`)."""
        return self.parts.cost(self.heads, *[self.lm] * self.heads.n_heads) / self.heads.n_heads

    def max_nodes(self, k):
        depth = min(k, self.heads.n_heads)
        return sum(len(c) <= depth for c in self.choices) if self.tree else depth

    def _token(self, sub_index):
        return int(sub_index) if self.vocab is None else int(self.vocab[sub_index])

    @torch.inference_mode()
    def propose(self, tokens, k):
        depth = min(k, self.heads.n_heads)
        if depth <= 0 or self.last is None:
            return Draft(EMPTY)
        logits = self.lm(self.heads.features(self.last))[:depth]  # [depth, S]
        greedy = self.sampling.greedy
        if self.tree:
            return self._tree(logits, depth, greedy)
        if greedy:
            return Draft(torch.tensor([self._token(i) for i in argmax(logits).tolist()], dtype=torch.long))
        rows = warp(logits, self.sampling)
        drawn = [self._token(torch.multinomial(row, 1, generator=self.generator)) for row in rows]
        return Draft(torch.tensor(drawn, dtype=torch.long), expand_rows(rows, self.vocab, self.vocab_size))

    def _tree(self, logits, depth, greedy):
        choices = [c for c in self.choices if len(c) <= depth]
        width = max(c[-1] for c in choices) + 1
        rows = None if greedy else expand_rows(warp(logits, self.sampling), self.vocab, self.vocab_size)
        if greedy:
            ranked = logits.topk(min(width, logits.shape[-1]), dim=-1).indices  # the same for every parent
        index: dict[tuple, int] = {}  # choice → node index
        drawn: dict[tuple, list[int]] = {}  # parent choice → its children's tokens, by rank (sampling)
        tokens, parents, node_rows = [], [], []
        for c in choices:
            parent = c[:-1]
            if parent and parent not in index:  # its parent was not drawn (too few tokens in its row)
                continue
            d, rank = len(c) - 1, c[-1]
            if greedy:
                if rank >= ranked.shape[1]:
                    continue
                token = self._token(ranked[d, rank])
            else:
                if parent not in drawn:  # all of this parent's children at once, without replacement
                    row = rows[d]
                    n = min(width, int((row > 0).sum()))
                    drawn[parent] = torch.multinomial(row, n, replacement=False, generator=self.generator).tolist()
                if rank >= len(drawn[parent]):
                    continue
                token = drawn[parent][rank]
                node_rows.append(d)
            index[c] = len(tokens)
            tokens.append(token)
            parents.append(index[parent] if parent else -1)
        probs = None if greedy else rows[torch.tensor(node_rows, dtype=torch.long)]
        return Draft(torch.tensor(tokens, dtype=torch.long), probs, parents)


def _check_choices(choices) -> list[tuple]:
    """Medusa choices in topological order (shorter first); every prefix must be a choice itself and
    a parent's children must be ranked 0, 1, ... without gaps (sampling draws them in that order)."""
    out = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
    have = set(out)
    for c in out:
        if not c or min(c) < 0:
            raise ValueError(f"bad Medusa choice {c}")
        if len(c) > 1 and c[:-1] not in have:
            raise ValueError(f"Medusa choice {c} needs its parent {c[:-1]}")
        if c[-1] > 0 and c[:-1] + (c[-1] - 1,) not in have:
            raise ValueError(f"Medusa choice {c} needs its elder sibling {c[:-1] + (c[-1] - 1,)}")
    return out
