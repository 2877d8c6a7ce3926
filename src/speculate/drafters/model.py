"""An independent draft model that shares the target's tokenizer, with its own KV cache.

Each proposal feeds the committed tokens the draft model has not seen yet (the whole prompt at the
first round, then one or two tokens), then drafts k tokens autoregressively, each drawn from the
draft's logits warped exactly like the target's (SamplingParams), whose rows are returned as p_draft.
After the verdict its cache is rolled back to the accepted prefix. The draft model's prompt blocks come from the
prefix store where a generation computed them before, and its blocks go there (:class:`OwnCache`).
"""

from __future__ import annotations

import copy
import weakref

import torch

from ..errors import SpeculateError
from ..grammar import Constraint
from ..models.kv import KVModel, Rows, forward_many
from ..sampling import argmax, warp
from ..verifiers.base import sample_from
from .base import DRAFT_MODEL, Draft, Drafter


class OwnCache:
    """What the drafters with a model of their own share (``self.model``, ``self.kv``): a KV cache per generation (a
    fork gets a new one), started with the blocks of the prompt that any generation stored in the prefix store, and
    its full blocks of committed tokens added there as they fill and at the end (the next turn of a chat finds them)."""

    store = None

    def fork(self):
        twin = copy.copy(self)
        twin.kv = KVModel(self.model)
        return twin

    def use_store(self, store) -> None:
        self.store = store

    def cache_bytes(self) -> int:
        return self.kv.own_bytes  # (blocks mapped from the prefix store are the store's)

    def _start_cache(self, prompt_ids: list[int]) -> None:
        """The cache reset for a generation of ``prompt_ids``, holding the stored blocks of its prefix: never its last
        token, so the first proposal feeds at least one."""
        self.kv.reset(len(prompt_ids) + 256)
        if self.store is not None:
            self.store.fill(self.kv, prompt_ids[:-1], count=False)  # (the hit rate is the target's)
        self.stored = self.kv.length

    def _add_blocks(self, tokens: list[int], force: bool = False) -> None:
        """Store the cache's full blocks of ``tokens`` (committed: the cache's positions below ``len(tokens)`` hold
        them), when a block filled since the last time (``force``: the generation's end)."""
        block = self.store.block if self.store is not None else 0
        if block and (force or self.kv.length // block > self.stored // block):
            self.store.add(self.kv, tokens, tail=force)
            self.stored = self.kv.length

    def end(self, tokens: list[int]) -> None:
        self._add_blocks(tokens, force=True)


class ModelDrafter(OwnCache, Drafter):
    name = "model"
    summary = "an independent draft model sharing the target's tokenizer (--draft-model), with its own KV cache"
    rank = 3
    needs = (DRAFT_MODEL,)

    def __init__(self, draft_model, target_model=None):
        if target_model is not None:
            check_same_tokenizer(draft_model.tokenizer, target_model.tokenizer)
        self.model = draft_model  # read by --k auto for the draft's cost ratio c
        self.kv = KVModel(draft_model)
        self.constraint, self.followed = None, 0

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self._start_cache(prompt_ids)
        # Structured output: the draft follows the generation's grammar too (its own copy, kept at the committed
        # tokens), so its drafts are never cut for a forbidden token and its p_draft rows are what it drew from.
        self.constraint = Constraint(self.model.tokenizer, sampling.grammar) if sampling.grammar else None
        self.followed = len(prompt_ids)  # the committed tokens the constraint has consumed (prompt excluded)

    def relative_cost(self):
        return None  # measured with the target: the draft model's forwards have their own fixed costs

    def propose(self, tokens, k):
        return self.propose_many([self], [tokens], [k])[0]

    @classmethod
    @torch.inference_mode()
    def propose_many(cls, drafters, histories, ks):
        """Several generations' drafts, their draft models' forwards batched: at each depth ONE forward of the draft
        model runs every generation still drafting (models/kv.py, forward_many: its rows of each cache). At int8 and
        q4 a row's bits do not depend on the others, so each generation drafts what it would alone."""
        unseen, drafted, ks = [], [[] for _ in drafters], list(ks)
        for d, tokens in zip(drafters, histories):
            d.base = len(tokens)  # update() keeps the cache up to here plus what it accepts
            d._add_blocks(tokens)  # (the cache holds committed tokens only, until this round's drafts)
            unseen.append(torch.tensor(tokens[d.kv.length:], dtype=torch.long))
            if d.constraint is not None:  # the tokens committed since the last round
                for token in tokens[d.followed:]:
                    d.constraint.consume(token)
                d.followed = len(tokens)
        for depth in range(max(ks, default=0)):
            active = [i for i, k in enumerate(ks) if depth < k]
            logits = forward_many([Rows(drafters[i].kv, unseen[i], want=1) for i in active])
            for i, row in zip(active, logits):
                d = drafters[i]
                if d.constraint is not None:
                    if d.constraint.ended:  # nothing may follow: no more drafts
                        ks[i] = depth
                        continue
                    row = row.clone()
                    d.constraint.mask(row, [[]])  # what the grammar allows after the drafts so far
                probs = warp(row, d.sampling)
                token = (argmax(probs) if d.sampling.greedy
                         else torch.tensor([sample_from(probs[0], d.generator)]))
                drafted[i].append((token, probs))
                unseen[i] = token
                if d.constraint is not None:
                    d.constraint.consume(int(token))
        for d, out in zip(drafters, drafted):  # the drafts were the constraint's only for the drafting
            if d.constraint is not None and out:
                d.constraint.rollback(len(out))
        # The last drafted token was never fed: each cache holds prefix + first k-1 drafts. (k = 0, the budget's last
        # token: nothing drafted, and update keeps the cache as it is.)
        return [Draft(torch.cat([t for t, _ in out]), torch.cat([p for _, p in out])) if out
                else Draft(torch.empty(0, dtype=torch.long)) for out in drafted]

    def update(self, n_accepted, next_token):
        # Keep the prefix and the accepted drafts that are in the cache (at most k-1 of them).
        self.kv.keep(min(self.kv.length, self.base + n_accepted))


_SAME: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft tokenizer -> the target tokenizers it equals


def check_same_tokenizer(draft_tok, target_tok) -> None:
    """Refuse a draft model whose tokenizer maps text to other ids: its drafts would be nonsense. Comparing two
    150k-token vocabularies takes ~0.25 s, and a server builds a decoder per settings: a pair found the same is
    remembered for as long as both tokenizers live."""
    if target_tok in _SAME.get(draft_tok, ()):
        return
    if draft_tok.get_vocab() != target_tok.get_vocab() or draft_tok.all_special_ids != target_tok.all_special_ids:
        raise SpeculateError("the draft model's tokenizer differs from the target's; a draft model must share "
                             "the target's tokenizer")
    _SAME.setdefault(draft_tok, weakref.WeakSet()).add(target_tok)
