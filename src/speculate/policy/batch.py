"""k by batch size: each round's draft lengths for a batch of generations, chosen for the batch's throughput.

A batched round (engine.py, ``step``) verifies Σᵢ (kᵢ + 1) rows in one target forward. With the lesson's model,
generation i then yields E(αᵢ, kᵢ) = (1 − αᵢ^(kᵢ+1)) / (1 − αᵢ) tokens (speedup.py, ``expected_tokens``), and
the round costs T(Σ rows)/T(1) + Σ kᵢ·cᵢ target steps. Alone, the best k is where verifying one more row stops
paying for itself (auto.py, ``AutoK``); in a batch the rows are shared: on a CPU one forward over 8 rows costs a
fraction more than over one, but 16 generations × 7 rows is a compute-bound forward. So the planner maximises
the batch's tokens per unit of time,

    Σᵢ E(αᵢ, kᵢ) / (T(Σᵢ rowsᵢ(kᵢ))/T(1) + Σᵢ kᵢ·cᵢ),

greedily: from kᵢ = 0 for every generation whose k is ``auto``, add the one draft token (to the generation whose
next token adds the most, αᵢ^(kᵢ+1) against its rows) that raises the ratio most, until none does. At a large
batch that can be k = 0 for all: plain decoding, batched. A fixed k is a cap planned the same way where it is the
server's default (``Run.k_is_cap``: the request did not name it) and the drafter's cost is known without a draft
model (prompt lookup, retrieval, heads); speculation then never costs a batch what plain decoding would not. A k the
request named, a draft model's, or a seeded sampling request's (its draws follow its drafts) is kept.

T(n) is measured once per model, precision and thread count (auto.py, ``profile_for(batch=True)``: n = 1, 2, 4,
..., 256, interpolated between), αᵢ is each generation's running estimate (``AutoK.alpha``), which rounds planned
no draft still feed where the drafter's proposal is free (prompt lookup, retrieval, suffix: they peek, ``_alpha``).

A batch of one is planned too (``alone``): a capped k alone was the whole cap every round, and on an AVX2 EPYC,
whose q4 rows are dear (T(2) = 1.49, T(8) = 4.2), that ran MT-Bench answers at 0.84× plain; planned, 0.98× (and
copy prompts at 1.81× against 1.83×), a batch of two whose answers end apart at 0.86× against 0.73× (its last rounds
run alone; docs/benchmarks.md, "Peeks"). Planned alone, a run at k = 0 learns from its peeks, or it would never draft
again.

The plan is a prediction, so a measured gate (gate.py) has the last word: per batch size and drafter it times rounds
run as planned against rounds run plain, and runs plain where drafting measures slower. Not a batch of one: there
the gate, which pools rounds over time, lost to the run's own policy. One MT-Bench answer alone,
engine-level: over its first 100 rounds drafting ran 0.96× plain and the gate 0.96× too (exploring and probing cost
what withholding saved); over 300 rounds, as the answer turned repetitive, drafting ran 1.31× and the gate 1.19×
(docs/benchmarks.md, "Speculation that never costs").
"""

from __future__ import annotations

import bisect

from ..drafters.base import Drafter
from ..stats import alpha_mle
from .auto import ALPHA0, PRIOR_WEIGHT, AutoK, FixedK, profile_for
from .gate import DraftGate, bucket
from .speedup import expected_tokens


def interpolate(curve: dict[int, float], n: int) -> float:
    """T(n)/T(1) from a curve measured at some n: linear between the points, and past the last two beyond it."""
    ns = sorted(curve)
    if n in curve:
        return curve[n]
    i = min(max(bisect.bisect_left(ns, n), 1), len(ns) - 1)
    lo, hi = ns[i - 1], ns[i]
    return curve[lo] + (curve[hi] - curve[lo]) * (n - lo) / (hi - lo)


