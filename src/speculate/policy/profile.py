"""Measured cost curves: T(n)/T(1) of one target forward over n new tokens, and the draft cost ratio c.

The lesson assumes verifying k + 1 tokens costs one decode step; on a CPU it does not quite
(docs/benchmarks.md, "Verification cost T(n)": 1.00, 1.14, 1.22, 1.55, 1.90, 2.07 for n = 1, 2, 3, 4, 8, 16 on
SmolLM2-135M at fp32, a step from 3 to 4 rows). :func:`measure_profile` measures the curve on this
machine through the engine's own :class:`~speculate.models.kv.KVModel` calls: a forward over n new
tokens after a cached context, every row's logits kept (as the engine's verification forward), then
``keep()`` back to the context. The draft is timed as the engine's model drafter runs it: one token per
forward, last row only.

:func:`save_profile` / :func:`load_profile` store a :class:`Profile` as JSON, for
:func:`~speculate.policy.speedup.recommend_k` (``--k auto``, speculate/policy/auto.py).
"""

from __future__ import annotations

import gc
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import SpeculateError, StorageError

FORMAT = "speculate-profile"
VERSION = 1


@dataclass
class Profile:
    """Median seconds of one target forward over n new tokens (n = 1..max_n), after ``context`` cached
    tokens; optionally the median seconds of one single-token draft forward."""

    target_seconds: dict[int, float]
    model: str = ""
    dtype: str = ""
    context: int = 0
    repeats: int = 0
    draft_model: str | None = None
    draft_seconds: float | None = None
    # One prefill of the context (``context`` tokens, from an empty cache) by the draft model: it prefills each
    # prompt inside its first proposal, a cost plain decoding does not pay (calc's --from-results).
    draft_prefill_seconds: float | None = None
    threads: int | None = None
    measured_at: str = ""
    # The share of the machine's CPU time that other processes took while it was measured (``busy_share``): a curve
    # timed beside other work is that work's, not this machine's (None: not known, e.g. no /proc).
    busy: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def curve(self) -> dict[int, float]:
        """n → T(n)/T(1) (so curve[1] == 1.0)."""
        t1 = self.target_seconds[1]
        return {n: t / t1 for n, t in sorted(self.target_seconds.items())}

    @property
    def c(self) -> float | None:
        """Draft cost per drafted token relative to one target forward: draft T(1) / target T(1)."""
        if self.draft_seconds is None:
            return None
        return self.draft_seconds / self.target_seconds[1]

    @property
    def max_n(self) -> int:
        return max(self.target_seconds)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "model": self.model, "dtype": self.dtype,
            "context": self.context, "repeats": self.repeats, "threads": self.threads,
            "measured_at": self.measured_at,
            "target_seconds": {str(n): t for n, t in sorted(self.target_seconds.items())},
            "curve": {str(n): r for n, r in self.curve.items()},
            "draft_model": self.draft_model, "draft_seconds": self.draft_seconds, "c": self.c,
            "draft_prefill_seconds": self.draft_prefill_seconds,
            **({"busy": self.busy} if self.busy is not None else {}),
            **({"extra": self.extra} if self.extra else {}),
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "profile", sampled: bool = False) -> Profile:
        """Inverse of :meth:`to_dict`; ``target_seconds`` is the source of truth (``curve`` and ``c`` are
        derived). ``sampled``: a curve measured at some n, interpolated between (the batch curve: n = 1, 2, 4, ...);
        otherwise every n from 1 up. Raises SpeculateError on anything malformed."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise SpeculateError(f"{source}: not a speculate profile (no \"format\": \"{FORMAT}\")")
        if d.get("version") != VERSION:
            raise SpeculateError(f"{source}: unsupported profile version {d.get('version')!r}")
        raw = d.get("target_seconds")
        if not isinstance(raw, dict):
            raise SpeculateError(f"{source}: missing \"target_seconds\"")
        try:
            seconds = {int(n): float(t) for n, t in raw.items()}
        except (TypeError, ValueError):
            raise SpeculateError(f"{source}: \"target_seconds\" must map integers to seconds") from None
        n_max = max(seconds, default=0)
        if sampled and (n_max < 2 or 1 not in seconds or min(seconds) < 1):
            raise SpeculateError(f"{source}: \"target_seconds\" must hold n = 1 and a larger n")
        if not sampled and (n_max < 2 or sorted(seconds) != list(range(1, n_max + 1))):
            raise SpeculateError(f"{source}: \"target_seconds\" must cover n = 1, 2, ... without gaps")
        draft, draft_prefill = d.get("draft_seconds"), d.get("draft_prefill_seconds")
        values = list(seconds.values()) + [v for v in (draft, draft_prefill) if v is not None]
        if not all(isinstance(v, (int, float)) and 0.0 < v < math.inf for v in values):
            raise SpeculateError(f"{source}: times must be finite and > 0")
        return cls(target_seconds=seconds, model=str(d.get("model", "")), dtype=str(d.get("dtype", "")),
                   context=int(d.get("context") or 0), repeats=int(d.get("repeats") or 0),
                   draft_model=d.get("draft_model"), draft_seconds=None if draft is None else float(draft),
                   draft_prefill_seconds=None if draft_prefill is None else float(draft_prefill),
                   threads=d.get("threads"), measured_at=str(d.get("measured_at", "")),
                   busy=d["busy"] if isinstance(d.get("busy"), (int, float)) else None, extra=d.get("extra") or {})

    def doubtful(self, tolerance: float | None = None) -> str | None:
        """Why this profile should not be trusted beyond the run that measured it, or None: other processes took
        more than ``tolerance`` of the machine while it was timed, or a forward over n rows measured faster than one
        over m < n by more than that (T(n) cannot fall as n grows), or slower than ceil(n / m) forwards over m by
        more than that (n rows fit in that many): either curve was timed under noise.
        On an AVX2 EPYC a batch curve measured beside the test suite read T(2) = 2.67, against 1.49 measured quiet.
        ``tolerance``: default ``$SPECULATE_BUSY_TOLERANCE``, else 0.25; 1 trusts every profile."""
        tolerance = busy_tolerance() if tolerance is None else tolerance
        if tolerance >= 1:
            return None
        if self.busy is not None and self.busy > tolerance:
            return f"other processes took {self.busy:.0%} of the CPUs while it was measured"
        ns = sorted(self.target_seconds)
        for lo, hi in zip(ns, ns[1:]):
            ratio = self.target_seconds[hi] / self.target_seconds[lo]
            # Nor can it rise past ceil(hi / lo) x T(lo): hi rows fit in that many forwards of lo rows. A batch curve
            # timed at a server's start on the EPYC read T(8) = 2.67 x T(4) and T(32) = 2.56 x T(16) (its busy share
            # 12 %), which made 8 -> 16 rows look nearly free to the planner (T(16) = 1.31 x T(8)).
            if ratio < 1 - tolerance or ratio > -(-hi // lo) * (1 + tolerance):
                return f"T({hi}) measured {ratio:.2f}x T({lo})"
        return None


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as JSON, atomically (readers see the old file or the new one)."""
    from ..models.cache import atomic_write_text, storage_fault

    path = Path(path).expanduser()
    try:
        atomic_write_text(path, json.dumps(profile.to_dict(), indent=2) + "\n")
    except OSError as e:  # (a full disk is the machine's fault: a server answers 507, not 400)
        kind = StorageError if storage_fault(e) else SpeculateError
        raise kind(f"cannot write the profile to '{path}': {e.strerror or e}") from None
    return path


