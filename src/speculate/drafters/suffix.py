"""Drafts that learn from what this process has served (``suffix``): prompt lookup over the request's own context,
then an index of every answer the target has given here (SuffixDecoding, Oliaro et al. 2024, reduced to n-grams).

Traffic repeats itself more than a benchmark: the same JSON shapes, the same phrasings, the same questions asked
again. This drafter keeps, per target model and per scope, a :class:`ServedIndex`: for each n-gram (n = 2..``max_n``)
of the answers generated so far, how often each token followed it. Where the request's own context gives no match of
``min_context`` tokens (prompt lookup, drafters/lookup.py), it drafts from the index: the token that most often
followed the longest n-gram ending the context, then the one after that, while that token's share of what followed
is at least ``min_share``; a match of n tokens drafts at most ``alpha`` · n tokens (SuffixDecoding's
``max_spec = α · p``: a long match predicts further). When a generation ends, its answer goes into the index (the
first ``seed`` answers may come from the target's shipped answer store, drafters/answer_store.py, so a fresh process
drafts as ``retrieval`` does). At most ``max_tokens`` answer tokens are kept; the oldest answers go first.

Isolation: ``share`` false keeps a generation out of the index (it neither reads nor feeds it). ``scope`` names the
index: the server gives each API key a scope of its own (server/auth.py, ``tenant``), so one key's answers never
draft for another, unless started with ``--share-drafts`` (one index for all its clients). A draft never reveals text
to a client (the target verifies every token), but how fast an answer comes can hint that another client's answer
was similar: a timing side channel, as with any shared cache. Within a scope, use ``share: false`` where that
matters.

Drafts are certain (one-hot p_draft) and depend only on committed tokens and earlier answers: greedy output stays
the target's, sampling stays lossless.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import deque
from pathlib import Path

import torch

from ..errors import SpeculateError
from ..params import Param
from .answer_store import FILE, read_answers, shipped_store
from .base import TARGET, Draft, Variant
from .lookup import MAX_COPY, LookupDrafter

MAX_N = 6  # the longest n-gram of the index


class ServedIndex:
    """n-gram → counts of the tokens that followed it, over the answers added (oldest first out past ``max_tokens``).
    Ties between continuations go to the smaller token id, so a draft never depends on dict order."""

    def __init__(self, max_n: int = MAX_N, max_tokens: int = 200_000):
        if max_n < 2 or max_tokens < 1:
            raise SpeculateError("suffix: the index needs max_n >= 2 and max_tokens >= 1")
        self.max_n, self.max_tokens = max_n, max_tokens
        self.counts: dict[tuple[int, ...], dict[int, int]] = {}
        self.answers: deque[list[int]] = deque()
        self.tokens = 0
        self.lookups = self.hits = 0  # chain() calls, and those that drafted (the server's /metrics)
        self.lock = threading.Lock()

    def _grams(self, answer: list[int]):
        for end in range(1, len(answer)):
            for n in range(2, self.max_n + 1):
                if end - n < 0:
                    break
                yield tuple(answer[end - n: end]), answer[end]

    def add(self, answer: list[int]) -> None:
        if len(answer) < 3:
            return
        with self.lock:
            for gram, token in self._grams(answer):
                nexts = self.counts.setdefault(gram, {})
                nexts[token] = nexts.get(token, 0) + 1
            self.answers.append(list(answer))
            self.tokens += len(answer)
            while self.tokens > self.max_tokens:  # the oldest answers go first
                old = self.answers.popleft()
                self.tokens -= len(old)
                for gram, token in self._grams(old):
                    nexts = self.counts[gram]
                    nexts[token] -= 1
                    if not nexts[token]:
                        del nexts[token]
                        if not nexts:
                            del self.counts[gram]

    def follows(self, context: list[int]) -> tuple[dict[int, int], int] | None:
        """(the counts of the tokens that followed it, n) for the longest n-gram ending ``context`` that the index
        holds; None where it holds none."""
        for n in range(min(self.max_n, len(context)), 1, -1):
            nexts = self.counts.get(tuple(context[-n:]))
            if nexts:
                return nexts, n
        return None

    def next(self, context: list[int]) -> tuple[int, float, int] | None:
        """(token, its share of what followed, n) for the longest n-gram ending ``context`` that the index holds."""
        found = self.follows(context)
        if found is None:
            return None
        nexts, n = found
        token, count = min(nexts.items(), key=lambda item: (-item[1], item[0]))
        return token, count / sum(nexts.values()), n

    def chain(self, context: list[int], k: int, min_share: float, alpha: float, counted: bool = True) -> list[int]:
        """Up to k tokens, each the index's top continuation after the ones before, while its share >= ``min_share``;
        at most ``alpha`` · n of them after a first match of n tokens. ``counted``: a lookup for /metrics (not a
        peek's, drafters/base.py)."""
        out: list[int] = []
        limit = k
        recent = list(context[-self.max_n:])
        with self.lock:
            while len(out) < limit:
                hit = self.next(recent)
                if hit is None or hit[1] < min_share:
                    break
                if not out:
                    limit = min(k, max(1, int(alpha * hit[2])))
                out.append(hit[0])
                recent = (recent + [hit[0]])[-self.max_n:]
            self.lookups += counted
            self.hits += counted and bool(out)
        return out

    def tree(self, context: list[int], k: int, min_share: float, alpha: float, budget: int
             ) -> tuple[list[int], list[int]]:
        """SuffixDecoding's draft tree: (tokens, parents), at most ``budget`` nodes, a parent before its children
        (-1: the root, the committed context). A node is a token that followed its parent's n-gram with a share of at
        least ``min_share``; nodes are taken best first by their path's score, the product of the shares from the
        root (the probability the index gives the path; ties: the smaller token, then the earlier found). At most
        ``alpha`` · n deep after a first match of n tokens, and at most k. Since a child never scores above its
        parent, the nodes taken are the best-scoring ones of all that qualify."""
        order = itertools.count()
        heap: list = []  # (-score, token, order, parent node, the parent's recent context, depth)

        def expand(recent: list[int], parent: int, score: float, depth: int) -> None:
            found = self.follows(recent) if depth <= cap else None
            if found is not None:
                total = sum(found[0].values())
                for token, count in found[0].items():
                    if count / total >= min_share:
                        heapq.heappush(heap, (-score * count / total, token, next(order), parent, recent, depth))

        tokens: list[int] = []
        parents: list[int] = []
        with self.lock:
            first = self.follows(context[-self.max_n:])
            cap = min(k, max(1, int(alpha * first[1]))) if first is not None else 0
            expand(list(context[-self.max_n:]), -1, 1.0, 1)
            while heap and len(tokens) < budget:
                score, token, _, parent, recent, depth = heapq.heappop(heap)
                tokens.append(token)
                parents.append(parent)
                expand((recent + [token])[-self.max_n:], len(tokens) - 1, -score, depth + 1)
            self.lookups += 1
            self.hits += bool(tokens)
        return tokens, parents


_INDEXES: dict[tuple, ServedIndex] = {}
_INDEXES_LOCK = threading.Lock()


def served_index(target, scope: str = "", max_tokens: int = 200_000, seed: int = 0) -> ServedIndex:
    """The process's index for ``target`` (a loaded model) and ``scope``, made on first use (seeded with the first
    ``seed`` answers of the target's shipped answer store, where one ships)."""
    key = (id(target.model), scope, max_tokens, seed)  # (an index seeded otherwise is another index)
    with _INDEXES_LOCK:
        index = _INDEXES.get(key)
        if index is None:
            index = _INDEXES[key] = ServedIndex(max_tokens=max_tokens)
            folder = shipped_store(target) if seed else None
            for answer in read_answers(Path(folder) / FILE)[0][:seed] if folder is not None else ():
                index.add(answer)
        return index


def indexes(target) -> list[ServedIndex]:
    """Every index this process holds for ``target`` (one per scope and size): what the server's /metrics reports."""
    with _INDEXES_LOCK:
        return [index for key, index in _INDEXES.items() if key[0] == id(target.model)]


class SuffixDrafter(LookupDrafter):
    name = "suffix"
    summary = "prompt lookup, then an index of the answers this process has served (learns as it serves)"
    rank = 5
    needs = (TARGET,)
    params = (Param("min_context", 2, "the shortest context match that lookup drafts from instead of the index"),
              Param("min_share", 0.3, "the index drafts a token that followed its n-gram at least this often (0-1)"),
              Param("alpha", 2.0, "a match of n tokens drafts at most alpha * n tokens from the index"),
              Param("share", True, "read and feed the process's index (false: this generation stays out of it)"),
              Param("max_tokens", 200_000, "answer tokens the index keeps (the oldest answers go first)"),
              Param("seed", 0, "answers of the target's shipped answer store the index starts with"),
              Param("scope", "", "whose answers the index holds: one index per scope ('': the process's; the server "
                                 "gives each API key its own unless --share-drafts)"),
              *LookupDrafter.params)
    tree_params = (Param("budget", 12, "a tree's nodes at most"),)
    variants = (Variant("tree", False, "draft a tree of the index's most frequent continuations where decoding is "
                                       "greedy, best first by their paths' shares (false: a chain)", suffix="-tree"),)

    @classmethod
    def options(cls, tree=False):
        return cls.params + (cls.tree_params if tree else ())

    def __init__(self, target, min_context: int = 2, min_share: float = 0.3, alpha: float = 2.0, share: bool = True,
                 max_tokens: int = 200_000, seed: int = 0, scope: str = "", max_ngram: int = 3,
                 min_ngram: int = 1, max_copy: int = MAX_COPY, tree: bool = False, budget: int = 12):
        super().__init__(max_ngram=max_ngram, min_ngram=min_ngram, max_copy=max_copy)
        if target is None:
            raise SpeculateError("drafter 'suffix' needs the target model (its index is the target's answers)")
        if not 0.0 <= min_share <= 1.0 or alpha <= 0 or seed < 0 or budget < 1:
            raise SpeculateError(f"suffix: need 0 <= min_share <= 1, alpha > 0, seed >= 0, budget >= 1; got "
                                 f"{min_share}, {alpha}, {seed}, {budget}")
        self.tree, self.budget, self.greedy = bool(tree), budget, True
        self.min_context, self.min_share, self.alpha = min_context, min_share, alpha
        self.served = served_index(target, scope, max_tokens, seed) if share else None
        self.from_index = 0  # rounds the index drafted in the last generation

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        self.prompt_tokens, self.from_index = len(prompt_ids), 0
        self.greedy = sampling.greedy

    def max_nodes(self, k):
        return max(super().max_nodes(k), self.budget) if self.tree else super().max_nodes(k)

    def priced_nodes(self, k):
        """A tree of depth k: at most ``budget`` nodes, and at most 1 / min_share children a node (their shares sum to
        at most 1). Prompt lookup's copies are chains of their own length, not k's."""
        if not self.tree:
            return k
        width = int(1 / self.min_share) if self.min_share > 0 else self.budget
        return min(self.budget, sum(width ** depth for depth in range(1, k + 1)))

    def elsewhere(self, tokens):
        if self.served is None:
            return None
        chain = self.served.chain(tokens, 1, self.min_share, self.alpha, counted=False)
        return chain[0] if chain else None

    def draft_elsewhere(self, tokens, k):
        if self.served is None:
            return None
        # A tree where decoding is greedy; sampling drafts the chain (its lossless rule is the chain's).
        if self.tree and self.greedy:
            nodes, parents = self.served.tree(tokens, k, self.min_share, self.alpha, self.budget)
        else:
            nodes, parents = self.served.chain(tokens, k, self.min_share, self.alpha), None
        if not nodes:
            return None
        self.from_index += 1
        return Draft(torch.tensor(nodes, dtype=torch.long), parents=parents)

    def end(self, tokens: list[int]) -> None:
        """The generation's answer (``tokens`` after the prompt) goes into the index."""
        if self.served is not None:
            self.served.add(tokens[self.prompt_tokens:])