def plan(alphas: list[float | None], fixed: list[int | None], k_max: list[int], rows, costs: list[float],
         curve: dict[int, float]) -> list[int]:
    """The draft lengths (module docstring). Per generation: ``alphas`` its α (None: it yields no token this round,
    a prefill chunk), ``fixed`` its fixed k (None: auto), ``k_max`` the most it may draft this round, ``rows[i](k)``
    the rows a draft of k verifies, ``costs`` its c. ``curve``: n → T(n)/T(1)."""
    ks = [k if k is not None else 0 for k in fixed]
    tables = [None if f is not None else [expected_tokens(min(a, 0.999), k) for k in range(m + 1)]
              for a, f, m in zip(alphas, fixed, k_max)]
    tokens = sum(t[k] if t is not None else 0.0 if a is None else expected_tokens(min(a, 0.999), k)
                 for t, a, k in zip(tables, alphas, ks))
    n_rows = sum(r(k) for r, k in zip(rows, ks))
    drafting = sum(k * c for k, c in zip(ks, costs))

    def rate(tok, n, d):
        return tok / (interpolate(curve, n) + d)

    best = rate(tokens, n_rows, drafting)
    while True:
        choice = None
        for i, t in enumerate(tables):
            if t is None or ks[i] >= k_max[i]:
                continue
            extra_rows = rows[i](ks[i] + 1) - rows[i](ks[i])
            r = rate(tokens + t[ks[i] + 1] - t[ks[i]], n_rows + extra_rows, drafting + costs[i])
            if r > best * (1 + 1e-9) and (choice is None or r > choice[0]):
                choice = (r, i, extra_rows)
        if choice is None:
            return ks
        best, i, extra_rows = choice
        tokens += tables[i][ks[i] + 1] - tables[i][ks[i]]
        n_rows += extra_rows
        drafting += costs[i]
        ks[i] += 1


