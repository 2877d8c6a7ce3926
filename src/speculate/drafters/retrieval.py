"""Prompt lookup, and where the context offers no match, the target's own past answers (``retrieval``).

Prompt lookup (drafters/lookup.py) drafts only what the context repeats. Where it has no match of at least
``min_context`` tokens, this drafter asks an n-gram table of the target's own greedy answers to other
prompts (drafters/answer_store.py; REST, He et al. 2024, drafts from such a datastore): the token that
most often followed the last 4..2 tokens there, then the one after that, up to k tokens, while the
longest matching n-gram's top continuation had at least ``min_share`` of what followed it. A small chat
model answers in set phrases ("To find the total number of", "Here are some tips to"), so what it wrote
before predicts what it writes next, for the cost of a few dictionary look-ups. The drafts are certain
(one-hot p_draft) and depend only on committed tokens: greedy output stays the target's and sampling
stays lossless (Leviathan et al. 2023).

The settings (``min_context`` = 2, n-grams of 2-4 tokens kept when their top continuation was seen at
least twice, ``min_share`` = 0.5) were chosen by replaying plain int8 decoding's answers to held-out
prompts (MT-Bench 41-60, GSM8K test 101-120: neither in the store nor in the benchmark) against the
shipped store with the int8 cost curve; docs/benchmarks.md, "Retrieval", has the measurement.
"""

from __future__ import annotations

import torch

from ..errors import SpeculateError
from .answer_store import find_store
from ..params import Param
from .base import TARGET, Draft
from .lookup import MAX_COPY, LookupDrafter

MIN_N, MAX_N, MIN_COUNT = 2, 4, 2  # the table's n-grams and how often a continuation must have been seen


class RetrievalDrafter(LookupDrafter):
    name = "retrieval"
    summary = "prompt lookup, then an n-gram table of the target's own past answers (its answer store)"
    rank = 2
    needs = (TARGET,)
    params = (Param("store", None, "an answer store, file or folder (default: the one shipped for the target)",
                    value_type=str),
              Param("min_context", 2, "the shortest context match that lookup drafts from instead of the store"),
              Param("min_share", 0.5, "the store drafts a token that followed its n-gram at least this often (0-1)"),
              *LookupDrafter.params)

    def __init__(self, target, store: str | None = None, min_context: int = 2, min_share: float = 0.5,
                 max_ngram: int = 3, min_ngram: int = 1, max_copy: int = MAX_COPY):
        """``store``: an answer store (file or folder; default: the one shipped for the target);
        ``min_context``: the shortest context match that lookup drafts from instead of the store;
        ``min_share``: the store drafts a token only when it followed the matched n-gram at least this
        often (0-1); ``max_ngram``, ``min_ngram`` and ``max_copy``: lookup's (drafters/lookup.py)."""
        super().__init__(max_ngram=max_ngram, min_ngram=min_ngram, max_copy=max_copy)
        if not min_ngram <= min_context <= max_ngram + 1:
            raise SpeculateError(f"retrieval: min_context must be {min_ngram}..{max_ngram + 1} (above max_ngram: "
                                 f"never lookup before the store), got {min_context}")
        if not 0.0 <= min_share <= 1.0:
            raise SpeculateError(f"retrieval: min_share must be in [0, 1], got {min_share}")
        if target is None:
            raise SpeculateError("drafter 'retrieval' needs the target model (to find its answer store)")
        self.store = find_store(target, store, max_n=MAX_N, min_count=MIN_COUNT, min_n=MIN_N)
        self.min_context, self.min_share, self.min_n = min_context, min_share, MIN_N
        self.from_store = 0  # rounds the store drafted in the last generation (the rest: lookup or nothing)

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.from_store = 0

    def elsewhere(self, tokens):
        chain = self.store.chain(tokens, 1, self.min_n, self.min_share)
        return chain[0] if chain else None

    def draft_elsewhere(self, tokens, k):
        chain = self.store.chain(tokens, k, self.min_n, self.min_share)
        if not chain:
            return None
        self.from_store += 1
        return Draft(torch.tensor(chain, dtype=torch.long))
