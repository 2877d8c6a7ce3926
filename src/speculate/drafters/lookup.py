"""Prompt lookup (Saxena 2023; HF ``prompt_lookup_num_tokens``): copy what followed an earlier
occurrence of the context's last n tokens.

For n from ``max_ngram`` down to ``min_ngram``, find the most recent earlier occurrence of the last n
tokens in prompt + output and propose the tokens that followed it. The draft is certain: p_draft is
one-hot. How many tokens: a match of the full ``max_ngram`` tokens proposes k; a shorter match of n
tokens proposes min(k, 2^(n-1)) (1, 2, 4, ...). A one-token match is a weak hint, and on these CPUs a
target forward over 4 tokens at fp32 costs ~1.6x one over 1 and 3 tokens ~1.2x (docs/benchmarks.md,
"Verification cost T(n)"), so a long draft on a weak match mostly buys a slower round; measured on the
benchmark prompts this beats a fixed k. An index from each n-gram to where its latest occurrence was
followed is kept up to date as tokens arrive, so a proposal costs O(max_ngram) dictionary look-ups, not a
scan of the context.

Copies that grow (``max_copy``): a generation that copies a passage verbatim accepts every full-match copy
whole, and then each round of k tokens leaves speed on the table (at int8 a 16-row verification costs
1.9 times a 1-row one, docs/benchmarks.md, "Step cost"), while a generation that rewrites what it read
rejects long copies early. So each full-match copy accepted whole doubles the next one's length, up to
``max_copy`` (32; 0 turns growing off), and the first rejection returns it to k (the shape of Hugging
Face's "heuristic" assistant-length schedule, which adds 2 after a full acceptance and takes 1 away after a
miss; doubling reaches a long copy in a few rounds). The schedule reads only the verdicts on earlier
rounds, so it changes nothing about what is accepted: greedy output stays the target's, and sampling stays
lossless. Measured (docs/benchmarks.md, "Copies that grow" and "Prompt lookup beside the draft model"):
SmolLM2 repeating a paragraph verbatim 3.8× → 5.5× plain decoding (int8); over the copy prompts +9 %, the
Qwen pair on HumanEval +3 % (τ 7.0 → 8.7); where copies are seldom accepted whole (MT-Bench, GSM8K) it
rarely triggers and costs nothing measurable.
"""

from __future__ import annotations

import torch

from ..errors import SpeculateError
from ..params import Param
from .base import EMPTY, Draft, Drafter

MAX_COPY = 32  # the default cap on a grown copy (64 measured within noise of it, and verifies more wasted rows)


class LookupDrafter(Drafter):
    name = "lookup"
    summary = "prompt lookup, a copy of what followed an earlier occurrence of the last tokens"
    rank = 1
    params = (Param("max_ngram", 3, "the longest n-gram matched (a full match copies k tokens)"),
              Param("min_ngram", 1, "the shortest n-gram matched"),
              Param("max_copy", MAX_COPY, "how long a copy may grow while copies are accepted whole (0: k)"))

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, max_copy: int = MAX_COPY):
        """``max_copy``: how long a full-match copy may grow while copies are accepted whole (0, or anything
        up to k: copies stay k long)."""
        if not 1 <= min_ngram <= max_ngram:
            raise SpeculateError(f"lookup: need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        if max_copy < 0:
            raise SpeculateError(f"lookup: max_copy must be >= 0 (0: copies do not grow), got {max_copy}")
        self.max_ngram, self.min_ngram, self.max_copy = max_ngram, min_ngram, max_copy

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.index: dict[tuple[int, ...], int] = {}  # n-gram → position right after its latest occurrence
        self.indexed = 0  # n-grams ending before this position are in the index
        self.growth = 1  # the next full-match copy is growth · k long (at most max_copy)
        self.copied = 0  # the length of the last proposal when it was such a copy, else 0

    #: A context match shorter than this drafts from the subclass's other source first (:meth:`elsewhere`).
    min_context = 0

    def max_nodes(self, k):
        return max(k, self.max_copy)

    def peek(self, tokens):
        """What :meth:`propose` would draft first: the other source's token where the context match is weak, else the
        match's continuation. (Indexing new n-grams is no change of behaviour: a proposal would index them too.)"""
        found = self.match(tokens)
        if found is None or found[0] < self.min_context:
            first = self.elsewhere(tokens)
            if first is not None:
                return first
        return None if found is None else tokens[found[1]]

    def elsewhere(self, tokens) -> int | None:
        """The first token the subclass's other source (an answer store, the served index) drafts after ``tokens``,
        without counting it as a lookup; None: nothing (prompt lookup alone has no other source)."""
        return None

    def draft_elsewhere(self, tokens, k: int) -> Draft | None:
        """The subclass's other source's draft of depth ``k`` (k >= 1) after ``tokens``, counted as one of its drafts;
        None: nothing there, the context match drafts."""
        return None

    def propose(self, tokens, k):
        self.copied = 0
        if not k:  # (a round planned no draft: nothing to look up; its peek has matched already, engine._propose)
            return Draft(EMPTY)
        found = self.match(tokens)
        if found is None or found[0] < self.min_context:
            draft = self.draft_elsewhere(tokens, k)
            if draft is not None:
                return draft
        return self.from_match(tokens, k, found)

    def from_match(self, tokens, k, found) -> Draft:
        """The draft for :meth:`match`'s answer ``found``: a copy (growing) on a full match, else
        min(k, 2^(n-1)) tokens; nothing without a match."""
        if found is None:
            return Draft(EMPTY)
        n, start = found
        if n == self.max_ngram:
            return self.copy(tokens, start, k)
        return Draft(torch.tensor(tokens[start: start + min(k, 2 ** (n - 1))], dtype=torch.long))

    def copy(self, tokens, start: int, length: int) -> Draft:
        """The draft copying what followed position ``start``: ``length`` tokens, or more while copies are
        accepted whole (``max_copy``). :meth:`update` then learns how it went."""
        length = max(length, min(length * self.growth, self.max_copy))
        chain = tokens[start: start + length]
        self.copied = len(chain)
        return Draft(torch.tensor(chain, dtype=torch.long))

    def update(self, n_accepted, next_token, path=None):
        if self.copied:  # a copy accepted whole earns a longer next copy; the first rejection ends that
            self.growth = 2 * self.growth if n_accepted == self.copied else 1

    def match(self, tokens) -> tuple[int, int] | None:
        """(n, start): the longest n-gram (``max_ngram`` down to ``min_ngram``) ending ``tokens`` that
        occurred before, and where its latest earlier occurrence was followed; None when none did."""
        # Index every n-gram that ends before the last token (its continuation exists); the n-grams
        # ending at the last token are the query and would only match themselves.
        for end in range(self.indexed, len(tokens) - 1):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                self.index[tuple(tokens[end - n + 1: end + 1])] = end + 1
        self.indexed = max(self.indexed, len(tokens) - 1)
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            start = self.index.get(tuple(tokens[-n:]))
            if start is not None:
                return n, start
        return None