def load_profile(path: str | Path, sampled: bool = False) -> Profile:
    """Read a profile written by :func:`save_profile` (``speculate calc --profile --save FILE``); ``sampled``: as
    :meth:`Profile.from_dict`."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise SpeculateError(f"cannot read the profile '{path}': {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpeculateError(f"'{path}' is not valid JSON: {e}") from None
    return Profile.from_dict(data, source=str(path), sampled=sampled)


def busy_tolerance() -> float:
    """``$SPECULATE_BUSY_TOLERANCE`` (a share in [0, 1]; default 0.25): see :meth:`Profile.doubtful`."""
    raw = os.environ.get("SPECULATE_BUSY_TOLERANCE", "").strip()
    try:
        value = float(raw) if raw else 0.25
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise SpeculateError(f"SPECULATE_BUSY_TOLERANCE must be a share in [0, 1], got {raw!r}")
    return value


def cpu_ticks() -> tuple[int, int] | None:
    """(every CPU's busy clock ticks since boot, this process's), from /proc (Linux); None where it cannot say."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()  # (after the command name, which may hold spaces)
        # busy: all but idle and iowait (steal counts: the hypervisor gave the CPU to someone else); own: utime + stime
        return sum(ticks) - ticks[3] - ticks[4], int(own[11]) + int(own[12])
    except (OSError, ValueError, IndexError):
        return None


