"""What the second activation row costs: int8 and q4 with one row per token (the numerics before issue 34) and with
two (what they run now), beside fp32, interleaved round by round in one process.

    python benchmarks/probes/activation_rows.py [--rounds 3] [--tokens 96] [--out FILE.json]

Each round runs every variant on the same prompts: plain decoding of two chat prompts (a decode step: one row) and
prompt lookup with k = 6 on two copy prompts (verification: up to 7 rows). Reported: tokens/s per variant (the median
over rounds) and its ratio to fp32's, and whether each variant's tokens equal its own plain decoding (they must).
"One row" is the old arithmetic (quantize.set_activation_passes(model, 1)): int8 quantizes x / max|x| on the grid
1/L, q4 runs the kernel with one pass.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from speculate import SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.bench import emit, machine_header
from speculate.bench.speed import PROMPT_SETS
from speculate.models import quantize

CHAT = ["Tell me about the history of Rome in a few paragraphs.",
        "Explain how a refrigerator works to a ten-year-old."]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--out")
    a = p.parse_args(argv)
    machine = machine_header()
    models = {d: load_model(dtype=d) for d in ("fp32", "int8", "q4")}
    variants = [("fp32", "fp32", 1), ("int8 x1", "int8", 1), ("int8 x2", "int8", 2), ("q4 x1", "q4", 1), ("q4 x2", "q4", 2)]
    copy = PROMPT_SETS["copy"][:2]
    speed = {name: {"plain": [], "lookup": []} for name, _, _ in variants}
    equal = {name: 0 for name, _, _ in variants}
    decoders = {}  # one per variant and drafter, made and warmed up with the variant's numerics (q4's decoder
    for name, dtype, rows in variants:  # structs keep the passes they were built with)
        quantize.set_activation_passes(models[dtype].model, rows)
        for drafter in ("none", "lookup"):
            decoders[name, drafter] = SpeculativeDecoder(models[dtype], SpeculativeSpec(drafter, k=6))
            decoders[name, drafter].generate(CHAT[0], max_new_tokens=8)
        quantize.set_activation_passes(models[dtype].model, 2)
    for _ in range(a.rounds):
        for name, dtype, rows in variants:
            quantize.set_activation_passes(models[dtype].model, rows)
            for kind, drafter, prompts in (("plain", "none", CHAT), ("lookup", "lookup", copy)):
                tokens = seconds = 0.0
                for prompt in prompts:
                    out = decoders[name, drafter].generate(prompt, max_new_tokens=a.tokens)
                    tokens += out.stats.new_tokens
                    seconds += out.stats.wall_seconds
                    if kind == "lookup":
                        plain = decoders[name, "none"].generate(prompt, max_new_tokens=a.tokens)
                        equal[name] += plain.token_ids == out.token_ids
                speed[name][kind].append(tokens / seconds)
            quantize.set_activation_passes(models[dtype].model, 2)
    result = {"machine": machine, "threads": torch.get_num_threads(), "rounds": a.rounds, "tokens": a.tokens,
              "tokens_per_second": {n: {k: round(statistics.median(v), 2) for k, v in s.items()} for n, s in speed.items()},
              "lookup_equals_plain": {n: f"{c}/{2 * a.rounds}" for n, c in equal.items()}}
    fp32 = result["tokens_per_second"]["fp32"]
    result["over_fp32"] = {n: {k: round(v / fp32[k], 2) for k, v in s.items()} for n, s in result["tokens_per_second"].items()}
    print(json.dumps({k: result[k] for k in ("tokens_per_second", "over_fp32", "lookup_equals_plain")}, indent=1),
          file=sys.stderr)
    return emit(result, a.out)


if __name__ == "__main__":
    sys.exit(main())
