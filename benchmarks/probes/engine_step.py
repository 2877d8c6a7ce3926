"""Probe: what one engine round costs, the same work timed under two source trees (issue 36's "no speed change on the
decode hot path": the code around the forward, before and after a change), interleaved in one run.

    python benchmarks/probes/engine_step.py --trees OLD_CHECKOUT . [--model tiny|smollm2-135m-instruct]
        [--dtype fp32] [--drafters none,lookup] [--rounds 6] [--tokens 128] [--gaps]

Each round starts one process per tree (their order alternating by round), with ``PYTHONPATH=TREE/src``; each process
loads the model, warms every decoder up once, then times greedy decoding of three fixed prompts per drafter and prints
JSON. The table gives, per tree and drafter, the median over rounds of milliseconds per target call and tokens per
second, and new ÷ old. ``--model tiny``: a tiny random model (built here once, so both trees read the same weights),
where the forward costs little and the engine's own Python is most of a round. The trees must decode the same tokens:
the probe says where they do not.

``--gaps`` (a model on the block path: q4, fp32) also times each stretch of a round between the compiled calls, in
microseconds (medians over rounds of each process's median): the forward's Python before the layers' call, the layers
(kernels/decoder.c), the Python from there to the LM head's call (the argmax head's, greedy), the head, the rest of
the forward, and the engine's Python between two forwards (verify, commit, the next proposal). Python there runs with
its code and data evicted by the ~100 MB of weights each forward streams through the caches, so it costs several times
what the same lines cost in a loop of their own; this shows where.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox",
           "def add(a, b):\n    return a + b\n\ndef add(a, b):",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3"]


def measure(args) -> dict:
    """In this process's tree: {drafter: {"calls", "tokens", "seconds", "ids"}} for greedy decoding of PROMPTS."""
    import torch

    import speculate
    from speculate import SpeculativeDecoder, load_model

    torch.set_num_threads(args.threads)
    target = load_model(args.model, dtype=args.dtype, progress=False)
    try:  # the decoder takes a spec (issue 36) ...
        from speculate import SpeculativeSpec

        def make(drafter):
            return SpeculativeDecoder(target, SpeculativeSpec(drafter, k=args.k))
    except ImportError:  # ... or, before it, a drafter's name and k
        def make(drafter):
            return SpeculativeDecoder(target, drafter, k=args.k)
    out = {"source": speculate.__file__}
    marks = _install_marks(target) if args.gaps else None
    for drafter in args.drafters.split(","):
        decoder = make(drafter)
        decoder.generate("Hello there.", max_new_tokens=4, chat=False)  # (a first call's costs are not timed)
        if marks is not None:
            marks.clear()
        calls = tokens = 0
        ids = []
        start = time.perf_counter()
        for prompt in PROMPTS:
            gen = decoder.generate(prompt, max_new_tokens=args.tokens, chat=False)
            calls, tokens = calls + gen.stats.target_calls, tokens + gen.stats.new_tokens
            ids.append(gen.token_ids)
        out[drafter] = {"calls": calls, "tokens": tokens, "seconds": time.perf_counter() - start, "ids": ids}
        if marks is not None:
            out[drafter]["gaps"] = _gaps(marks)
    return out


GAPS = {("forward<", "layers<"): "forward's Python before the layers", ("layers<", "layers>"): "the layers' call",
        ("layers>", "head<"): "Python from the layers to the head", ("head<", "head>"): "the head's call",
        ("head>", "forward>"): "the rest of the forward", ("forward>", "forward<"): "the engine between forwards"}


def _install_marks(target) -> list:
    """Timestamps around the layers' call, the argmax head's and each forward (``--gaps``); cleared per drafter."""
    from speculate.models import blocks, fast

    marks = []

    def timed(name, fn):
        def call(*a, **k):
            marks.append((name + "<", time.perf_counter()))
            try:
                return fn(*a, **k)
            finally:
                marks.append((name + ">", time.perf_counter()))
        return call

    lean = fast.lean_model(target)
    lean.decoder = timed("layers", lean.decoder)
    blocks.BlockLinear.argmax_matmul_2d = timed("head", blocks.BlockLinear.argmax_matmul_2d)
    fast.LeanModel.forward_many = timed("forward", fast.LeanModel.forward_many)
    return marks


def _gaps(marks: list) -> dict:
    """Median microseconds of each stretch of GAPS since the last call; the marks are cleared."""
    found = {}
    for (a, ta), (b, tb) in zip(marks, marks[1:]):
        if (a, b) in GAPS:
            found.setdefault(GAPS[a, b], []).append(1e6 * (tb - ta))
    marks.clear()
    return {name: statistics.median(v) for name, v in found.items()}


def compare(args) -> None:
    trees = [str(Path(tree).resolve()) for tree in args.trees]
    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        if model == "tiny":  # (built by this tree once: both trees load the very same files)
            from speculate.models.tiny import save_tiny_model

            model = str(save_tiny_model(Path(tmp) / "tiny", seed=0))
        results = {tree: [] for tree in trees}
        for r in range(args.rounds):
            for tree in (trees if r % 2 == 0 else trees[::-1]):
                env = {**os.environ, "PYTHONPATH": f"{tree}/src"}
                cmd = [sys.executable, __file__, "--measure", "--model", model, "--dtype", args.dtype, "--drafters",
                       args.drafters, "--tokens", str(args.tokens), "--k", str(args.k), "--threads", str(args.threads),
                       *(["--gaps"] if args.gaps else [])]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                result = json.loads(done.stdout.strip().splitlines()[-1])
                if not result.pop("source").startswith(tree + "/"):  # (an installed speculate would shadow it)
                    raise SystemExit(f"{tree}: the process imported speculate from elsewhere")
                results[tree].append(result)
    old, new = trees
    print(f"model {args.model} at {args.dtype}, {args.rounds} rounds, {len(PROMPTS)} prompts x {args.tokens} tokens, "
          f"{args.threads} threads; medians over rounds")
    print(f"| drafter | tree | ms per target call | tokens/s | tokens per call |\n| --- | --- | --- | --- | --- |")
    for drafter in args.drafters.split(","):
        ms = {}
        for tree in trees:
            runs = [run[drafter] for run in results[tree]]
            ms[tree] = statistics.median(1000 * run["seconds"] / run["calls"] for run in runs)
            tps = statistics.median(run["tokens"] / run["seconds"] for run in runs)
            print(f"| {drafter} | {Path(tree).name} | {ms[tree]:.3f} | {tps:.1f} | "
                  f"{runs[0]['tokens'] / runs[0]['calls']:.2f} |")
        if args.gaps:
            print(f"{drafter}: microseconds per stretch of a round (medians)\n| stretch | {Path(old).name} | "
                  f"{Path(new).name} |\n| --- | --- | --- |")
            for name in GAPS.values():
                cells = [statistics.median(run[drafter]["gaps"].get(name, float("nan")) for run in results[tree])
                         for tree in trees]
                print(f"| {name} | {cells[0]:.0f} | {cells[1]:.0f} |")
        same = results[old][0][drafter]["ids"] == results[new][0][drafter]["ids"]
        print(f"{drafter}: new / old time per call {ms[new] / ms[old]:.3f}; "
              f"{'the same tokens' if same else 'DIFFERENT TOKENS'}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="two checkouts (their src/ is imported)")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--drafters", default="none,lookup")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--gaps", action="store_true", help="time the stretches of a round between the compiled calls")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # (one tree's process)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args)))
    else:
        compare(args)


if __name__ == "__main__":
    main()
