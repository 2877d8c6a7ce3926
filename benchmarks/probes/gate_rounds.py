"""What drafting costs a batch of generations, round by round, with and without the measured gate (issue 41).

B generations of a prompt set (default: the first MT-Bench first turns; chat prompts, greedy) in up to eight copies
(``--copies``), each moved by engine.step in turn, round after round, the order reversed every other round: ``none``
(plain decoding), ``k=0`` (the drafter runs, every k forced to 0: what drafting costs when it drafts nothing),
``planned`` (the server's default k = 6 as a cap the batch planner lowers, no gate: the planner before
policy/gate.py), ``gated`` (the planner with its gate, as `speculate serve` runs it), ``uncut`` (the same, but a
planned draft in a batch is not cut to its planned depth: lookup's growing copies pass it), ``no-peeks`` (uncut, and
rounds planned no draft do not peek: the planner before Drafter.peek), ``own-alone`` (uncut, a batch of one left to
its own policy, the whole cap every round) and ``before`` (uncut, neither peeks nor a batch of one planned). Per copy:
its rounds, drafted tokens, seconds and tokens/s, and the gate's rates per key. No server, no HTTP: the engine's
cost alone.

    python benchmarks/probes/gate_rounds.py --batch 1 8 32 --max-tokens 128 [--dtype q4] [--drafter auto] [--prompts copy]
        [--copies none gated uncut] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from speculate import SpeculativeDecoder
from speculate.bench import machine_header
from speculate.bench.serve_load import prompt_texts
from speculate.drafters import resolve
from speculate.engine import step
from speculate.models import load_model
from speculate.models.loader import DEFAULT_MODEL
from speculate.policy.auto import profile_for
from speculate.policy.batch import BatchPlanner, _plannable
from speculate.policy.gate import DraftGate
from speculate.spec import SpeculativeSpec


class Ungated(DraftGate):
    def draft(self, key) -> bool:
        return True


class Uncut(BatchPlanner):
    """The planner before planned drafts were cut to their depth in a batch: a growing copy drafts past k."""

    def round(self, runs):
        return self._ks(runs, [_plannable(run) for run in runs]), None


class Zero(BatchPlanner):
    """Every k forced to 0 (the drafter still runs: what drafting costs when it drafts nothing)."""

    def round(self, runs):
        return [0] * len(runs), None

    def observe(self, runs, seconds):
        pass


def one_batch(target, drafter: str, batch: int, max_tokens: int, prompts: str, chosen: list[str]) -> dict:
    """One run of every copy at ``batch`` generations; prints a line per copy, returns copy → seconds(none) / its
    seconds."""
    texts = prompt_texts(prompts)
    texts = (texts * (batch // len(texts) + 1))[:batch]

    def runs(name, peek=True):
        decoder = SpeculativeDecoder(target, SpeculativeSpec(name, verifier="greedy", k=6))
        out = [decoder.start(t, max_new_tokens=max_tokens, chat=True) for t in texts]
        for run in out:
            run.k_is_cap = True  # (the server's k, not the request's)
            if not peek:  # (before peeks: a round planned no draft learned nothing)
                run.drafter.peek = lambda tokens: None
        return out

    gated = BatchPlanner(target)
    made = {"none": lambda: (runs("none"), None), "k=0": lambda: (runs(drafter), Zero(target)),
            "planned": lambda: (runs(drafter), BatchPlanner(target, Ungated())),
            "gated": lambda: (runs(drafter), gated),
            "uncut": lambda: (runs(drafter), Uncut(target)),
            "no-peeks": lambda: (runs(drafter, peek=False), Uncut(target)),
            "own-alone": lambda: (runs(drafter), Uncut(target, alone=False)),
            "before": lambda: (runs(drafter, peek=False), Uncut(target, alone=False))}
    copies = {name: made[name]() for name in ["none", *(c for c in chosen if c != "none")]}
    for rs, _ in copies.values():
        while any(r.prefilling for r in rs):
            step(rs, None)
    seconds, rounds = dict.fromkeys(copies, 0.0), dict.fromkeys(copies, 0)
    # Every copy to the end of every answer (the same tokens: greedy and exact), a round of each in turn.
    for i in range(100 * max_tokens):
        order = [name for name in copies if any(not r.done for r in copies[name][0])]
        if not order:
            break
        for name in (order if i % 2 == 0 else order[::-1]):
            rs, plan = copies[name]
            live = [r for r in rs if not r.done]
            t0 = time.perf_counter()
            step(live, *(plan.round(live) if plan else (None, None)))
            dt = time.perf_counter() - t0
            if plan is not None:
                plan.observe(live, dt)
            seconds[name] += dt
            rounds[name] += 1
    tokens = {name: sum(r.produced for r in rs) for name, (rs, _) in copies.items()}
    assert len(set(tokens.values())) == 1, tokens
    for name in copies:
        drafted = sum(r.stats.drafted_tokens for r in copies[name][0])
        print(f"B={batch:<3d} {name:8s} {rounds[name]:4d} rounds, {drafted:5d} drafted, {seconds[name]:6.2f} s, "
              f"{tokens[name] / seconds[name]:6.1f} tokens/s = {seconds['none'] / seconds[name]:.3f}x none")
    rates = {k: tuple(round(x, 1) for x in v) for k, v in gated.gate.rates().items()}
    print(f"B={batch:<3d} gate (draft, plain) tokens/s per key: {rates}; rounds withheld: {gated.gate.withheld}")
    return {name: seconds["none"] / seconds[name] for name in copies}


COPIES = ("none", "k=0", "planned", "gated", "uncut", "no-peeks", "own-alone", "before")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="a model alias or folder (default: the embedded default)")
    p.add_argument("--dtype", default="q4")
    p.add_argument("--drafter", default="auto")
    p.add_argument("--prompts", default="mt_bench", help="as serve_load's --prompts (copy, paraphrase, mt_bench, ...)")
    p.add_argument("--repeat", type=int, default=1, help="run it all this many times; the medians at the end")
    p.add_argument("--copies", nargs="+", default=list(COPIES), choices=COPIES, help="which copies run (none always)")
    args = p.parse_args()
    target = load_model(args.model or DEFAULT_MODEL, dtype=args.dtype, progress=False)
    print(machine_header()["machine"], "|", target.name, args.dtype)
    profile_for(target, batch=True)  # (measured now if not cached, not inside a timed round)
    ratios = {}  # (batch, copy) → each repeat's ratio to plain decoding
    for _ in range(args.repeat):  # (the batch sizes in turn, so that a slow spell of the machine spreads over them all)
        for batch in args.batch:
            got = one_batch(target, resolve(args.drafter, target), batch, args.max_tokens, args.prompts, args.copies)
            for name, ratio in got.items():
                ratios.setdefault((batch, name), []).append(ratio)
    if args.repeat > 1:
        print(f"over {args.repeat} repeats: median (min-max) of each copy's speed over plain decoding's")
        for (batch, name), rs in ratios.items():
            print(f"B={batch:<3d} {name:9s} {statistics.median(rs):.3f}x ({min(rs):.3f}-{max(rs):.3f})")


if __name__ == "__main__":
    main()
