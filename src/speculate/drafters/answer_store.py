"""An n-gram table of the target's own answers: for each n-gram (n = 1..``max_n``) that occurred in them,
the token that most often followed it and how often (REST's datastore, He et al. 2024, reduced to an
n-gram table; the retrieval drafter, drafters/retrieval.py, drafts from it).

Why the target's *own* greedy answers: a small chat model answers in set phrases ("To find the total, we
need to", "Here are some tips"), and a table of what it wrote before predicts what it will write next
without a draft model and without training. The answers are the self-distillation data of the heads
(heads/data.py: GSM8K *train* questions, chat questions, rewrite tasks — never a benchmark's samples).

The file (``answers.safetensors``) keeps the answers themselves (``tokens``, ``starts``; a few hundred KB)
and the table is counted from them when loaded, with tensor ops (well under a second for 255k tokens), so
``max_n`` and ``min_count`` stay settings rather than baked into the file.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

from ..errors import SpeculateError

FILE = "answers.safetensors"


class AnswerStore:
    def __init__(self, answers: list[list[int]], max_n: int = 4, min_count: int = 2, min_n: int = 1,
                 meta: dict | None = None):
        """``answers``: token sequences; the table holds n-grams of ``min_n``..``max_n`` tokens, each kept
        when its most frequent next token followed it at least ``min_count`` times (a one-off continuation
        is mostly noise)."""
        if not 1 <= min_n <= max_n or min_count < 1:
            raise SpeculateError(f"answer store: need 1 <= min_n <= max_n and min_count >= 1, got {min_n}, {max_n}, "
                                 f"{min_count}")
        self.max_n, self.meta = max_n, dict(meta or {})
        stream = torch.tensor([t for a in answers for t in a], dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(len(answers)), torch.tensor([len(a) for a in answers],
                                                                               dtype=torch.long))
        self.table = _table(stream, seq, max_n, min_count, min_n)
        self.max_token = int(stream.max()) if stream.numel() else -1  # checked against the target's vocabulary

    def next(self, tokens: list[int], min_n: int = 1) -> tuple[int, float] | None:
        """(token, share) the table predicts after ``tokens``, by their longest suffix in the table (at
        least ``min_n`` long); None when no suffix of ``min_n``..``max_n`` tokens is in it."""
        for n in range(min(self.max_n, len(tokens)), min_n - 1, -1):
            hit = self.table.get(tuple(tokens[-n:]))
            if hit is not None:
                return hit
        return None

    def chain(self, tokens: list[int], k: int, min_n: int = 1, min_share: float = 0.0) -> list[int]:
        """Up to k tokens continuing ``tokens``, each the table's prediction after the ones before, while the
        longest matching suffix (>= ``min_n`` tokens) predicts with a share >= ``min_share``."""
        out: list[int] = []
        recent = list(tokens[-self.max_n:])
        while len(out) < k:
            hit = self.next(recent, min_n)
            if hit is None or hit[1] < min_share:
                break
            out.append(hit[0])
            recent = (recent + [hit[0]])[-self.max_n:]
        return out

    @classmethod
    def load(cls, path: str | Path, **settings) -> AnswerStore:
        answers, meta = read_answers(path)
        return cls(answers, meta=meta, **settings)


def read_answers(path: str | Path) -> tuple[list[list[int]], dict]:
    """The answers of a store's file, and its metadata."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "{}"))
            tokens, starts = f.get_tensor("tokens").tolist(), f.get_tensor("starts").tolist()
    except Exception as e:  # missing, truncated, not a store
        raise SpeculateError(f"cannot read the answer store {path}: {e}") from None
    return [tokens[a:b] for a, b in zip(starts, starts[1:])], meta


def save_store(path: str | Path, answers: list[list[int]], meta: dict) -> None:
    """An answer store's file: the answers (the table is counted when loaded), written atomically."""
    from safetensors.torch import save_file

    from ..models.cache import atomic_path

    tokens = torch.tensor([t for a in answers for t in a], dtype=torch.int32)
    starts = torch.tensor([0] + [len(a) for a in answers], dtype=torch.int64).cumsum(0)
    with atomic_path(path) as tmp:
        save_file({"tokens": tokens, "starts": starts}, str(tmp), metadata={"meta": json.dumps(meta)})


