"""What greedy decoding's argmax head saves a round (issue 41): B generations decoded twice, round for round, one copy
with the LM head's logits computed in full (``LeanModel.argmax_head`` off) and one through the argmax head (only the
groups of outputs that may hold a row's greatest get their second activation pass; the rest -inf), the order of the
two reversed every other round. Both copies must give the same tokens (asserted). Per batch size: seconds, tokens/s,
the ratio, and the groups of outputs per row that ran their second pass. No server, no HTTP: the engine's cost alone.

    python benchmarks/probes/argmax_head.py --batch 1 8 16 32 --max-tokens 128 [--model ALIAS] [--drafter none]
        [--repeat 3]

``--head``: the LM head alone instead, on the final-normed rows of two greedy answers (MT-Bench's first two): at
1-32 rows, the full call, the argmax head and the first pass alone (``passes`` 1: the floor), interleaved, medians;
then, with the bound's inputs cut into 1, 2, 4 and 8 segments (``blocks.SEGMENTS``), the groups per row that ran
their second pass and the argmax head's time at 8 rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from speculate import SpeculativeDecoder
from speculate.bench import machine_header
from speculate.bench.serve_load import prompt_texts
from speculate.engine import step
from speculate.models import blocks, load_model
from speculate.models.fast import lean_model
from speculate.models.loader import DEFAULT_MODEL
from speculate.spec import SpeculativeSpec


def one_batch(target, drafter: str, batch: int, max_tokens: int, prompts: str) -> float:
    """Both copies at ``batch`` generations, round for round; prints their lines, returns full seconds / argmax
    seconds."""
    lean = lean_model(target)
    head = lean.argmax_head
    texts = prompt_texts(prompts)
    texts = (texts * (batch // len(texts) + 1))[:batch]
    groups = []  # second-pass groups per row, over the argmax copy's calls
    calls = head.argmax_matmul_2d

    def counted(x):
        y, n = calls(x)
        groups.extend(n.tolist())
        return y, n

    copies = {}
    for name in ("full", "argmax"):
        decoder = SpeculativeDecoder(target, SpeculativeSpec(drafter, verifier="greedy", k=6))
        copies[name] = [decoder.start(t, max_new_tokens=max_tokens, chat=True) for t in texts]
    seconds, rounds = dict.fromkeys(copies, 0.0), dict.fromkeys(copies, 0)
    for i in range(100 * max_tokens):
        order = [name for name in copies if any(not r.done for r in copies[name])]
        if not order:
            break
        for name in order if i % 2 == 0 else order[::-1]:
            lean.argmax_head = head if name == "argmax" else None
            head.argmax_matmul_2d = counted
            live = [r for r in copies[name] if not r.done]
            t0 = time.perf_counter()
            step(live)
            seconds[name] += time.perf_counter() - t0
            rounds[name] += 1
    lean.argmax_head = head
    del head.argmax_matmul_2d  # (the class's method again)
    tokens = {name: [r.tokens for r in rs] for name, rs in copies.items()}
    assert tokens["full"] == tokens["argmax"], "the argmax head changed a token"
    produced = sum(r.produced for r in copies["full"])
    total = -(-lean.vocab_size // 8)
    for name in copies:
        print(f"B={batch:<3d} {name:7s} {rounds[name]:4d} rounds, {seconds[name]:6.2f} s, "
              f"{produced / seconds[name]:6.1f} tokens/s = {seconds['full'] / seconds[name]:.3f}x full")
    print(f"B={batch:<3d} second-pass groups per row: mean {statistics.mean(groups):.1f}, median "
          f"{statistics.median(groups):.0f}, max {max(groups)} of ~{total} ({len(groups)} rows)")
    return seconds["full"] / seconds["argmax"]


def head_alone(target, max_tokens: int) -> None:
    """``--head``: the three calls on the same rows, interleaved (module docstring)."""
    lean = lean_model(target)
    head, rows, kept = lean.argmax_head, [], lean._head

    def grab(x, argmax):  # (the rows the head gets while two answers are decoded)
        rows.append(x.clone())
        return kept(x, argmax)

    lean._head = grab
    decoder = SpeculativeDecoder(target, SpeculativeSpec("none", verifier="greedy"))
    for text in prompt_texts("mt_bench")[:2]:
        decoder.generate(text, max_new_tokens=max_tokens, chat=True)
    del lean._head
    x = torch.cat(rows[1:])  # (not the first prompt's last row: a prefill's)

    def one_pass(x):
        head.passes = 1
        try:
            return head.matmul_2d(x)
        finally:
            head.passes = 2

    calls = {"full": head.matmul_2d, "argmax": head.argmax_matmul_2d, "first pass": one_pass}
    for n in (1, 8, 16, 32):
        times = {name: [] for name in calls}
        for _ in range(3):
            for name, call in calls.items():
                for _ in range(3):
                    call(x[:n])
                for _ in range(20):
                    t0 = time.perf_counter()
                    call(x[:n])
                    times[name].append(time.perf_counter() - t0)
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"rows {n:2d}: full {ms['full']:.3f} ms, argmax {ms['argmax']:.3f} ms, first pass {ms['first pass']:.3f} "
              f"ms; full / argmax {ms['full'] / ms['argmax']:.2f}")
    kept = blocks.SEGMENTS
    for segments in (1, 2, 4, 8):
        blocks.SEGMENTS, head._l1 = segments, None
        groups = head.argmax_matmul_2d(x)[1].float()
        for _ in range(3):
            head.argmax_matmul_2d(x[:8])
        t0 = time.perf_counter()
        for _ in range(20):
            head.argmax_matmul_2d(x[:8])
        ms = (time.perf_counter() - t0) / 20 * 1e3
        print(f"{segments} segments: groups per row mean {groups.mean():.1f}, median {groups.median():.0f}, max "
              f"{groups.max():.0f} of {head.l1().shape[0]} ({len(x)} rows); 8 rows {ms:.3f} ms")
    blocks.SEGMENTS, head._l1 = kept, None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--model", default=None, help="a model alias or folder (default: the embedded default)")
    p.add_argument("--drafter", default="none")
    p.add_argument("--prompts", default="mt_bench", help="as serve_load's --prompts (copy, paraphrase, mt_bench, ...)")
    p.add_argument("--repeat", type=int, default=1, help="run it all this many times; the medians at the end")
    p.add_argument("--head", action="store_true", help="the LM head alone (module docstring)")
    args = p.parse_args()
    target = load_model(args.model or DEFAULT_MODEL, dtype="q4", progress=False)
    print(machine_header()["machine"], "|", target.name, "q4 |", args.drafter)
    if lean_model(target).argmax_head is None or not lean_model(target).argmax_head.argmax_runs():
        raise SystemExit(f"{target.name}: its LM head has no argmax head (a type with offset terms, or one pass)")
    if args.head:
        head_alone(target, args.max_tokens)
        return
    ratios = {}
    for _ in range(args.repeat):  # (the batch sizes in turn: a slow spell of the machine spreads over them all)
        for batch in args.batch:
            ratios.setdefault(batch, []).append(one_batch(target, args.drafter, batch, args.max_tokens, args.prompts))
    if args.repeat > 1:
        print(f"over {args.repeat} repeats: median (min-max) of argmax's speed over full's")
        for batch, rs in ratios.items():
            print(f"B={batch:<3d} {statistics.median(rs):.3f}x ({min(rs):.3f}-{max(rs):.3f})")


if __name__ == "__main__":
    main()
