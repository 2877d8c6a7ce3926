"""Probe: the retrieval drafter's settings, replayed on held-out answers (how drafters/retrieval.py's
defaults were chosen).

    python benchmarks/probes/retrieval_replay.py [--answers replay.json] [--threads 2]

1. Plain int8 decoding of the default model answers held-out prompts: MT-Bench questions 41-60 and GSM8K
   test questions 101-120 (neither in the shipped answer store, whose prompts are GSM8K *train* questions,
   chat questions and rewrite tasks, nor among the benchmark's samples), 128 new tokens, greedy; saved to
   ``--answers`` (reused when it exists).
2. Each setting's drafter is replayed on those answers: at every round it proposes from the committed
   prefix, the answer says how many drafts greedy verification keeps, and the round costs T(rows)/T(1) on the
   int8 curve of docs/benchmarks.md, "Step cost". Greedy acceptance is deterministic, so the replayed τ is what
   decoding gives; the estimated speedup is tokens ÷ Σ T(rows)/T(1) (drafting itself counted as free): a cost
   model, not a timing.

Prints τ and the estimated speedup per dataset for lookup and each setting. Results in
docs/benchmarks.md, "Retrieval".

``--trees``: instead, draft trees from the store where the chain drafts a chain — each node's children the
top ``m`` continuations of its longest matching 2-4-token suffix (seen twice or more), expanded best-first
by the product of their shares down to ``min_conf``, up to ``budget`` nodes and ``depth`` levels (what the
EAGLE drafter's dynamic tree does with a head's probabilities); greedy verification keeps the longest path
the answer follows, and a round costs T(nodes + 1). Lookup's rounds are as in the chain.
"""

import argparse
import collections
import heapq
import json
import sys
from functools import partial
from pathlib import Path

import torch

from speculate import SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.bench.datasets import load_dataset
from speculate.drafters import get_drafter
from speculate.drafters import retrieval as retrieval_module
from speculate.drafters.answer_store import FILE, AnswerStore, shipped_store
from speculate.sampling import Sampling
from speculate.text import encode_prompt

# docs/benchmarks.md, "Step cost" (default model, int8, 2 threads): T(n)/T(1) at n = 1, 2, 4, 8, 16, linear between.
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
    plain = SpeculativeDecoder(model, SpeculativeSpec("none"))
    out = []
    for name, lo, hi in HELD_OUT:
        for sample in load_dataset(name, limit=hi, shots=0)[lo:hi]:
            ids = encode_prompt(model.tokenizer, sample.turns[0])
            out.append({"dataset": name, "id": sample.id, "prompt_ids": ids,
                        "token_ids": plain.generate(ids, max_new_tokens=128).token_ids})
            print(f"answered {sample.id}", file=sys.stderr, flush=True)
    path.write_text(json.dumps(out))
    return out


def _kept(draft: list[int], answer: list[int], done: int) -> int:
    """How many of ``draft`` greedy verification keeps: its prefix that the answer continues with."""
    kept = 0
    while kept < len(draft) and draft[kept] == answer[done + kept]:
        kept += 1
    return kept


def chain_round(drafter, committed, answer, done, k) -> tuple[int, int]:
    """One round of ``drafter`` as the engine runs it: (drafts kept, rows verified besides the last token's)."""
    budget = len(answer) - done - 1  # as the engine prunes a draft to what the budget still takes
    draft = drafter.propose(committed, min(k, budget)).tokens.tolist()[:budget]
    kept = _kept(draft, answer, done)
    drafter.update(kept, answer[done + kept])
    return kept, len(draft)


def replay(drafter, records, k, round_fn=chain_round) -> dict:
    """τ and the estimated speedup per dataset, each round played by ``round_fn`` on the recorded answers."""
    result = {}
    for name, _, _ in HELD_OUT:
        tokens = rounds = units = 0
        for r in (r for r in records if r["dataset"] == name):
            committed, answer = list(r["prompt_ids"]), r["token_ids"]
            drafter.begin(list(committed), Sampling(), None)
            done = 0
            while done < len(answer):
                kept, rows = round_fn(drafter, committed, answer, done, k)
                committed += answer[done: done + kept + 1]
                done += kept + 1
                tokens, rounds, units = tokens + kept + 1, rounds + 1, units + cost(rows + 1)
        result[name] = f"τ {tokens / rounds:.2f}, est. {tokens / units:.2f}x"
    return result


