"""An EAGLE head as a drafter (Li et al. 2024; the dynamic tree of EAGLE-2, Li et al. 2024b).

The head (heads/eagle.py) continues the target's feature sequence: the engine hands over the
target's hidden rows of newly committed positions (``observe``), and each proposal first feeds the
pairs [embedding of token t+1, f_t] that the head has not seen yet into its own KV cache (real
features only: whatever it drafted before is overwritten), then drafts on its own predicted features.

Chain (default): k steps, each token the argmax / a sample of the warped LM-head row of the predicted
feature (that row is p_draft, so ``sample`` stays lossless).
Tree (``tree=True``, EAGLE-2): expand the ``topk`` nodes of highest cumulative draft log-probability
at each depth (one head forward for all of them, under a tree mask), give each its ``topk`` best
children, and finally keep the ``budget`` nodes of highest cumulative log-probability (a set closed
under ancestors: a child never scores above its parent). Reranking by draft confidence breaks the
lossless multi-candidate sampling rule, so trees are drafted for greedy decoding only; when sampling,
a tree drafter proposes chains.
"""

from __future__ import annotations

from functools import partial

import torch

from ..errors import SpeculateError
from ..heads.io import HEADS, drafting_parts
from ..heads.medusa import expand_rows
from ..params import Param
from ..sampling import argmax, warp
from .base import EMPTY, TARGET, Draft, Drafter, Variant
from .with_lookup import LOOKUP, base_k, merged

MIN_CONFIDENCE = "stop a chain where the head's top probability falls below this (0: never)"


