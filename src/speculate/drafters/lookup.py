"""Prompt lookup (Saxena 2023; HF ``prompt_lookup_num_tokens``): copy what followed an earlier
occurrence of the context's last n tokens.

For n from ``max_ngram`` down to ``min_ngram``, find the most recent earlier occurrence of the last n
tokens in prompt + output and propose the tokens that followed it. The draft is certain: p_draft is
one-hot. How many tokens: a match of the full ``max_ngram`` tokens proposes k; a shorter match of n
tokens proposes min(k, 2^(n-1)) (1, 2, 4, ...). A one-token match is a weak hint, and on these CPUs a
target forward over 4+ tokens costs ~1.8x one over 1-3 (docs/benchmarks.md), so a long draft on a weak
match mostly buys a slower round; measured on the benchmark prompts this beats a fixed k. An index from each n-gram to where its latest occurrence was followed is kept up to
date as tokens arrive, so a proposal costs O(max_ngram) dictionary look-ups, not a scan of the context.
"""

from __future__ import annotations

import torch

from ..errors import SpeculateError
from .base import EMPTY, Draft, Drafter


class LookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SpeculateError(f"lookup: need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.index: dict[tuple[int, ...], int] = {}  # n-gram → position right after its latest occurrence
        self.indexed = 0  # n-grams ending before this position are in the index

    def propose(self, tokens, k):
        found = self.match(tokens)
        if found is None:
            return Draft(EMPTY)
        n, start = found
        length = k if n == self.max_ngram else min(k, 2 ** (n - 1))
        return Draft(torch.tensor(tokens[start: start + length], dtype=torch.long))

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