def _continuations(answers: list[list[int]]) -> dict:
    """{n-gram of 2-4 tokens: [(next token, share), ...] most frequent first}, continuations seen twice or more."""
    counts = collections.defaultdict(collections.Counter)
    for a in answers:
        for i in range(1, len(a) - 1):
            for n in range(2, min(4, i + 1) + 1):
                counts[tuple(a[i - n + 1: i + 1])][a[i + 1]] += 1
    table = {}
    for gram, after in counts.items():
        total = sum(after.values())
        top = [(t, c / total) for t, c in after.most_common() if c >= 2]
        if top:
            table[gram] = top
    return table


def _tree(table, context, m, budget, depth, min_conf, min_share) -> list[tuple[int, int]]:
    """(token, parent) nodes, best-first by the product of shares; nothing when the root's top continuation has
    a share below ``min_share`` (where the chain drafts nothing from the store either)."""
    def children(seq):
        for n in (4, 3, 2):
            hit = table.get(tuple(seq[-n:])) if len(seq) >= n else None
            if hit is not None:
                return hit[:m]
        return []

    first = children(context)
    if not first or first[0][1] < min_share:
        return []
    nodes, heap = [], [(-share, j, tok, -1, [tok]) for j, (tok, share) in enumerate(first) if share >= min_conf]
    heapq.heapify(heap)
    tick = len(heap)
    while heap and len(nodes) < budget:
        conf, _, tok, parent, path = heapq.heappop(heap)
        nodes.append((tok, parent))
        if len(path) < depth:
            for child, share in children(context + path):
                if -conf * share >= min_conf:
                    tick += 1
                    heapq.heappush(heap, (conf * share, tick, child, len(nodes) - 1, path + [child]))
    return nodes


def tree_round(table, m, budget, depth, min_conf, drafter, committed, answer, done, k) -> tuple[int, int]:
    """:func:`chain_round` with the store's chains replaced by :func:`_tree`'s trees (lookup's rounds unchanged)."""
    left = len(answer) - done - 1
    drafter.copied = 0
    found = drafter.match(committed)
    nodes = []
    if left and (found is None or found[0] < drafter.min_context):
        nodes = _tree(table, committed, m, budget, min(depth, left), min_conf, drafter.min_share)
    if not nodes:  # lookup (or the chain's one-token fallback), as the drafter proposes it
        draft = drafter.from_match(committed, min(k, left), found).tokens.tolist()[:left]
        kept = _kept(draft, answer, done)
        drafter.update(kept, answer[done + kept])
        return kept, len(draft)
    kept, at = 0, -1  # greedy: follow the child the answer takes, as long as there is one
    while done + kept < len(answer) - 1:
        nxt = [i for i, (t, p) in enumerate(nodes) if p == at and t == answer[done + kept]]
        if not nxt:
            break
        at, kept = nxt[0], kept + 1
    return kept, len(nodes)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--answers", default="retrieval-replay-answers.json")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the replay itself is deterministic)")
    parser.add_argument("--store-sizes", default="",
                        help="instead of the settings grid: the default settings with stores of the first N answers "
                             "of the shipped one, e.g. 256,512,1024,2048 (how τ grows with the store)")
    parser.add_argument("--trees", action="store_true", help="store trees against the default chain (see above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    records = answers(Path(args.answers))
    target = load_model("smollm2-135m-instruct", dtype="int8")
    print("lookup k=6", replay(get_drafter("lookup"), records, 6))
    if args.trees:
        print("retrieval k=6 (the default chain)", replay(get_drafter("retrieval", None, target), records, 6))
        table = _continuations(_answers(target))
        for m, budget, depth, min_conf in ((1, 6, 6, 0.0), (2, 4, 4, 0.1), (2, 6, 6, 0.1), (2, 6, 6, 0.2), (2, 8, 6, 0.1),
                                           (3, 8, 6, 0.05), (2, 10, 8, 0.1), (4, 12, 8, 0.02)):
            drafter = get_drafter("retrieval", None, target)
            print(f"retrieval tree m={m} budget={budget} depth={depth} min_conf={min_conf}",
                  replay(drafter, records, 6, partial(tree_round, table, m, budget, depth, min_conf)), flush=True)
        return
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