def _table(stream: torch.Tensor, seq: torch.Tensor, max_n: int, min_count: int, min_n: int = 1) -> dict:
    """{n-gram: (most frequent next token, its share)} for n = min_n..max_n, over the n-grams followed by a token
    of the same answer; ties go to the lower token id. Each n-gram gets a dense id from its first token and
    the id of the (n − 1)-gram after it, so every step sorts plain integers (no row-wise unique)."""
    table: dict[tuple[int, ...], tuple[int, float]] = {}
    length = stream.numel()
    if length < 2:
        return table
    vocab = int(stream.max()) + 1
    ends = torch.arange(length)
    gram = stream.clone()  # gram[i]: the id of the n-gram ending at i (n = 1: the token itself)
    whole = torch.ones(length, dtype=torch.bool)  # whether that n-gram lies inside one answer
    followed = torch.zeros(length, dtype=torch.bool)
    followed[:-1] = seq[1:] == seq[:-1]  # position i + 1 continues i's answer
    for n in range(1, max_n + 1):
        if n > 1:
            first = ends - (n - 1)
            whole &= first >= 0
            whole[first >= 0] &= seq[first[first >= 0]] == seq[first >= 0]
            gram = torch.unique(stream[first.clamp(min=0)] * (int(gram.max()) + 1) + gram, return_inverse=True)[1]
        at = torch.nonzero(whole & followed).flatten()
        if at.numel() == 0:
            break
        if n < min_n:  # (its ids are still needed for the longer n-grams)
            continue
        pairs, counts = torch.unique(gram[at] * vocab + stream[at + 1], return_counts=True)  # sorted by n-gram
        ids, nexts = pairs // vocab, pairs % vocab
        start = torch.ones(ids.numel(), dtype=torch.bool)
        start[1:] = ids[1:] != ids[:-1]
        group = start.cumsum(0) - 1
        groups = int(group[-1]) + 1
        total = torch.zeros(groups, dtype=torch.long).index_add_(0, group, counts)
        best = torch.zeros(groups, dtype=torch.long).scatter_reduce_(0, group, counts, "amax")
        top = torch.nonzero(counts == best[group]).flatten()  # sorted: the lowest next token first
        keep = torch.ones(top.numel(), dtype=torch.bool)
        keep[1:] = group[top[1:]] != group[top[:-1]]
        top = top[keep]
        top = top[counts[top] >= min_count]
        # An occurrence of each kept n-gram, to spell it out.
        where = torch.full((int(gram.max()) + 1,), length, dtype=torch.long).scatter_reduce_(0, gram[at], at, "amin")
        spans = where[ids[top]][:, None] + torch.arange(-n + 1, 1)
        share = (counts[top].double() / total[group[top]].double()).tolist()
        table.update(zip(map(tuple, stream[spans].tolist()), zip(nexts[top].tolist(), share)))
    return table


_LOADED: dict = {}  # (file, settings) → (its mtime, AnswerStore): a server builds a decoder per request's settings
_LOADING = threading.Lock()  # one load per file, also when several server workers ask at once


def shipped_store(target) -> Path | None:
    """The folder of the answer store shipped for ``target`` (a LoadedModel, or a model name), or None."""
    from ..heads.io import shipped_folder

    return shipped_folder(target if isinstance(target, str) else target.name, "answers", marker=FILE)


def find_store(target, path: str | Path | None = None, **settings) -> AnswerStore:
    """The answer store for ``target`` (a LoadedModel): ``path`` (the file, or a folder holding it), else
    the one shipped for its alias. Refused when its answers were written with another vocabulary."""
    if path is None:
        folder = shipped_store(target)
        if folder is None:
            raise SpeculateError(f"no answer store ships for '{target.name}'; build one with `speculate train-answers "
                                 f"--model {target.name} --out DIR` and pass store=DIR")
        path = folder
    path = Path(path)
    if path.is_dir():
        path = path / FILE
    key = (str(path.resolve()), tuple(sorted(settings.items())))
    mtime = path.stat().st_mtime_ns if path.exists() else 0
    with _LOADING:
        held = _LOADED.get(key)
        if held is None or held[0] != mtime:  # (a rewritten file replaces its old table)
            held = _LOADED[key] = (mtime, AnswerStore.load(path, **settings))
    store = held[1]
    vocab = int(target.model.get_output_embeddings().out_features)
    if store.meta.get("vocab_size", vocab) != vocab or store.max_token >= vocab:
        raise SpeculateError(f"the answer store {path} was written for a vocabulary of "
                             f"{store.meta.get('vocab_size', store.max_token + 1)} tokens ({store.meta.get('model')}), "
                             f"the target has {vocab}")
    return store