class EagleDrafter(Drafter):
    name = "eagle"
    summary = "an EAGLE head trained on the target's hidden rows (shipped for the default model), EAGLE-2's tree"
    rank = 7
    needs = (TARGET,)
    params = (HEADS, Param("topk", 2, "nodes expanded per level, and children per node"),
              Param("budget", None, "nodes kept (default: 2·depth − 2, at least depth)", value_type=int),
              Param("depth", None, "the tree's depth cap (default: each round's k)", value_type=int),
              Param("min_confidence", 0.0, MIN_CONFIDENCE))
    # A chain has no tree to shape, and stops where the head is unsure, below 0.35: chosen on the tuning prompts of
    # `python -m speculate.bench.trees`, then faster on all six comparisons of the benchmark's samples too
    # (docs/benchmarks.md, "Confidence-gated chains").
    chain_params = (HEADS, Param("min_confidence", 0.35, MIN_CONFIDENCE))
    variants = (Variant("tree", True, "draft EAGLE-2's dynamic tree (false: a chain)", suffix="-chain"), LOOKUP)
    wants_hidden = True

    @classmethod
    def options(cls, tree=True, lookup=False):
        # Beside lookup the tree and the chain draft at most 2 deep, their fastest depth there (docs/benchmarks.md,
        # "The heads with prompt lookup merged in").
        return (cls.params if tree else cls.chain_params) + ((base_k(2),) if lookup else ())

    @classmethod
    def build(cls, target, draft_model=None, tree=True, lookup=False, **options):
        return merged(partial(cls, target, tree=tree), lookup, cls.variant_name(tree=tree, lookup=True), options)

    def __init__(self, target, heads=None, tree: bool = False, topk: int = 2, budget: int | None = None,
                 depth: int | None = None, min_confidence: float = 0.0):
        """``depth``: the tree's depth cap (None: each round's k); ``budget``: nodes kept (None: 2·depth − 2, at
        least depth: the best path and about one alternative per level); ``topk``: nodes expanded per level and
        children per node. The defaults are the fastest shapes of ``python -m speculate.bench.trees`` on this
        CPU (docs/benchmarks.md, "int8 targets, and what a tree costs"): small trees, as a 13-node verification
        costs ~2 plain steps here. ``min_confidence`` (chains): stop a chain where the head's top probability
        falls below it (0: never)."""
        self.parts = parts = drafting_parts(target, "eagle", heads)
        self.head, self.config, self.folder, self.lm, self.vocab = parts.heads, parts.config, parts.folder, \
            parts.lm, parts.vocab
        self.embed = target.model.get_input_embeddings().weight.detach()
        self.vocab_size = int(target.model.get_output_embeddings().out_features)
        if topk < 1 or (budget is not None and budget < 1) or (depth is not None and depth < 1):
            raise SpeculateError("eagle: topk, budget and depth must be >= 1")
        if not 0.0 <= min_confidence <= 1.0:
            raise SpeculateError("eagle: min_confidence must be in [0, 1]")
        self.tree, self.topk, self.budget, self.depth = bool(tree), topk, budget, depth
        self.min_confidence = float(min_confidence)
        self.hidden_size = self.head.hidden_size
        self.feature_layers = self.head.feature_layers
        self.width = self.hidden_size * (1 + len(self.feature_layers))  # of the rows observe() keeps

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.cache = self.head.new_cache(len(prompt_ids) + 256)
        self.feats = torch.empty(len(prompt_ids) + 256, self.width)
        self.n_feats = 0  # target features observed: positions 0..n_feats-1
        self.fed = 0  # pairs in the head's cache (real features only): positions 0..fed-1
        self.root = None  # the head's output at position fed-1: its predicted feature at position fed

    def observe(self, hidden: torch.Tensor) -> None:
        n = hidden.shape[0]
        if self.n_feats + n > self.feats.shape[0]:
            grown = torch.empty(max(2 * self.feats.shape[0], self.n_feats + n), self.width)
            grown[: self.n_feats] = self.feats[: self.n_feats]
            self.feats = grown
        self.feats[self.n_feats: self.n_feats + n] = self.parts.features(hidden)  # int8: unsmoothed
        self.n_feats += n

    def relative_cost(self):
        """One head step and one LM-head product over the drafting vocabulary per level, against a
        target step: bound by the weights they read (:func:`weight_bytes`)."""
        return self.parts.cost(self.head, self.lm)

    def max_nodes(self, k):
        return max(self._budget(k), k) if self.tree else k  # sampling: a tree drafter proposes chains

    def _budget(self, depth: int) -> int:
        return self.budget if self.budget is not None else max(2 * depth - 2, depth)

    def _emb(self, ids) -> torch.Tensor:
        return self.embed[torch.as_tensor(ids, dtype=torch.long)].float()

    def _token(self, sub_index) -> int:
        return int(sub_index) if self.vocab is None else int(self.vocab[sub_index])

    def _feed(self, tokens) -> bool:
        """Feed the pairs (f_p, token p+1) not yet in the cache; False when features are missing."""
        if len(tokens) != self.n_feats + 1 or self.n_feats == 0:
            return False
        if self.fed < self.n_feats:
            pos = torch.arange(self.fed, self.n_feats)
            out = self.head.step(self.cache, self._emb(tokens[self.fed + 1: self.n_feats + 1]),
                                 self.head.real_features(self.feats[self.fed: self.n_feats]), pos, pos, None)
            self.root, self.fed = out[-1], self.n_feats
        return self.root is not None

    @torch.inference_mode()
    def propose(self, tokens, k):
        if k <= 0 or not self._feed(tokens):
            return Draft(EMPTY)
        if self.tree and self.sampling.greedy:
            return self._tree(k if self.depth is None else min(k, self.depth))
        return self._chain(k)

    def _chain(self, k):
        """Up to k tokens, each from the head's row after the one before. With ``min_confidence`` the chain
        stops where the row's top probability is below it: EAGLE-2 observed that a draft's confidence
        tracks its acceptance rate, so an unsure token mostly buys a verification row and a head step
        for nothing. The decision reads the row before any draw, so sampling stays lossless (a node's
        existence does not depend on its own token)."""
        start, feat, drafted, rows = self.fed, self.root, [], []
        greedy = self.sampling.greedy
        for j in range(k):
            logits = self.lm(feat)[None]  # [1, S]
            row = None if greedy else warp(logits, self.sampling)
            if self.min_confidence and float((logits.softmax(-1) if greedy else row).max()) < self.min_confidence:
                break
            if greedy:
                token = self._token(argmax(logits))
            else:
                token = self._token(torch.multinomial(row[0], 1, generator=self.generator))
                rows.append(row)
            drafted.append(token)
            if j + 1 < k:  # the last drafted token is never fed
                pos = torch.tensor([start + j])
                feat = self.head.step(self.cache, self._emb([token]), feat[None], pos, pos, None)[0]
        if not drafted:
            return Draft(EMPTY)
        probs = None if greedy else expand_rows(torch.cat(rows), self.vocab, self.vocab_size)
        return Draft(torch.tensor(drafted, dtype=torch.long), probs)

    def _tree(self, depth):
        """EAGLE-2's dynamic tree (greedy): nodes as (token, parent, cumulative log-prob)."""
        start, topk = self.fed, self.topk
        toks, parents, scores = [], [], []
        logp = self.lm(self.root).log_softmax(-1)
        top = logp.topk(min(topk, logp.shape[-1]))
        for s, i in zip(top.values.tolist(), top.indices.tolist()):
            toks.append(self._token(i)), parents.append(-1), scores.append(s)
        frontier = list(range(len(toks)))
        out_of = {-1: self.root}  # node → the head's predicted feature after it
        slot_of: dict[int, int] = {}
        next_slot = start
        for d in range(2, depth + 1):
            # Feed the frontier (depth d-1 nodes) in one forward: each sees the real prefix and its ancestors.
            slots = list(range(next_slot, next_slot + len(frontier)))
            for node, slot in zip(frontier, slots):
                slot_of[node] = slot
            next_slot += len(frontier)
            allowed = torch.zeros(len(frontier), next_slot, dtype=torch.bool)
            allowed[:, :start] = True
            for row, node in enumerate(frontier):
                a = node
                while a >= 0:
                    allowed[row, slot_of[a]] = True
                    a = parents[a]
            feats = torch.stack([out_of[parents[node]] for node in frontier])
            pos = torch.full((len(frontier),), start + d - 2, dtype=torch.long)
            outs = self.head.step(self.cache, self._emb([toks[n] for n in frontier]), feats, pos,
                                  torch.tensor(slots), allowed)
            logp = self.lm(outs).log_softmax(-1)
            top = logp.topk(min(topk, logp.shape[-1]), dim=-1)
            new = []
            for row, node in enumerate(frontier):
                out_of[node] = outs[row]
                for s, i in zip(top.values[row].tolist(), top.indices[row].tolist()):
                    new.append(len(toks))
                    toks.append(self._token(i)), parents.append(node), scores.append(scores[node] + s)
            frontier = sorted(new, key=lambda n: (-scores[n], n))[:topk]
        # Rerank: the budget best nodes by cumulative log-prob (ties: earlier node first, so a parent
        # always precedes its equally scored child), then back into node (topological) order.
        keep = sorted(sorted(range(len(toks)), key=lambda n: (-scores[n], n))[: self._budget(depth)])
        new_index = {old: i for i, old in enumerate(keep)}
        return Draft(torch.tensor([toks[n] for n in keep], dtype=torch.long), None,
                     [-1 if parents[n] < 0 else new_index[parents[n]] for n in keep])
