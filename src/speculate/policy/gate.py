"""Drafting that never costs: a measured gate over the batch planner's plan (issue 41).

The planner (batch.py) predicts: it weighs E(α, k) tokens against a cost curve T(n)/T(1) measured once, when the
server started. Both ends of that prediction can be wrong while it serves. The curve was measured on one sequence's
rows, at one moment of a machine that other tenants share; α is the lesson's independent-acceptance model, which a
retrieval drafter's all-or-nothing copies do not follow (an idle run's α left to fade back to its prior made the
planner draft again at 0.88× plain on copy prompts at two generations: docs/benchmarks.md, "Speculation that never
costs"); and what a round costs beside the forward (proposing, verifying, rolling back) is left out. So the gate
measures the one thing that matters, the throughput each way:

- **Two arms per key.** A key is a batch size bucket and the drafters in the batch. Arm "draft" is a round run as the
  planner planned it, with some draft. Arm "plain" is a round with every plannable k set to 0 (a round the planner
  planned without drafts counts there too). Each arm keeps the tokens its rounds gave and the seconds they took,
  both decayed by ``decay`` per round of that arm, so a rate is a ratio of sums over its last ~1/(1 − decay) rounds.
- **Exploration first.** Until each arm of a key has ``explore`` rounds, the arms alternate.
- **Then the faster arm, with probes.** The arm with the higher tokens per second runs, and now and then the other
  one, so that the loser is re-measured as the load, the machine and the prompts change. The first probe comes 8
  rounds after an arm takes the lead, and each probe that leaves it in the lead doubles the wait, up to 64 rounds: a
  probe costs a round of the slower arm, so a settled key pays for one round in 64 (engine-level on MT-Bench at one
  generation, probes every 8th round cost 3-4 %: docs/benchmarks.md, "Speculation that never costs"). The leader
  itself is measured every round, so when it slows down, the other arm takes over as soon as the decayed sums say so.

The arms differ only in k, and k never changes what a generation emits where the planner may set it (greedy,
lossless sampling without a seed; a seeded sampling run keeps its k: batch.py, ``_capped``), so the gate moves speed
only, never tokens. It is a pure function of its own state and the rounds reported to it: it never sees a model, a
clock or a run. Its weakness: each arm pools rounds over time, so arms measured in different phases compare unevenly
(in the fading-α trial above, the plain tally came from the answers' slower first rounds and misled it).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Rounds from a new leader to the first probe of the other arm, and the longest wait between probes.
FIRST_PROBE, LONGEST_WAIT = 8, 64


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

    def __init__(self, decay: float = 0.9, explore: int = 4, first_probe: int = FIRST_PROBE,
                 longest_wait: int = LONGEST_WAIT, enabled: bool = True):
        """``enabled`` False (``speculate serve --no-draft-gate``): every round runs as planned, and is still timed
        (``rates``, the server's /metrics), so the gate's view can be read without its decisions."""
        if not 0.0 < decay < 1.0 or explore < 1 or not 1 <= first_probe <= longest_wait:
            raise ValueError("need 0 < decay < 1, explore >= 1 and 1 <= first_probe <= longest_wait")
        self.decay, self.explore, self.first_probe, self.longest_wait = decay, explore, first_probe, longest_wait
        self.enabled = enabled
        self.arms: dict = {}  # key -> {True: Arm (draft), False: Arm (plain)}
        self.leader: dict = {}  # key -> the arm in the lead (True: draft), once both are measured
        self.wait: dict = {}  # key -> [rounds until the next probe, the wait after it]
        self.withheld = 0  # rounds run plain against the plan

    def _arms(self, key) -> dict[bool, Arm]:
        return self.arms.setdefault(key, {True: Arm(), False: Arm()})

    def draft(self, key) -> bool:
        arms = self._arms(key)  # (made even when off: /metrics lists every key the gate has timed)
        if not self.enabled:
            return True
        if min(arm.rounds for arm in arms.values()) < self.explore:
            choice = arms[True].rounds <= arms[False].rounds  # alternate, drafting first
        else:
            leader = arms[True].rate >= arms[False].rate
            if self.leader.get(key) != leader:  # a new leader: probe the other arm soon
                self.leader[key] = leader
                self.wait[key] = [self.first_probe, min(2 * self.first_probe, self.longest_wait)]
            wait = self.wait[key]
            wait[0] -= 1
            choice = leader
            if wait[0] == 0:  # the probe; it doubles the wait while the leader stays in the lead
                choice = not leader
                wait[0], wait[1] = wait[1], min(2 * wait[1], self.longest_wait)
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