def busy_share(before: tuple[int, int] | None, after: tuple[int, int] | None, seconds: float) -> float | None:
    """The share of the machine's CPU time, over ``seconds`` between two :func:`cpu_ticks`, that went to other
    processes (0: this process alone; 1: every CPU busy with others' work)."""
    if before is None or after is None or seconds <= 0:
        return None
    others = (after[0] - before[0]) - (after[1] - before[1])
    return max(0.0, others / (os.sysconf("SC_CLK_TCK") * seconds * (os.cpu_count() or 1)))


def _dtype_name(loaded) -> str:
    """The precision name the model was loaded with (``LoadedModel.dtype`` where the loader records it;
    else looked up from the weights' torch dtype in DTYPES, read at run time)."""
    name = getattr(loaded, "dtype", None)
    if isinstance(name, str):
        return name
    from ..models.loader import DTYPES

    dtype = getattr(loaded.model, "dtype", None)
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype))


def measure_profile(target, draft=None, context: int = 200, max_n: int = 16, repeats: int = 5,
                    warmup: int = 1, seed: int = 0, ns: list[int] | None = None) -> Profile:
    """Time T(n) for n = 1..max_n (or for the n in ``ns``, which must hold 1) on ``target`` (a LoadedModel), and
    one draft forward on ``draft``.

    The context (``context`` random token ids) is prefilled once. Each timed call is one
    ``KVModel.forward`` over n new tokens returning every row (the engine's verification forward),
    followed by ``keep(context)``. ``warmup`` untimed passes over every n come first; then ``repeats``
    passes, each over all n (and the draft) in a fresh random order so that machine noise hits every n
    alike, and the median per n is kept. The draft is timed as the model drafter runs it: one new token,
    last row only, after the same context in its own cache."""
    import torch

    from ..models.kv import KVModel

    if context < 1:
        raise SpeculateError(f"--context must be >= 1, got {context}")
    if ns is not None:
        ns = sorted(set(ns))
        max_n = ns[-1]
        if ns[0] != 1:
            raise SpeculateError("a cost profile needs T(1)")
    if max_n < 2:
        raise SpeculateError(f"--max-n must be >= 2 (T(2) is needed for k = 1), got {max_n}")
    if repeats < 1:
        raise SpeculateError(f"--repeats must be >= 1, got {repeats}")
    for loaded in (target, draft):
        if loaded is not None and context + max_n > loaded.context_window:
            raise SpeculateError(f"--context {context} + {max_n} new tokens exceed the context window of "
                                 f"'{loaded.name}' ({loaded.context_window})")

    gen = torch.Generator().manual_seed(seed)
    runs = []  # (label, KVModel, new tokens, last)
    t_kv = KVModel(target)
    ctx = torch.randint(0, t_kv.vocab_size, (context,), generator=gen)
    new = torch.randint(0, t_kv.vocab_size, (max_n,), generator=gen)
    t_kv.reset()
    t_kv.forward(ctx, last=1)
    ns = ns or list(range(1, max_n + 1))
    runs += [(n, t_kv, new[:n], 0) for n in ns]
    if draft is not None:
        d_kv = KVModel(draft)
        d_ctx = ctx.clamp(max=d_kv.vocab_size - 1)
        d_kv.reset()
        d_kv.forward(d_ctx, last=1)
        runs.append(("draft", d_kv, new[:1].clamp(max=d_kv.vocab_size - 1), 1))
        runs.append(("draft_prefill", d_kv, d_ctx, 1))

    def call(label, kv, tokens, last) -> float:
        if label == "draft_prefill":  # from an empty cache, and the cache left as it was
            kv.reset()
        start = time.perf_counter()
        kv.forward(tokens, last=last)
        elapsed = time.perf_counter() - start
        kv.keep(context)
        return elapsed

    order = random.Random(seed)
    times: dict = {label: [] for label, *_ in runs}
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    ticks, started = cpu_ticks(), time.perf_counter()
    try:
        for _ in range(warmup):
            for run in runs:
                call(*run)
        for _ in range(repeats):
            for run in order.sample(runs, len(runs)):
                times[run[0]].append(call(*run))
    finally:
        if gc_was_enabled:
            gc.enable()
    busy = busy_share(ticks, cpu_ticks(), time.perf_counter() - started)
    medians = {label: statistics.median(ts) for label, ts in times.items()}
    return Profile(
        target_seconds={n: medians[n] for n in ns},
        model=target.name, dtype=_dtype_name(target), context=context, repeats=repeats,
        draft_model=None if draft is None else draft.name,
        draft_seconds=None if draft is None else medians["draft"],
        draft_prefill_seconds=None if draft is None else medians["draft_prefill"],
        threads=torch.get_num_threads(),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), busy=busy,
    )
