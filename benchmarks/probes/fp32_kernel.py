"""Probe: dtype fp32 through the kernel's F32 layers (models/blocks.py F32Linear: the model's own weights, each
row's sums in a fixed order) against fp32 on PyTorch's matmuls (what fp32 ran before), on the default model
(docs/benchmarks.md, "fp32 through the kernel").

    python benchmarks/probes/fp32_kernel.py [--prompts 16] [--tokens 128] [--rounds 2]

Both loaded in one process; for each of the first N shipped MT-Bench first turns, greedy plain decoding with each,
the order alternating by prompt and by round: tokens/s of each (the prompt's prefill included), how many answers are
the same token for token, and where the others first differ (two fp32 computations of one model: a near-tie can go
either way). Then greedy speculation (lookup, retrieval at k = 5) against plain decoding on the kernel path: the same
tokens every time, by construction.
"""

import argparse
import statistics
import time
from unittest import mock

from speculate import SpeculativeDecoder, load_model
from speculate.bench.datasets import load_dataset
from speculate.bench.machine import summary
from speculate.models import fast
from speculate.models.fast import FastKVModel
from speculate.spec import SpeculativeSpec


def loaded_as(path: str):
    loaded = load_model("smollm2-135m-instruct", dtype="fp32", progress=False)
    if path == "torch":
        with mock.patch.object(fast, "float_kernel", lambda model: False):  # its lean model keeps F.linear
            FastKVModel(loaded)
    return loaded


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(summary())
    prompts = [[{"role": "user", "content": s.turns[0]}] for s in load_dataset("mt_bench", limit=args.prompts)]
    decoders = {path: SpeculativeDecoder(loaded_as(path), SpeculativeSpec("none")) for path in ("kernel", "torch")}
    answers, rates = {}, {path: [] for path in decoders}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for path in (list(decoders) if (i + r) % 2 == 0 else list(decoders)[::-1]):
                t = time.perf_counter()
                out = decoders[path].generate(prompt, max_new_tokens=args.tokens)
                rates[path].append(len(out.token_ids) / (time.perf_counter() - t))
                answers[path, i] = out
    for path, values in rates.items():
        print(f"{path}: {statistics.median(values):.1f} tokens/s (median of {len(values)}), exactness "
              f"{answers[path, 0].stats.exactness}")
    ratios = sorted(a / b for a, b in zip(rates["kernel"], rates["torch"]))
    print(f"kernel / torch per answer: median {statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})")
    same, firsts = 0, []
    for i in range(len(prompts)):
        a, b = answers["kernel", i].token_ids, answers["torch", i].token_ids
        if a == b:
            same += 1
        else:
            firsts.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    print(f"identical answers: {same}/{len(prompts)}; the others first differ at tokens {sorted(firsts)}")
    kernel = decoders["kernel"].target
    for method in ("lookup", "retrieval"):
        decoder = SpeculativeDecoder(kernel, SpeculativeSpec(method, verifier="greedy", k=5))
        equal = sum(decoder.generate(p, max_new_tokens=args.tokens).token_ids == answers["kernel", i].token_ids
                    for i, p in enumerate(prompts))
        print(f"{method} = plain (kernel path): {equal}/{len(prompts)}")


if __name__ == "__main__":
    main()
