"""Probe: how often greedy speculative decoding reproduces plain greedy decoding token for token, per precision
(docs/benchmarks.md, "Exactness"). int8 is exact by construction (tests/test_exactness.py); fp32 is not — its
BLAS sums a verified row in another order than a one-token step — and this measures how often that shows.

    python benchmarks/probes/exact_share.py [--tokens 64] [--dtypes fp32,int8]

The default model, the 20 held-out prompts of tests/test_exactness.py (10 GSM8K test questions, 10 MT-Bench
first turns, from the packaged data), lookup, retrieval and the shipped EAGLE tree at k = 5: the share of
outputs identical to plain decoding at the same precision, and where the first difference fell.
"""

import argparse

from speculate import SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.bench.datasets import load_dataset
from speculate.bench.machine import summary

METHODS = ("lookup", "retrieval", "eagle")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--dtypes", default="fp32,int8")
    args = parser.parse_args()
    print(summary())
    prompts = [[{"role": "user", "content": s.turns[0]}]
               for s in load_dataset("gsm8k", limit=10, shots=0) + load_dataset("mt_bench", limit=10)]
    for dtype in args.dtypes.split(","):
        target = load_model(dtype=dtype, progress=False)
        plain = SpeculativeDecoder(target, SpeculativeSpec("none"))
        refs = [plain.generate(p, max_new_tokens=args.tokens) for p in prompts]
        print(f"{dtype} (exactness: {refs[0].stats.exactness}), {len(prompts)} prompts, {args.tokens} new tokens:")
        for method in METHODS:
            decoder = SpeculativeDecoder(target, SpeculativeSpec(method, verifier="greedy", k=5))
            same, first = 0, []
            for prompt, ref in zip(prompts, refs):
                out = decoder.generate(prompt, max_new_tokens=args.tokens).token_ids
                if out == ref.token_ids:
                    same += 1
                else:
                    first.append(next(i for i, (a, b) in enumerate(zip(out + [-1], ref.token_ids + [-2])) if a != b))
            print(f"  {method}: {same}/{len(prompts)} identical" + (f"; first difference at token {sorted(first)}"
                                                                     if first else ""))


if __name__ == "__main__":
    main()
