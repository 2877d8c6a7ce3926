"""Probe: the retrieval drafter's settings, replayed on held-out answers (how drafters/retrieval.py's
defaults were chosen).

    python benchmarks/probes/retrieval_replay.py [--answers replay.json] [--threads 2]

1. Plain int8 decoding of the default model answers held-out prompts: MT-Bench questions 41-60 and GSM8K
   test questions 101-120 (neither in the shipped answer store, whose prompts are GSM8K *train* questions,
   chat questions and rewrite tasks, nor among the benchmark's samples), 128 new tokens, greedy; saved to
   ``--answers`` (reused when it exists).
2. Each setting's drafter is replayed on those answers: at every round it proposes from the committed
   prefix, the answer says how many drafts greedy verification keeps, and the round costs T(rows)/T(1) on
   section 4's int8 curve. Greedy acceptance is deterministic, so the replayed τ is what decoding gives;
   the estimated speedup is tokens ÷ Σ T(rows)/T(1) (drafting itself counted as free): a cost model, not a
   timing.

Prints τ and the estimated speedup per dataset for lookup and each setting. Results in
docs/benchmarks.md section 7.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from speculate import SpeculativeDecoder, load_model
from speculate.bench.datasets import load_dataset
from speculate.drafters import get_drafter
from speculate.drafters import retrieval as retrieval_module
from speculate.drafters.answer_store import FILE, AnswerStore, shipped_store
from speculate.sampling import Sampling
from speculate.text import encode_prompt

# docs/benchmarks.md section 4 (default model, int8, 2 threads): T(n)/T(1) at n = 1, 2, 4, 8, 16, linear between.
MEASURED = {1: 1.0, 2: 1.09, 4: 1.24, 8: 1.52, 16: 1.90}
HELD_OUT = (("mt_bench", 40, 60), ("gsm8k", 100, 120))


def cost(rows: int) -> float:
    points = sorted(MEASURED)
    for lo, hi in zip(points, points[1:]):
        if rows <= hi:
            return MEASURED[lo] + (MEASURED[hi] - MEASURED[lo]) * (rows - lo) / (hi - lo)
    return MEASURED[points[-1]] * rows / points[-1]


def answers(path: Path) -> list[dict]:
    if path.is_file():
        return json.loads(path.read_text())
    model = load_model("smollm2-135m-instruct", dtype="int8")
    plain = SpeculativeDecoder(model, "none")
    out = []
    for name, lo, hi in HELD_OUT:
        for sample in load_dataset(name, limit=hi, shots=0)[lo:hi]:
            ids = encode_prompt(model.tokenizer, sample.turns[0])
            out.append({"dataset": name, "id": sample.id, "prompt_ids": ids,
                        "token_ids": plain.generate(ids, max_new_tokens=128).token_ids})
            print(f"answered {sample.id}", file=sys.stderr, flush=True)
    path.write_text(json.dumps(out))
    return out


def replay(drafter, records, k) -> dict:
    result = {}
    for name, _, _ in HELD_OUT:
        tokens = rounds = units = 0
        for r in (r for r in records if r["dataset"] == name):
            committed, answer = list(r["prompt_ids"]), r["token_ids"]
            drafter.begin(list(committed), Sampling(), None)
            done = 0
            while done < len(answer):
                budget = len(answer) - done - 1  # as the engine prunes a draft to what the budget still takes
                draft = drafter.propose(committed, min(k, budget)).tokens.tolist()[:budget]
                kept = 0
                while kept < len(draft) and draft[kept] == answer[done + kept]:
                    kept += 1
                drafter.update(kept, answer[done + kept])
                committed += answer[done: done + kept + 1]
                done += kept + 1
                tokens, rounds, units = tokens + kept + 1, rounds + 1, units + cost(len(draft) + 1)
        result[name] = f"τ {tokens / rounds:.2f}, est. {tokens / units:.2f}x"
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--answers", default="retrieval-replay-answers.json")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the replay itself is deterministic)")
    parser.add_argument("--store-sizes", default="",
                        help="instead of the settings grid: the default settings with stores of the first N answers "
                             "of the shipped one, e.g. 256,512,1024,2048 (how τ grows with the store)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    records = answers(Path(args.answers))
    target = load_model("smollm2-135m-instruct", dtype="int8")
    print("lookup k=6", replay(get_drafter("lookup"), records, 6))
    if args.store_sizes:
        drafter = get_drafter("retrieval", None, target)
        shipped = _answers(target)
        for n in (int(x) for x in args.store_sizes.split(",")):
            drafter.store = AnswerStore(shipped[:n], max_n=retrieval_module.MAX_N, min_count=retrieval_module.MIN_COUNT,
                                        min_n=retrieval_module.MIN_N)
            print(f"retrieval k=6, a store of {n} answers ({len(drafter.store.table)} n-grams)",
                  replay(drafter, records, 6), flush=True)
        return
    for min_count in (1, 2):  # the shipped store's answers, counted into tables of each setting
        for min_n in (1, 2):
            drafter = get_drafter("retrieval", None, target)
            drafter.store, drafter.min_n = _store(target, min_count, min_n), min_n
            for k in (4, 6):
                for min_context in (2, 3):
                    for min_share in (0.0, 0.3, 0.5):
                        drafter.min_context, drafter.min_share = min_context, min_share
                        print(f"retrieval k={k} min_context={min_context} min_share={min_share} min_count={min_count} "
                              f"min_n={min_n}", replay(drafter, records, k), flush=True)


def _store(target, min_count, min_n) -> AnswerStore:
    return AnswerStore(_answers(target), max_n=retrieval_module.MAX_N, min_count=min_count, min_n=min_n)


def _answers(target) -> list[list[int]]:
    """The shipped store's answers, in the order of their prompts (slots of four: a GSM8K question, two chat
    questions, a rewrite task), so that the first N are a balanced subset."""
    from safetensors import safe_open

    with safe_open(str(shipped_store(target) / FILE), "pt") as f:
        tokens, starts = f.get_tensor("tokens").tolist(), f.get_tensor("starts").tolist()
    return [tokens[a:b] for a, b in zip(starts, starts[1:])]


if __name__ == "__main__":
    main()
