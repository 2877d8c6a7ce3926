"""Do two CPUs decode the same int8 tokens? The int8 conversion is the same on every CPU by construction
(FORMAT 2, models/quantize.py); a decode step still rounds its fp32 norms, rescaling and attention by this
CPU's kernels. This records, per model, the conversion's digest and, for fixed prompts, plain greedy int8
decoding through the lean decoder: the tokens, a digest of every step's fp32 logits (bit equality), and each
step's margin between the two largest logits (how near a tie the choice was). ``--compare`` sets two records
side by side: equal conversions, equal tokens, equal logits' bits, and where a difference first fell.

    python benchmarks/probes/int8_tokens.py --out docs/runs/int8-tokens/<cpu>.json [--models a,b] [--tokens 96]
    python benchmarks/probes/int8_tokens.py --compare docs/runs/int8-tokens/A.json docs/runs/int8-tokens/B.json

The prompts: the first 8 GSM8K test questions (0-shot) and the first 8 MT-Bench first turns of the packaged data.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys
import tempfile

import torch

from speculate import load_model
from speculate.bench.datasets import load_dataset
from speculate.bench.machine import describe, summary
from speculate.models.fast import FastKVModel
from speculate.text import encode_prompt, eos_ids

# Records made before this date name a conversion by its cache file's sha256, which differs between two writes of
# the same tensors (safetensors writes its metadata in a random order); since, by the tensors' (cache.tensors_digest).
TENSOR_NAMES_SINCE = "2026-12-03"
MODELS = "smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct,qwen2.5-coder-1.5b-instruct"


def decode(fast: FastKVModel, prompt: list[int], tokens: int, stop: set[int]) -> dict:
    """Plain greedy decoding, one token a step, as the engine's plain baseline does."""
    fast.reset(len(prompt) + tokens + 1)
    digest, out, margins = hashlib.sha256(), [], []
    logits = fast.forward(torch.tensor(prompt), last=1)[-1]  # prefill: the next token's logits
    while True:
        digest.update(logits.float().numpy().tobytes())
        top = torch.topk(logits.float(), 2).values
        margins.append(round(float(top[0] - top[1]), 5))
        out.append(int(logits.argmax()))
        if out[-1] in stop or len(out) == tokens:
            break
        logits = fast.forward(torch.tensor(out[-1:]), last=1)[-1]
    return {"tokens": out, "logits_sha256": digest.hexdigest(), "margins": margins}


def record(models: list[str], tokens: int) -> dict:
    samples = load_dataset("gsm8k", limit=8, shots=0) + load_dataset("mt_bench", limit=8)
    result = {"date": datetime.date.today().isoformat(), "machine": summary(), "machine_info": describe(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "tokens": tokens, "models": {}}
    for name in models:
        loaded = load_model(name, dtype="int8", progress=False)
        fast = FastKVModel(loaded)
        rows = []
        for s in samples:
            prompt = encode_prompt(loaded.tokenizer, [{"role": "user", "content": s.turns[0]}])
            rows.append({"id": s.id, **decode(fast, prompt, tokens, eos_ids(loaded))})
        result["models"][name] = {"weights": loaded.weights, "attention": fast.attention,
                                  "row_by_row": fast.row_by_row, "prompts": rows}
        print(f"{name}: {loaded.weights}, {len(rows)} prompts, "
              f"{sum(len(r['tokens']) for r in rows)} tokens", flush=True)
    return result


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y), None) if a != b else None


def compare(path_a: str, path_b: str) -> None:
    a, b = (json.load(open(p)) for p in (path_a, path_b))
    print(f"A: {a['machine']} ({a['cpu_capability']}), {a['date']}\nB: {b['machine']} ({b['cpu_capability']}), "
          f"{b['date']}")
    old = min(a["date"], b["date"]) < TENSOR_NAMES_SINCE
    for name in sorted(a["models"].keys() & b["models"].keys()):
        ma, mb = a["models"][name], b["models"][name]
        same_tokens = same_bits = 0
        notes = []
        for ra, rb in zip(ma["prompts"], mb["prompts"]):
            at = first_difference(ra["tokens"], rb["tokens"])
            same_tokens += at is None
            same_bits += ra["logits_sha256"] == rb["logits_sha256"]
            if at is not None:
                notes.append(f"{ra['id']}: first different token at {at} (margin there {ra['margins'][at]} / "
                             f"{rb['margins'][at]})")
        n = len(ma["prompts"])
        conversion = ("equal" if ma["weights"] == mb["weights"] else "not comparable (a record from before "
                      f"{TENSOR_NAMES_SINCE} names the cache file)" if old else "DIFFERENT")
        print(f"{name}: conversion {conversion} "
              f"({ma['weights']} / {mb['weights']}); tokens equal on {same_tokens}/{n} prompts; "
              f"logits bit-equal on {same_bits}/{n}")
        for note in notes:
            print("  " + note)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--compare", nargs=2, metavar="RECORD")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        sys.exit("int8_tokens.py: give --out FILE.json or --compare A.json B.json")
    result = record(args.models.split(","), args.tokens)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(args.out)), delete=False) as f:
        json.dump(result, f, indent=1)
    os.replace(f.name, args.out)  # atomic: no half-written record
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
