"""Drafting that never costs: a measured gate over the batch planner's plan (issue 41).

The planner (batch.py) predicts: it weighs E(α, k) tokens against a cost curve T(n)/T(1) measured once, when the
server started. Both ends of that prediction can be wrong while it serves. The curve was measured on a quiet machine
over one sequence's rows, not on a busy one over many sequences; α is the lesson's independent-acceptance model,
which a retrieval drafter's all-or-nothing matches do not follow; and what a round costs beside the forward (proposing,
verifying, rolling back) is left out. On MT-Bench at 32 clients the default server's planned drafts lost ~4 % to plain
decoding (engine-level, interleaved rounds, this Xeon). So the gate measures the one thing that matters, the
throughput each way:

- **Two arms per key.** A key is a batch size bucket and the drafters in the batch. Arm "draft" is a round run as the
  planner planned it, with some draft. Arm "plain" is a round with every plannable k set to 0 (a round the planner
  planned without drafts counts there too). Each arm keeps the tokens its rounds gave and the seconds they took,
  both decayed by ``decay`` per round of that arm, so a rate is a ratio of sums over its last ~1/(1 − decay) rounds.
- **Exploration first.** Until each arm of a key has ``explore`` rounds, the arms alternate.
- **Then the faster arm, with probes.** The arm with the higher tokens per second runs, and every ``period``-th round
  the other one, so that the loser is re-measured as the load, the machine and the prompts change. The period grows
  with the lead (:data:`PERIODS`): a 2× lead, like a copying workload's, is probed every 32nd round, so it costs
  under 2 %.

The arms differ only in k, and k never changes what a generation emits where the planner may set it (greedy,
lossless sampling without a seed; a seeded sampling run keeps its k: batch.py, ``_capped``), so the gate moves speed
only, never tokens. It is a pure function of its own state and the rounds reported to it: it never sees a model, a
clock or a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: (lead below, probe every n-th round): the faster arm runs and the slower one is re-measured every n-th round.
PERIODS = ((1.2, 8), (1.5, 16), (math.inf, 32))


def bucket(n: int) -> int:
    """A batch size's bucket: exact up to 8, then four buckets per doubling (16-19, 20-23, ...), so rounds that share a
    bucket cost about the same per generation."""
    if n <= 8:
        return n
    shift = n.bit_length() - 3
    return (n >> shift) << shift


@dataclass
class Arm:
    """One arm's decayed sums: tokens, seconds and its round count (not decayed)."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class DraftGate:
    """``draft(key) -> bool``: whether this round of ``key`` runs as planned (True) or plain (False);
    ``record(key, drafted, tokens, seconds)``: what a round gave (module docstring)."""

    def __init__(self, decay: float = 0.9, explore: int = 4, periods=PERIODS):
        if not 0.0 < decay < 1.0 or explore < 1:
            raise ValueError("need 0 < decay < 1 and explore >= 1")
        self.decay, self.explore, self.periods = decay, explore, periods
        self.arms: dict = {}  # key -> {True: Arm (draft), False: Arm (plain)}
        self.turns: dict = {}  # key -> times draft(key) was asked
        self.withheld = 0  # rounds run plain against the plan

    def _arms(self, key) -> dict[bool, Arm]:
        return self.arms.setdefault(key, {True: Arm(), False: Arm()})

    def draft(self, key) -> bool:
        arms = self._arms(key)
        turn = self.turns[key] = self.turns.get(key, 0) + 1
        if min(arm.rounds for arm in arms.values()) < self.explore:
            choice = arms[True].rounds <= arms[False].rounds  # alternate, drafting first
        else:
            fast, slow = sorted(arms.values(), key=lambda arm: arm.rate, reverse=True)
            lead = fast.rate / slow.rate if slow.rate > 0 else math.inf
            period = next(p for bound, p in self.periods if lead < bound)
            leader = arms[True] is fast
            choice = leader if turn % period else not leader
        self.withheld += not choice
        return choice

    def record(self, key, drafted: bool, tokens: int, seconds: float) -> None:
        arm = self._arms(key)[drafted]
        arm.tokens = arm.tokens * self.decay + tokens
        arm.seconds = arm.seconds * self.decay + seconds
        arm.rounds += 1

    def rates(self) -> dict:
        """key → (draft tokens/s, plain tokens/s), for a report."""
        return {key: (arms[True].rate, arms[False].rate) for key, arms in self.arms.items()}
