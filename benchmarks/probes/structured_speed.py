"""Structured output with and without speculation on the default model: tokens/s and tokens per target call for
JSON answers that follow a schema, drafters interleaved prompt by prompt, and whether every answer is the same.

    python benchmarks/probes/structured_speed.py [--prompts 12] [--dtype q4]

Prompts: GSM8K test questions (shipped), each asked for a JSON record with fixed fields (the shape agents ask for).
"""

import argparse
import json
import statistics
import warnings

from speculate import SamplingParams, SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.bench import machine_header
from speculate.bench.datasets import load_dataset
from speculate.grammar import json_schema_grammar

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["quantities", "operation", "answer"],
          "properties": {"quantities": {"type": "array", "items": {"type": "number"}, "maxItems": 6},
                         "operation": {"enum": ["add", "subtract", "multiply", "divide", "several"]},
                         "answer": {"type": "number"}}}
DRAFTERS = ["none", "lookup", "retrieval"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--dtype", default="q4")
    a = p.parse_args()
    warnings.simplefilter("ignore")
    print(machine_header()["machine"])
    target = load_model(dtype=a.dtype, progress=False)
    grammar = json_schema_grammar(SCHEMA)
    decoders = {d: SpeculativeDecoder(target, SpeculativeSpec(d)) for d in DRAFTERS}
    params = SamplingParams(max_new_tokens=160, grammar=grammar)
    for d in decoders.values():  # warm-up: llguidance's tokenizer, the store, first calls
        d.generate("Hi.", params)
    questions = [s.turns[0] for s in load_dataset("gsm8k", limit=a.prompts, shots=0)]
    rows = {d: [] for d in DRAFTERS}
    same, parsed = 0, {d: 0 for d in DRAFTERS}
    for i, q in enumerate(questions):
        prompt = f"{q}\nAnswer with a JSON object: the quantities in the question, the operation, the answer."
        outs = {}
        for d in (DRAFTERS if i % 2 == 0 else DRAFTERS[::-1]):
            out = decoders[d].generate(prompt, params)
            if out.finish_reason == "stop":
                json.loads(out.text)  # (an answer cut by max_new_tokens is a JSON prefix)
                parsed[d] += 1
            outs[d] = out.token_ids
            rows[d].append(out.stats)
        same += len({tuple(t) for t in outs.values()}) == 1
    base = sum(s.new_tokens for s in rows["none"]) / sum(s.wall_seconds for s in rows["none"])
    for d in DRAFTERS:
        tps = sum(s.new_tokens for s in rows[d]) / sum(s.wall_seconds for s in rows[d])
        tau = sum(s.new_tokens for s in rows[d]) / sum(s.target_calls for s in rows[d])
        print(f"{d:10s} {tps:6.1f} tokens/s  {tps / base:4.2f}x  {tau:4.2f} tokens/call  "
              f"median {statistics.median(s.new_tokens for s in rows[d])} tokens")
    print(f"the same tokens from every drafter: {same}/{len(questions)}; complete JSON answers (the others hit "
          f"max_new_tokens): {parsed}")


if __name__ == "__main__":
    main()
