"""Draft-tree shapes for the head drafters, compared interleaved on tuning prompts:

    python -m speculate.bench.trees [--model M] [--dtype int8] [--heads DIR] [--prompts 4]
                                    [--max-new-tokens 96] [--out FILE.json]

Greedy decoding with the EAGLE head's dynamic tree at several (depth, top-k, node budget) shapes, its
chain at a few lengths, Medusa's tree and chain, and the EAGLE tree and chain with prompt lookup merged
in at a few head depths (lookup's copies up to k = 6), and EAGLE chains gated by the head's confidence,
against plain decoding of the same target, per
prompt in rotated order. The prompts are MT-Bench questions 41 onwards and GSM8K *test* questions 100
onwards: disjoint from the ones ``benchmarks/heads-default*.toml`` reports on (the first 10 of each), so
that the shipped defaults are not tuned on the benchmark. Reported: τ (new tokens per target call) and
the speedup over plain decoding (ratio of tokens per second), per prompt set.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date

import torch

from ..drafters import get_drafter
from ..drafters.eagle import EagleDrafter
from ..drafters.medusa import MedusaDrafter
from ..engine import SpeculativeDecoder
from ..spec import SpeculativeSpec
from ..models import DEFAULT_MODEL, load_model
from . import emit, machine_header, script
from .datasets import default_data_dir

#: (depth, top-k, budget) of the EAGLE trees tried.
SHAPES = [(6, 3, 12), (5, 3, 10), (4, 3, 8), (5, 2, 8), (4, 2, 6), (3, 2, 4), (6, 4, 16)]
CHAINS = [2, 3, 4]
#: The heads' depths tried with lookup merged in (``eagle+lookup`` / ``eagle-chain+lookup`` at k = 6).
WITH_LOOKUP = {"eagle": [2, 3], "eagle-chain": [1, 2, 3]}
#: EAGLE chains (k = 3) that stop below these top probabilities (``EagleDrafter(min_confidence=...)``),
#: alone and with lookup merged in.
GATES = [0.2, 0.35, 0.5]


def tuning_prompts(n: int) -> dict[str, list[str]]:
    root = default_data_dir()
    with open(root / "mt_bench" / "question.jsonl") as f:
        mt = [json.loads(line)["turns"][0] for line in f if line.strip()][40: 40 + n]
    with open(root / "gsm8k" / "test.jsonl") as f:
        gsm = [json.loads(line)["question"] for line in f if line.strip()][100: 100 + n]
    return {"mt_bench": mt, "gsm8k": gsm}


def decoders(target, heads: str | None) -> dict[str, SpeculativeDecoder]:
    eagle = heads and f"{heads}/eagle"
    medusa = heads and f"{heads}/medusa"
    out = {"plain": SpeculativeDecoder(target, SpeculativeSpec("none"))}

    def greedy(drafter, k):
        return SpeculativeDecoder(target, SpeculativeSpec(verifier="greedy", k=k), drafter=drafter)

    for depth, topk, budget in SHAPES:
        drafter = EagleDrafter(target, eagle, tree=True, topk=topk, budget=budget, depth=depth)
        out[f"eagle depth={depth} topk={topk} budget={budget}"] = greedy(drafter, depth)
    for k in CHAINS:
        out[f"eagle-chain k={k}"] = greedy(EagleDrafter(target, eagle), k)
    out["medusa (tree)"] = greedy(MedusaDrafter(target, medusa, tree=True), 4)
    for k in CHAINS[:2]:
        out[f"medusa-chain k={k}"] = greedy(MedusaDrafter(target, medusa), k)
    for name, depths in WITH_LOOKUP.items():  # the registry's merged drafters, at each head depth
        for depth in depths:
            # The chain ungated, as its tables in docs/benchmarks.md ran (the registry's default gates it).
            ungated = {"min_confidence": 0.0} if name == "eagle-chain" else {}
            drafter = get_drafter(f"{name}+lookup", None, target, heads=eagle, base_k=depth, **ungated)
            out[f"{name}+lookup depth={depth} k=6"] = greedy(drafter, 6)
    for gate in GATES:
        gated = EagleDrafter(target, eagle, min_confidence=gate)
        out[f"eagle-chain min_confidence={gate} k=3"] = greedy(gated, 3)
        merged = get_drafter("eagle-chain+lookup", None, target, heads=eagle, base_k=3, min_confidence=gate)
        out[f"eagle-chain+lookup min_confidence={gate} depth=3 k=6"] = greedy(merged, 6)
    return out


def run(model: str, dtype: str, heads: str | None, n_prompts: int, max_new_tokens: int) -> dict:
    machine = machine_header()  # at the start: the threads and load as the run begins
    target = load_model(model, dtype=dtype)
    methods = decoders(target, heads)
    names = list(methods)
    sets = tuning_prompts(n_prompts)
    totals = {(s, m): [0.0, 0, 0] for s in sets for m in names}  # seconds, tokens, target calls
    same = {m: 0 for m in names}
    methods["plain"].generate(sets["gsm8k"][0], max_new_tokens=4)  # warm-up
    done = 0
    for set_name, prompts in sets.items():
        for i, prompt in enumerate(prompts):
            rot = (done * 3) % len(names)  # rotate: no method always first or after the same one
            outs = {}
            for name in names[rot:] + names[:rot]:
                g = methods[name].generate(prompt, max_new_tokens=max_new_tokens)
                outs[name] = g.token_ids
                t = totals[set_name, name]
                t[0] += g.stats.wall_seconds
                t[1] += g.stats.new_tokens
                t[2] += g.stats.target_calls
            for name in names:
                same[name] += outs[name] == outs["plain"]
            done += 1
            print(f"  {done}/{sum(map(len, sets.values()))} prompts", file=sys.stderr)
    result = {"date": date.today().isoformat(), **machine, "torch": torch.__version__, "model": model,
              "dtype": dtype, "heads": heads or "shipped", "max_new_tokens": max_new_tokens,
              "identical_to_plain": {m: f"{same[m]}/{done}" for m in names}, "sets": {}}
    for set_name in sets:
        plain_s, plain_t, _ = totals[set_name, "plain"]
        result["sets"][set_name] = {
            name: {"tau": round(t / c, 3) if c else None, "speedup": round((t / s) / (plain_t / plain_s), 3)}
            for name, (s, t, c) in ((m, totals[set_name, m]) for m in names)}
    return result


def main(argv=None) -> int:
    from ..models import DTYPES

    p = argparse.ArgumentParser(prog="python -m speculate.bench.trees", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--heads", help="a folder with medusa/ and eagle/ heads (default: the shipped ones)")
    p.add_argument("--prompts", type=int, default=4, help="prompts per set (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", help="write the result as JSON here (atomically)")
    a = p.parse_args(argv)
    if a.prompts < 1 or a.max_new_tokens < 1:
        p.error("--prompts and --max-new-tokens must be >= 1")
    return emit(run(a.model, a.dtype, a.heads, a.prompts, a.max_new_tokens), a.out)


if __name__ == "__main__":
    sys.exit(script(main))
