"""A draft model that lets prompt lookup draft for it where the context says what comes next
(``model+lookup``).

Why: with a draft model the round's cost is T(k+1)/T(1) for the target plus k·c for the draft's k forwards (c ≈
0.36-0.42 for Qwen2.5-Coder-0.5B drafting for 1.5B on these CPUs, docs/benchmarks.md, "Prompt lookup beside the
draft model"), and the draft is the larger share. Much of what a coding or rewriting model writes is a copy of
its context (a HumanEval answer restates the function's signature and docstring; a GSM8K answer repeats the
question's numbers and names), and there prompt lookup (drafters/lookup.py) drafts as well as the model does,
for nothing. So each round this drafter asks lookup first: when the last ``min_match`` tokens occurred earlier
in the context, lookup's copy of what followed them is the draft (up to ``lookup_k`` tokens, one-hot p_draft)
and the draft model does not run; otherwise the draft model drafts k tokens as ``model`` does.

Unlike ``eagle+lookup`` (drafters/with_lookup.py) nothing is merged: a round's draft is one chain, from
one of the two, so every chain verifier applies unchanged, and speculative sampling stays lossless
(Leviathan et al. 2023: any draft distribution — here a one-hot row or the draft model's warped row,
chosen from the committed tokens alone — gives exactly p_target). The draft model skips the rounds lookup
drafts; at its next round it feeds the committed tokens it has not seen in one forward, as it does after
every round anyway (drafters/model.py).

Measured (docs/benchmarks.md, "Prompt lookup beside the draft model", Qwen pair, int8, 2 threads): 2.11× plain
decoding on HumanEval with k = 6 and copies of up to 10 tokens, against 1.47× for the draft model alone; no gain
on GSM8K (1.28× against 1.25×), where lookup's copies run past what the answer repeats. Copies longer than k
pay: a restated docstring line is accepted whole, and lookup drafts it for nothing.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import SpeculateError
from ..params import Param
from .base import DRAFT_MODEL, Composite, Drafter
from .lookup import MAX_COPY, LookupDrafter
from .model import ModelDrafter


MAX_MATCH = 8  # the longest match min_match may ask for (lookup indexes every n-gram up to it)


class ModelWithLookup(Composite):
    name = "model+lookup"
    parts = ("drafter", "lookup")  # (the draft model's drafter first: Composite)
    summary = "lookup drafts the rounds whose last tokens occurred before, the draft model the others"
    rank = 5
    needs = (DRAFT_MODEL,)
    params = (Param("min_match", 3, "the n-gram (1-8) whose earlier occurrence lets lookup draft the round"),
              Param("lookup_k", 10, "how many tokens lookup copies then"),
              Param("max_copy", MAX_COPY, "lookup's: how long a copy may grow while copies are accepted whole"))

    def __init__(self, draft_model, target_model=None, min_match: int = 3, lookup_k: int | None = 10,
                 max_copy: int = MAX_COPY):
        """``min_match``: the n-gram length (1-8) whose earlier occurrence lets lookup draft the round;
        ``lookup_k``: how many tokens lookup copies then (None: the round's k); ``max_copy``: copies
        accepted whole double the next one's length up to this (drafters/lookup.py). 10 and 3: on held-out
        samples (HumanEval and GSM8K 20-27, docs/benchmarks.md, "Prompt lookup beside the draft model") copies
        of 16 tokens and matches of 2 were no faster, and copies capped at k = 6 were slower on the benchmark's
        samples."""
        if not 1 <= min_match <= MAX_MATCH:
            raise SpeculateError(f"model+lookup: min_match must be 1..{MAX_MATCH}, got {min_match}")
        self.lookup = LookupDrafter(max_ngram=max(3, min_match), max_copy=max_copy)  # lookup's default reaches 3
        if lookup_k is not None and lookup_k < 1:
            raise SpeculateError(f"model+lookup: lookup_k must be >= 1, got {lookup_k}")
        self.drafter = ModelDrafter(draft_model, target_model)
        self.model = draft_model  # read by --k auto for the draft's cost ratio c
        self.min_match, self.lookup_k = min_match, lookup_k
        self.copied = False  # whether lookup drafted the last round

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.drafter.begin(prompt_ids, sampling, generator)
        self.lookup.begin(prompt_ids, sampling, generator)

    def relative_cost(self):
        return None  # the draft model's, measured with the target (lookup's rounds cost nothing to draft)

    def cache_bytes(self) -> int:
        return self.drafter.cache_bytes()

    def max_nodes(self, k):
        return max(k, self.lookup.max_nodes(self.lookup_k or k))

    def propose(self, tokens, k):
        found = self.lookup.match(tokens) if k else None
        self.copied = found is not None and found[0] >= self.min_match
        if self.copied:  # a copy's length is lookup's own (not k): --k auto learns nothing from it
            return replace(self.lookup.copy(tokens, found[1], self.lookup_k or k), from_k=False)
        return self.drafter.propose(tokens, k)

    def update(self, n_accepted, next_token):
        # The draft model rolls back its own drafts; after a copy it has nothing to undo, and lookup
        # learns how its copy went.
        (self.lookup if self.copied else self.drafter).update(n_accepted, next_token)
