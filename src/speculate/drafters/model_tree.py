"""A draft model that proposes a TREE: a few alternatives where the draft is unsure, then chains.

Shape (static, like Medusa's sparse trees, described by two numbers): every node at depth
< ``spread`` gets ``branch`` children, every deeper node one child, down to depth k. The default
(``branch=2, spread=1``) is two alternatives for the first token, each continued greedily / by
sampling into a chain: 2k nodes. In general the tree has sum_{d=1..k} branch^min(d, spread) nodes
(:meth:`ModelTreeDrafter.max_nodes`).

Children: under greedy decoding the draft's top-``branch`` tokens (by logit); when sampling,
``branch`` tokens drawn WITHOUT replacement from the draft's warped distribution (the same
``SamplingParams`` warp as the target's), in draw order, so that ``tree_sample(replacement=False)`` is
lossless; fewer when the warped row has fewer tokens with mass. Each node's p_draft row is the
distribution it was drawn from, its parent's row, one tensor shared by the siblings.

Forwards: one per tree level, not one per node. A tree forward's ``tree_parents`` can only point
inside that forward (the cached prefix is seen whole), so level d re-feeds the tree down to depth d
with its mask, after the committed tokens the draft has not seen yet (as a chain at the head of the
first forward); the draft cache is rolled back to the committed prefix between levels. k forwards
a round, as for the chain drafter ``model``, of up to max_nodes(k-1) + a few tokens each. After the
verdict the draft cache keeps the committed prefix and the accepted path's nodes it holds
(``keep_path``); the deepest level is never fed (its tokens are only proposed).
"""

from __future__ import annotations

import torch

from ..errors import SpeculateError
from ..models.kv import KVModel
from ..sampling import warp
from ..verifiers.base import sample_from
from ..params import Param
from .base import DRAFT_MODEL, Draft, Drafter
from .model import OwnCache, check_same_tokenizer


class ModelTreeDrafter(OwnCache, Drafter):
    name = "model-tree"
    summary = "the draft model drafting a tree, alternatives near the root, then chains"
    rank = 4
    needs = (DRAFT_MODEL,)
    params = (Param("branch", 2, "children of each node above depth spread"),
              Param("spread", 1, "how deep the tree branches (below: chains)"))
    tree = True

    def __init__(self, draft_model, target_model=None, branch: int = 2, spread: int = 1):
        if not isinstance(branch, int) or branch < 1:
            raise SpeculateError(f"model-tree: branch must be an integer >= 1, got {branch}")
        if not isinstance(spread, int) or spread < 0:
            raise SpeculateError(f"model-tree: spread must be an integer >= 0, got {spread}")
        if target_model is not None:
            check_same_tokenizer(draft_model.tokenizer, target_model.tokenizer)
        self.branch, self.spread = branch, spread
        self.model = draft_model  # read by --k auto for the draft's cost ratio c
        self.kv = KVModel(draft_model)

    def max_nodes(self, k: int) -> int:
        return sum(self.branch ** min(d, self.spread) for d in range(1, k + 1))

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self._start_cache(prompt_ids)
        self.base, self.fed = len(prompt_ids), 0

    def _children(self, logits: torch.Tensor, probs: torch.Tensor, count: int) -> list[int]:
        """``count`` child tokens of a node (fewer if its warped row has fewer with mass)."""
        if self.sampling.greedy:
            return logits.topk(min(count, logits.shape[-1])).indices.tolist()
        row = probs.to(torch.float64).clone()
        drawn = []
        for _ in range(min(count, int((row > 0).sum()))):
            token = sample_from(row, self.generator)  # without replacement: zero it, draw again
            drawn.append(token)
            row[token] = 0.0
        return drawn

    @torch.inference_mode()
    def propose(self, tokens, k):
        self.base, self.fed = len(tokens), 0
        self._add_blocks(tokens)  # (the cache holds committed tokens only, until this round's tree)
        if k == 0:
            return Draft(torch.empty(0, dtype=torch.long), None, [])
        unseen = tokens[self.kv.length:]  # at least the last committed token (never fed before)
        nodes: list[int] = []  # node tokens, level by level (a parent's index is below its children's)
        parents: list[int] = []
        rows: list[torch.Tensor] = []  # node i's p_draft row: the row it was drawn from
        level_logits = self.kv.forward(torch.tensor(unseen, dtype=torch.long), last=1)  # after the last committed
        level = [-1]  # the nodes whose children are drawn next (-1: the root)
        for depth in range(1, k + 1):
            width = self.branch if depth <= self.spread else 1
            next_level = []
            for row, node in enumerate(level):
                probs = warp(level_logits[row: row + 1], self.sampling)[0]
                for token in self._children(level_logits[row], probs, width):
                    next_level.append(len(nodes))
                    nodes.append(token)
                    parents.append(node)
                    rows.append(probs)  # the siblings share this one tensor
            level = next_level
            if depth == k:
                break
            # Feed the tree down to this depth under its mask; keep the rows of this level's nodes.
            self.kv.keep(len(tokens))
            self.fed = len(nodes)
            level_logits = self.kv.forward(torch.tensor(nodes, dtype=torch.long), tree_parents=parents)[level]
        return Draft(torch.tensor(nodes, dtype=torch.long), torch.stack(rows), parents)

    def update(self, n_accepted, next_token, path=None):
        if path is None:  # a chain verdict (not expected from this drafter): its first n nodes
            path = list(range(n_accepted))
        # The cache holds the committed prefix, then the first `fed` nodes (all but the deepest level).
        kept = [node for node in path if node < self.fed]
        if kept:
            self.kv.keep_path(self.base, kept)
        else:  # nothing of the tree to keep (or nothing was fed: a k = 0 round)
            self.kv.keep(min(self.kv.length, self.base))