class BatchPlanner:
    """``planner(runs) -> ks | None``: the scheduler's (server/scheduler.py) per-round choice, and
    ``planner.observe(runs, seconds)`` after the round, for the gate. None (each run's own policy) where no run's k
    may be planned (``auto``, or a cap: module docstring). The batch cost curve is measured at the
    first batch that needs it (the server measures it at start)."""

    def __init__(self, target, gate: DraftGate | None = None, alone: bool = True):
        """``alone``: plan a batch of one's capped k too, as for a batch (not gated); False: leave it to its own policy
        (the whole cap every round). An auto k alone plans itself either way (AutoK)."""
        self.target = target
        self.gate = gate or DraftGate()
        self.alone = alone
        self._curve = None
        self._pending = None  # (gate key, drafted, tokens before) of the round planned last; None: not to record

    def curve(self) -> dict[int, float]:
        if self._curve is None:
            self._curve = profile_for(self.target, batch=True).curve
        return self._curve

    def __call__(self, runs) -> list[int] | None:
        return self.round(runs)[0]

    def round(self, runs) -> tuple[list[int] | None, list[int | None] | None]:
        """This round's ``(ks, depths)`` for ``engine.step``: the draft lengths (None: each run's own policy), and in a
        batch each planned run's deepest draft, 2k: a draft may pass its plan by at most the plan's own length.

        A drafter may propose past k (lookup's copies grow while they are accepted whole). Alone that pays (copy
        prompts 1.81x plain, cut to k 1.41x). In a batch the rows are the batch's, which the plan did not count. On the
        AVX2 EPYC, two generations of copy prompts (docs/benchmarks.md, "Depth cut"): SmolLM2-135M's copies grew to 8,
        16 and 32 tokens where k = 2 was planned, one round took 136 ms against 10 ms plain: 0.88x plain uncut, 0.98x
        cut to k, 0.99x cut to 2k. The Qwen 1.5B copies verbatim: 1.22x uncut, 1.10x cut to k, 1.17x cut to 2k. Cut to
        2k, a copy that fails costs at most the plan's rows again, and one that grows once still pays."""
        auto = [_plannable(run) for run in runs]
        ks = self._ks(runs, auto)
        if len(runs) == 1:
            return ks, None
        # A run whose prompt completes this round drafts too (engine.py, ``Run.joins``), but it has no α to plan with:
        # it drafts no deeper than the plan's deepest, so a round planned plain stays plain, and a burst of joining
        # runs with nothing to plan drafts nothing. (Before, it drafted at its own policy's k: at 16 clients of the
        # Qwen 1.5B two joining drafts made the round of everyone's first token 26 rows instead of 24, ~0.1 s more
        # TTFT; docs/benchmarks.md, "Where the server's time goes at 16 clients".)
        joining = [_joining(run) for run in runs]
        if ks is None:
            if not any(joining):
                return None, None
            ks = [None] * len(runs)  # (the others: their own policy)
        deepest = max((k for k, a in zip(ks, auto) if a), default=0)
        ks = [min(run.draft_length(), deepest) if j else k for run, k, j in zip(runs, ks, joining)]
        return ks, [2 * k if a or j else None for a, j, k in zip(auto, joining, ks)]

    def _ks(self, runs, auto: list[bool]) -> list[int] | None:
        self._pending = None
        alone = len(runs) == 1
        if not any(auto) or (alone and not (self.alone and _capped(runs[0]))):
            return None  # (alone, an auto k plans itself: AutoK, on the finer curve of n = 1..9)
        ks = self._plan(runs, auto)
        if alone:
            return ks
        # The gate: drafted as planned, or plain where drafting measures slower (gate.py). Only the plannable runs'
        # drafts count and are withheld; a named k is kept either way.
        key = (bucket(sum(not run.prefilling for run in runs)),
               tuple(sorted({run.drafter.name for run, a in zip(runs, auto) if a})))
        drafted = any(k for k, a in zip(ks, auto) if a)
        if drafted and not self.gate.draft(key):
            ks, drafted = [0 if a else k for k, a in zip(ks, auto)], False
        if not any(run.prefilling for run in runs):  # (a prefill chunk's time is not a decoding round's)
            self._pending = key, drafted, sum(run.produced for run in runs)
        return ks

    def observe(self, runs, seconds: float) -> None:
        """The round just planned took ``seconds``: the tokens ``runs`` gave in it, to the gate."""
        if self._pending is not None:
            key, drafted, before = self._pending
            self.gate.record(key, drafted, sum(run.produced for run in runs) - before, seconds)
            self._pending = None

    def _plan(self, runs, auto) -> list[int | None]:
        # Fixed-k runs count with their own α so far, under the prior (``_alpha``); a prefill chunk's rows are a fixed
        # "draft" of rows - 1, which yields no token, or (α = 0) one token where the run joins: its first. Counted as
        # nothing, a burst's joining rows made the round's rate look low and drafts beside them cheap.
        alphas = [(0.0 if run.joins else None) if run.prefilling else _alpha(run) for run in runs]
        fixed = [None if a else run.prefill_rows - 1 if run.prefilling else run.draft_length()
                 for run, a in zip(runs, auto)]
        batch = len(runs) > 1
        k_max = [max(run.draft_length(run.policy.k_max), 0) if a and not (batch and _unseen(run)) else 0
                 for run, a in zip(runs, auto)]
        rows = [_rows(run) if a else _chain for run, a in zip(runs, auto)]
        costs = [_cost(run) if a else 0.0 for run, a in zip(runs, auto)]
        ks = plan(alphas, fixed, k_max, rows, costs, self.curve())
        return [None if run.prefilling else k for run, k in zip(runs, ks)]


