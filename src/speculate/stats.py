"""The measurements of one generation, as the Consultant Decoding paper reports them (§4)."""

from __future__ import annotations

from dataclasses import dataclass, field


def alpha_mle(accepted: float, rejecting_rounds: float) -> float | None:
    """Per-draft acceptance rate α, the maximum-likelihood estimate under the lesson's model (each draft
    kept independently with probability α until the first rejection): a round that keeps n drafts and
    then rejects one is n successes and one failure, so α̂ = Σ accepted / (Σ accepted + rejecting rounds).
    None without any trial."""
    trials = accepted + rejecting_rounds
    return accepted / trials if trials else None


@dataclass
class Stats:
    new_tokens: int = 0
    target_calls: int = 0  # target forwards that verify: one per round (the first may also complete the prompt)
    drafted_tokens: int = 0
    accepted_draft_tokens: int = 0
    rejected_rounds: int = 0  # rounds that kept fewer drafts than their deepest path
    drafted_by_position: list[int] = field(default_factory=list)  # rounds that drafted position (depth) i
    accepted_by_position: list[int] = field(default_factory=list)  # rounds that accepted position (depth) i
    prefill_seconds: float = 0.0
    wall_seconds: float = 0.0  # prefill + decoding; loading excluded
    reused_prompt_tokens: int = 0  # prompt tokens whose KV the target's cache kept from the last generation
    prompt_tokens: int = 0
    # Where the decoding time went (after the prefill): the target's verification forwards, and the drafter's
    # proposals, the first round's apart (a draft model prefills the prompt inside its first proposal). The rest of
    # the wall time is the engine's own (verification, warping, rollback, commit, detokenising).
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    first_draft_seconds: float = 0.0
    # How the target's verified rows equal one-token decoding (models/exactness.py): "batched" (checked at load
    # on this machine), "row-by-row" (the check failed: rows verified one at a time) or "none" (not claimed).
    exactness: str = "none"
    # Rounds that drafted nothing (k = 0) but peeked at the drafter's free first token (Drafter.peek), and those whose
    # next token was it: α's evidence where nothing is drafted (a capped k's, speculate/policy/batch.py).
    peeked_rounds: int = 0
    peek_hits: int = 0

    def record(self, n_drafted: int, n_accepted: int, depth: int | None = None) -> None:
        """One round: ``n_drafted`` tokens proposed, ``n_accepted`` of them kept. A tree of
        ``n_drafted`` nodes drafts positions (depths) 1..``depth`` and accepts a path of
        ``n_accepted``; a chain's depth is its length (the default)."""
        depth = n_drafted if depth is None else depth
        self.target_calls += 1
        self.drafted_tokens += n_drafted
        self.accepted_draft_tokens += n_accepted
        self.rejected_rounds += n_accepted < depth
        grow = depth - len(self.drafted_by_position)
        if grow > 0:
            self.drafted_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(depth):
            self.drafted_by_position[i] += 1
            self.accepted_by_position[i] += i < n_accepted

    def peek(self, hit: bool) -> None:
        """A round that drafted nothing peeked; ``hit``: the target's next token was the peeked one."""
        self.peeked_rounds += 1
        self.peek_hits += hit

    def timed_round(self, draft_seconds: float, target_seconds: float) -> None:
        """The seconds of one round's proposal and target forward (called before :meth:`record` counts the round)."""
        if self.target_calls:
            self.draft_seconds += draft_seconds
        else:
            self.first_draft_seconds += draft_seconds
        self.target_seconds += target_seconds

    @property
    def mean_accepted_length(self) -> float:
        """New tokens per target call (τ in the paper; 1.0 for plain decoding)."""
        return self.new_tokens / self.target_calls if self.target_calls else 0.0

    @property
    def llm_calls_ratio(self) -> float:
        """Target calls per new token (the paper's LLM-calls ratio; 1.0 for plain decoding)."""
        return self.target_calls / self.new_tokens if self.new_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P(draft position i accepted | drafted); position 1 first."""
        return [a / d for a, d in zip(self.accepted_by_position, self.drafted_by_position) if d]

    @property
    def alpha_estimate(self) -> float | None:
        """α̂ of this generation (:func:`alpha_mle`)."""
        return alpha_mle(self.accepted_draft_tokens, self.rejected_rounds)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "drafted_tokens": self.drafted_tokens,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "rejected_rounds": self.rejected_rounds,
            "peeked_rounds": self.peeked_rounds,
            "peek_hits": self.peek_hits,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "llm_calls_ratio": round(self.llm_calls_ratio, 4),
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position],
            "drafted_by_position": list(self.drafted_by_position),
            "accepted_by_position": list(self.accepted_by_position),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "prompt_tokens": self.prompt_tokens,
            "target_seconds": round(self.target_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "first_draft_seconds": round(self.first_draft_seconds, 4),
            "exactness": self.exactness,
            "wall_seconds": round(self.wall_seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
        }


# The counts and times that add up over generations (the rest of Stats.to_dict() are ratios of these).
SUMMED = ("new_tokens", "target_calls", "drafted_tokens", "target_seconds", "draft_seconds", "first_draft_seconds",
          "prefill_seconds", "wall_seconds")


def summed_stats(stats: list[dict]) -> dict:
    """Several generations' stats (``Stats.to_dict()``) summed into one, with their count as ``generations``: the
    bench's calibration costs, and what calc/results.py's ``method_costs`` reads."""
    return {**{key: sum(s.get(key, 0) for s in stats) for key in SUMMED}, "generations": len(stats)}
