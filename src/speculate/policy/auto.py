"""Automatic settings: ``--k auto`` and ``--eps auto``.

``--k auto`` (:class:`AutoK`). The lesson's exact model says a round of k drafts yields
E(α, k) = (1 − α^(k+1)) / (1 − α) tokens for T(k+1)/T(1) + k·c target-forward units (see
:func:`~speculate.policy.speedup.speedup`). Both ingredients are measured rather than assumed: the cost
curve T(n)/T(1) and the draft's cost ratio c come from a profile of this machine
(:func:`profile_for`, measured once per model/precision/thread count and cached), and α is estimated
*during* the generation from the rounds so far. Each round the policy drafts the k that maximises the
predicted speedup at the current estimate — on these CPUs often 2 or 3, where the matrix kernel's cost
steps up at 4 rows.

The α estimate is the maximum-likelihood one under the lesson's model (each draft accepted
independently with probability α, stopping at the first rejection): a round that drafted m and kept n
contributes n successes, plus one failure when n < m, so α̂ = Σn / (Σn + #rounds with a rejection). A
prior of ``prior_weight`` pseudo-rounds at ``alpha0`` keeps the first rounds from swinging to k = 1 or
k_max on one observation. A round at k = 0 whose drafter could tell its first token for free (prompt lookup,
retrieval, suffix: ``Drafter.peek``) counts as a round that drafted that one token, so α is still learned where
drafting stopped paying, and drafting resumes when the text turns copyable. The estimate restarts with each
generation, so a seeded generation does not depend on what the decoder generated before.

``--eps auto`` (:func:`calibrate_eps`). The Consultant Decoding paper (§3.3, eq. 9) sets ε to the
target's converged training loss estimated by the Chinchilla law, and names choosing ε as an open
problem. The loss that law estimates is the target's mean negative log-likelihood on text like its
training data, which can be measured directly: ``calibrate_eps`` runs the target teacher-forced over a
calibration text (shipped: ``calibration.txt``, prose, a worked arithmetic problem and Python code) and
returns its mean NLL per token. CD then accepts draft tokens while their EMA NLL stays within what the
target finds typical of natural text. :func:`chinchilla_eps` gives the paper's estimate beside it where
the training-token count is known.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
from importlib import resources
from pathlib import Path

from ..errors import SpeculateError
from ..params import is_auto  # noqa: F401 (one reading of 'auto', re-exported for the settings paths)
from ..stats import alpha_mle
from .profile import Profile, load_profile, measure_profile, save_profile
from .scaling import chinchilla_loss
from .speedup import best_k

#: Largest k that ``--k auto`` considers (the profile covers n = 1..AUTO_K_MAX + 1).
AUTO_K_MAX = 8
#: α's prior: ALPHA0 over PRIOR_WEIGHT pseudo-rounds, before a generation's own rounds (AutoK, and the batch planner's
#: estimate of a fixed-k run's α).
ALPHA0, PRIOR_WEIGHT = 0.6, 4.0
#: The most rows the batch cost curve covers (T(n) measured at n = 1, 2, 4, ..., BATCH_ROWS; interpolated between).
BATCH_ROWS = 256
#: How many times a cost curve is measured, at most, before one measured on a busy machine is used uncached.
MEASURES = 3
#: Training tokens of the aliased models (model cards), for the Chinchilla estimate beside ``--eps auto``.
TRAINING_TOKENS = {
    "smollm2-135m-instruct": 2e12,  # SmolLM2-135M: 2T tokens
    "qwen2.5-coder-0.5b-instruct": 5.5e12,  # Qwen2.5-Coder: 5.5T tokens of continued pre-training
    "qwen2.5-coder-1.5b-instruct": 5.5e12,
    "gemma-3-270m": 6e12,  # Gemma 3 270M: 6T tokens
}


# --- k auto --------------------------------------------------------------------------------------------

def profile_path(target, draft=None) -> Path:
    """Where the cached profile of ``target`` (and ``draft``) at their precisions lives.

    Keyed by model names, precisions, torch's thread count and the compiled kernels' sources: a curve measured
    with other threads, another precision or other kernels says nothing about this one."""
    import torch

    from ..models import kernel
    from ..models.cache import cache_root

    parts = [f"{target.name}@{target.dtype}"]
    if draft is not None:
        parts.append(f"{draft.name}@{draft.dtype}")
    key = "+".join(parts) + f"-{torch.get_num_threads()}t-k{kernel.source_digest()}"
    # Local folders are named by their path: keep the file name short and filesystem-safe.
    slug = re.sub(r"[^A-Za-z0-9_.@+-]+", "_", key)[-80:]
    digest = hashlib.sha1(key.encode()).hexdigest()[:8]
    return cache_root() / "profiles" / f"{slug}-{digest}.json"


def profile_for(target, draft=None, progress: bool = True, batch: bool = False) -> Profile:
    """The cost profile of ``target`` (+ ``draft``) on this machine: loaded from the cache, or measured
    once (n = 1..AUTO_K_MAX + 1, 3 repeats; seconds on the default model, ~half a minute on a 1.5B) and
    cached atomically."""
    path = profile_path(target, draft)
    if batch:  # T(n) at larger n, for batches of generations (speculate/policy/batch.py): powers of two to BATCH_ROWS
        path = path.with_name(path.stem + "-batch.json")
    if path.is_file():
        try:
            prof = load_profile(path, sampled=batch)  # (the batch curve is sampled at powers of two)
            if draft is None or prof.draft_prefill_seconds is not None:
                return prof
        except SpeculateError:
            pass  # unreadable (or from before the draft's prefill was timed): measure again and replace it
    if progress:
        print(f"speculate: measuring the cost curve of {target.name} for --k auto (once; cached in {path})",
              file=sys.stderr, flush=True)
    ns = [2 ** i for i in range(BATCH_ROWS.bit_length()) if 200 + 2 ** i <= target.context_window] if batch else None
    # A curve timed beside other work is cached only if nothing better comes: up to MEASURES tries, the first quiet one
    # kept; if none is, the least busy serves this run and the next run measures again (Profile.doubtful).
    tries = []
    for _ in range(MEASURES):
        tries.append(measure_profile(target, draft, context=200, max_n=AUTO_K_MAX + 1, repeats=3, ns=ns))
        if tries[-1].doubtful() is None:
            save_profile(tries[-1], path)
            return tries[-1]
    prof = min(tries, key=lambda p: p.busy if p.busy is not None else 1.0)
    print(f"speculate: warning: the cost curve of {target.name} was measured {MEASURES} times on a busy machine "
          f"({prof.doubtful()}); used for this run, not cached", file=sys.stderr, flush=True)
    return prof


class AutoK:
    """Draft length per round from a cost curve and a running α estimate (module docstring).

    ``curve``: n → T(n)/T(1) (or a :class:`Profile`); ``c``: draft cost per drafted token relative to a
    target forward (0 for prompt lookup); ``rows``: k → rows verified per round (tree drafters: their
    node count at depth k, + 1; None: k + 1)."""

    GRID = 100  # α resolution of the precomputed best-k table

    def __init__(self, curve, c: float, k_max: int = AUTO_K_MAX, alpha0: float = ALPHA0,
                 prior_weight: float = PRIOR_WEIGHT, rows=None):
        if not 0.0 <= alpha0 < 1.0:
            raise SpeculateError(f"alpha0 must be in [0, 1), got {alpha0}")
        # best k for α = 0, 0.01, ..., 0.99: a table lookup per round instead of a search.
        self.table = [best_k(curve, i / self.GRID, c, k_max, rows)[0] for i in range(self.GRID)]
        self.c, self.rows = c, rows or (lambda k: k + 1)  # (for the batch planner, speculate/policy/batch.py)
        self.k_max = max(self.table)
        self.alpha0, self.prior_weight = alpha0, prior_weight
        self.reset()

    def reset(self) -> None:
        """Back to the prior (called at the start of each generation)."""
        self.successes = self.alpha0 * self.prior_weight
        self.failures = (1.0 - self.alpha0) * self.prior_weight

    @property
    def alpha(self) -> float:
        return alpha_mle(self.successes, self.failures)  # with the prior's pseudo-rounds: never undefined

    def next_k(self) -> int:
        return self.table[min(self.GRID - 1, int(self.alpha * self.GRID))]

    def update(self, drafted: int, accepted: int) -> None:
        """One round: ``drafted`` proposed, the first ``accepted`` kept (no information when drafted = 0)."""
        self.successes += accepted
        self.failures += accepted < drafted


class FixedK:
    """The same k every round (``--k N``); the interface of :class:`AutoK`."""

    def __init__(self, k: int):
        self.k_max = k

    def reset(self) -> None:
        pass

    def next_k(self) -> int:
        return self.k_max

    def update(self, drafted: int, accepted: int) -> None:
        pass


# --- eps auto ------------------------------------------------------------------------------------------

def calibration_text() -> str:
    """The shipped calibration text (prose, arithmetic, code), ~500 words."""
    return resources.files("speculate.policy").joinpath("calibration.txt").read_text(encoding="utf-8")


def teacher_forced(loaded, ids: list[int], window: int = 1024):
    """(argmax, NLL) tensors per scored position of ``ids`` under ``loaded``, teacher-forced in windows
    of ``window`` tokens (each window's first token has no context and is not scored), so any length
    fits the context window. Shared by ``--eps auto`` and ``bench/precision.py``."""
    import torch

    window = min(window, loaded.context_window)
    argmax, nll = [], []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window - 1):
            w = torch.tensor([ids[start:start + window]])
            if w.shape[1] < 2:
                break
            logits = loaded.model(w).logits[0, :-1].float()
            argmax.append(logits.argmax(-1))
            nll.append(torch.nn.functional.cross_entropy(logits, w[0, 1:], reduction="none"))
    return torch.cat(argmax), torch.cat(nll)


def mean_nll(loaded, text: str, chunk: int = 1024) -> tuple[float, int]:
    """(mean NLL in nats per token, tokens scored) of ``loaded`` teacher-forced over ``text``
    (:func:`teacher_forced`, windows of ``chunk`` tokens)."""
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        raise SpeculateError("the calibration text must be at least two tokens long")
    nll = teacher_forced(loaded, ids, chunk)[1]
    return float(nll.double().mean()), len(nll)


_EPS_CACHE: dict[tuple, float] = {}


def calibrate_eps(loaded, text: str | None = None) -> float:
    """``--eps auto``: the target's mean NLL per token on ``text`` (default: the shipped calibration
    text). Computed once per model, precision and text in a process."""
    text = calibration_text() if text is None else text
    key = (loaded.name, loaded.dtype, hashlib.sha1(text.encode()).hexdigest())
    if key not in _EPS_CACHE:
        _EPS_CACHE[key] = mean_nll(loaded, text)[0]
    return _EPS_CACHE[key]


def chinchilla_eps(loaded) -> float | None:
    """The paper's ε (eq. 9) for ``loaded``, where its training-token count is known (else None)."""
    tokens = TRAINING_TOKENS.get(loaded.name)
    if tokens is None:
        return None
    n_params = sum(p.numel() for p in loaded.model.parameters())
    return chinchilla_loss(n_params, tokens)


def parse_auto(value: str, kind: type, flag: str):
    """A flag's value: ``auto`` or a number of ``kind`` (for argparse ``type=``)."""
    if is_auto(value):
        return "auto"
    try:
        out = kind(value)
    except ValueError:
        raise SpeculateError(f"{flag} must be a number or 'auto', got {value!r}") from None
    if isinstance(out, float) and not math.isfinite(out):
        raise SpeculateError(f"{flag} must be finite, got {value!r}")
    return out