def _unseen(run) -> bool:
    """Whether ``run`` has no evidence of its α yet (no draft verified, no peek) and its drafter tells its first token
    for free (``Drafter.peek``). In a batch such a run drafts nothing: its round's peek is its first evidence. Planned
    at the prior (``ALPHA0`` = 0.6) instead, every new run of a burst drafted in the round of its first token: at 16
    clients of the Qwen 1.5B that round took 36 rows against plain's 24, 1.6-1.9 s against 1.1-1.5 s, and each
    client's TTFT with it (docs/benchmarks.md, "The first-token round")."""
    stats = run.stats
    return stats.drafted_tokens == 0 and stats.peeked_rounds == 0 and type(run.drafter).peek is not Drafter.peek


def _chain(k: int) -> int:
    return k + 1


def _plannable(run) -> bool:
    """Whether the planner chooses ``run``'s k this round: an auto k, or a cap (``_capped``), not while it prefills."""
    return not run.prefilling and _choosable(run)


def _joining(run) -> bool:
    """Whether ``run`` joins this round (its prompt's last chunk goes in with its first draft) at a k the planner may
    choose (an auto k or a cap)."""
    return run.prefilling and run.joins and _choosable(run)


def _choosable(run) -> bool:
    """Whether the planner may choose ``run``'s k at all: an auto k, or a cap (``_capped``)."""
    return isinstance(run.policy, AutoK) or _capped(run)


def _capped(run) -> bool:
    """Whether ``run``'s fixed k is a cap the planner may lower (module docstring). Not for a seeded sampling run: its
    draws follow its drafts, and a seeded request must give the same sample in any batch as alone."""
    return (isinstance(run.policy, FixedK) and run.k_is_cap
            and cap_plannable(run.policy.k_max, run.most_nodes, run.draft_cost)
            and (run.sampling.greedy or run.sampling.seed is None))


def cap_plannable(k: int, most_nodes: int, draft_cost: float | None) -> bool:
    """Whether a fixed ``k`` may be a cap the planner lowers, by the drafter alone: one that drafts at all
    (``most_nodes``, its ``max_nodes(k)``, > 0: not ``none``, plain decoding) at a cost known without a draft model's
    profile (``draft_cost``, its ``relative_cost()``). The server measures the batch curve at start where this holds
    for its default k (server/main.py, ``load_models``); ``_capped`` adds the request's side."""
    return k > 0 and most_nodes > 0 and draft_cost is not None


def _alpha(run) -> float:
    """An auto run's running α (its policy's), a fixed-k run's from its statistics under the same prior (``ALPHA0``
    over ``PRIOR_WEIGHT`` pseudo-rounds), as ``AutoK`` does: one draft does not swing it to 0 or 1.

    Both count the rounds that drafted nothing but peeked (engine.py, ``Run.take``; Drafter.peek): one trial each,
    the drafter's free first token against the target's next. Without them a run planned no draft never learned
    again: every MT-Bench and copy-prompt run at 2-8 generations drafted one token in the round that completed its
    prompt, lost it, and sat at 0.48 after, just below what a third row pays at two generations on the Xeon's curve,
    so the planner drafted nothing at load on these prompts. (Letting an idle run's evidence fade back to the prior
    was tried first, docs/benchmarks.md, "Speculation that never costs": 1.05× plain at 4 generations on copy
    prompts but 0.88× at 2, where it drafted on no evidence.)"""
    if isinstance(run.policy, AutoK):
        return run.policy.alpha
    stats = run.stats
    return alpha_mle(stats.accepted_draft_tokens + stats.peek_hits + ALPHA0 * PRIOR_WEIGHT,
                     stats.rejected_rounds + stats.peeked_rounds - stats.peek_hits + (1.0 - ALPHA0) * PRIOR_WEIGHT)


def _rows(run):
    """k → the rows a draft of depth k verifies (a tree drafter's nodes at depth k, + 1)."""
    if isinstance(run.policy, AutoK):
        return run.policy.rows
    return (lambda k: run.drafter.priced_nodes(k) + 1) if run.drafter.tree else _chain


def _cost(run) -> float:
    """c: a draft token's cost relative to a target forward."""
    return run.policy.c if isinstance(run.policy, AutoK) else run.draft_cost
