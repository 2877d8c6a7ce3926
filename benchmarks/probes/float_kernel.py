"""Probe: fp32 and bf16 through the kernel's float layers (models/blocks.py FloatLinear: the model's own weights,
each row's sums in fp32 in a fixed order) against the same precisions on PyTorch's matmuls (what they ran before),
and q4, on the default model (docs/benchmarks.md, "fp32 through the kernel", "bf16 through the kernel").

    python benchmarks/probes/float_kernel.py [--paths fp32,fp32-torch] [--prompts 16] [--tokens 128] [--rounds 2]

``--paths``: precisions (fp32, bf16, int8, q4), a ``-torch`` suffix for fp32 or bf16 on PyTorch's layers; the
first is the reference. All loaded in one process; for each of the first N shipped MT-Bench first turns, greedy
plain decoding with each, the order rotating by prompt and by round: tokens/s of each (the prompt's prefill
included), each path's per-answer ratio to the reference's, how many answers are the reference's token for token,
and where the others first differ. Then greedy speculation (lookup, retrieval at k = 5) against plain decoding on
each kernel path: the same tokens every time, by construction.
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
    dtype, _, torch_layers = path.partition("-")
    loaded = load_model("smollm2-135m-instruct", dtype=dtype, progress=False)
    if torch_layers:
        with mock.patch.object(fast, "float_kernel", lambda model: False):  # its lean model keeps F.linear
            FastKVModel(loaded)
    return loaded


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--paths", default="fp32,fp32-torch")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(summary())
    paths = args.paths.split(",")
    prompts = [[{"role": "user", "content": s.turns[0]}] for s in load_dataset("mt_bench", limit=args.prompts)]
    decoders = {path: SpeculativeDecoder(loaded_as(path), SpeculativeSpec("none")) for path in paths}
    answers, rates = {}, {path: [] for path in paths}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            shift = (i + r) % len(paths)
            for path in paths[shift:] + paths[:shift]:
                t = time.perf_counter()
                out = decoders[path].generate(prompt, max_new_tokens=args.tokens)
                rates[path].append(len(out.token_ids) / (time.perf_counter() - t))
                answers[path, i] = out
    reference = paths[0]
    for path, values in rates.items():
        print(f"{path}: {statistics.median(values):.1f} tokens/s (median of {len(values)}), exactness "
              f"{answers[path, 0].stats.exactness}")
    for path in paths[1:]:
        ratios = sorted(a / b for a, b in zip(rates[path], rates[reference]))
        print(f"{path} / {reference} per answer: median {statistics.median(ratios):.2f}x "
              f"({ratios[0]:.2f}-{ratios[-1]:.2f})")
        same, firsts = 0, []
        for i in range(len(prompts)):
            a, b = answers[path, i].token_ids, answers[reference, i].token_ids
            if a == b:
                same += 1
            else:
                firsts.append(next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
        print(f"  answers identical to {reference}'s: {same}/{len(prompts)}; the others first differ at tokens "
              f"{sorted(firsts)}")
    for path in paths:
        if path.endswith("-torch"):
            continue
        for method in ("lookup", "retrieval"):
            decoder = SpeculativeDecoder(decoders[path].target, SpeculativeSpec(method, verifier="greedy", k=5))
            equal = sum(decoder.generate(p, max_new_tokens=args.tokens).token_ids == answers[path, i].token_ids
                        for i, p in enumerate(prompts))
            print(f"{method} = plain ({path}): {equal}/{len(prompts)}")


if __name__ == "__main__":
    main()
