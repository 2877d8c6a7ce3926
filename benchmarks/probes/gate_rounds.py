"""What drafting costs a batch of generations, round by round, with and without the measured gate (issue 41).

B generations of a prompt set (default: the first MT-Bench first turns; chat prompts, greedy) in seven copies, each
moved by engine.step in turn, round after round, the order reversed every other round: ``none`` (plain decoding),
``k=0`` (the drafter runs, every k forced to 0: what drafting costs when it drafts nothing), ``planned`` (the server's
default k = 6 as a cap the batch planner lowers, no gate: the planner before policy/gate.py), ``gated`` (the planner
with its gate, as `speculate serve` runs it), ``no-peeks`` (the same, but rounds planned no draft do not peek: the
planner before Drafter.peek), ``own-alone`` (a batch of one left to its own policy, the whole cap every round) and
``before`` (neither peeks nor a batch of one planned). Per copy: its rounds, drafted tokens, seconds and tokens/s,
and the gate's rates per key. No server, no HTTP: the engine's cost alone.

    python benchmarks/probes/gate_rounds.py --batch 1 8 32 --max-tokens 128 [--dtype q4] [--drafter auto] [--prompts copy]
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
from speculate.policy.batch import BatchPlanner
from speculate.policy.gate import DraftGate
from speculate.spec import SpeculativeSpec


class Ungated(DraftGate):
    def draft(self, key) -> bool:
        return True


def one_batch(target, drafter: str, batch: int, max_tokens: int, prompts: str) -> None:
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
    copies = {"none": (runs("none"), None), "k=0": (runs(drafter), lambda rs: [0] * len(rs)),
              "planned": (runs(drafter), BatchPlanner(target, Ungated())), "gated": (runs(drafter), gated),
              "no-peeks": (runs(drafter, peek=False), BatchPlanner(target)),
              "own-alone": (runs(drafter), BatchPlanner(target, alone=False)),
              "before": (runs(drafter, peek=False), BatchPlanner(target, alone=False))}
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
            step(live, plan(live) if plan else None)
            dt = time.perf_counter() - t0
            if plan is not None and hasattr(plan, "observe"):
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="q4")
    p.add_argument("--drafter", default="auto")
    p.add_argument("--prompts", default="mt_bench", help="as serve_load's --prompts (copy, paraphrase, mt_bench, ...)")
    args = p.parse_args()
    target = load_model(dtype=args.dtype, progress=False)
    print(machine_header()["machine"])
    for batch in args.batch:
        one_batch(target, resolve(args.drafter, target), batch, args.max_tokens, args.prompts)


if __name__ == "__main__":
    main()
