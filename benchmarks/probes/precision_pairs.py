"""The same problems in two runs, problem by problem: did a lossy method lose (or gain) the same problems in both?
For issue 23's question "is int8 the reason Consultant Decoding loses quality?": an fp32 run set against the int8
records of the same problems (docs/results.md, "Consultant Decoding at scale").

    python benchmarks/probes/precision_pairs.py RUN_A RUN_B [--method "CD/model k=6 eps=2 beta=0.2"]

RUN_A and RUN_B are `speculate bench` folders, or several folders joined with commas (their records pooled). For
each problem that both hold with plain decoding and the method: pass / fail (or correct / wrong) of plain and of the
method in each run, whether plain decoding's tokens are the same in both runs, and whether the method's are. Then,
per dataset, the problems the method lost or gained against plain in A, in B, and in both.
"""

import argparse
import math
from collections import defaultdict
from pathlib import Path

from speculate.bench.report import _quality
from table1 import pooled  # (this folder: the script's own, first on sys.path)


def outcomes(spec: str) -> dict:
    """(dataset, id) → method → (1.0 solved / 0.0 not, token ids), pooled over the comma-separated folders of
    ``spec`` as table1 pools them; pass/fail tasks only (HumanEval, GSM8K): others have no outcome here."""
    table = defaultdict(dict)
    for r in pooled([Path(folder) for folder in spec.split(",")]):
        if not math.isnan(solved := _quality(r, None)):
            table[r["dataset"], r["id"]][r["method"]] = (solved, r["turns"][0]["token_ids"])
    return table


def flip(row: dict, method: str) -> str | None:
    """'lost' or 'gained' where the method's outcome differs from plain decoding's, else None."""
    plain, other = row["plain"][0], row[method][0]
    return None if plain == other else ("lost" if plain else "gained")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--method", default="CD/model k=6 eps=2 beta=0.2")
    args = ap.parse_args()
    a, b = outcomes(args.run_a), outcomes(args.run_b)
    both = [key for key in a if key in b and all(m in a[key] and m in b[key] for m in ("plain", args.method))]
    both.sort(key=lambda key: (key[0], int(key[1].replace("-", "/").split("/")[-1])))
    print(f"| problem | A: plain, {args.method} | B: plain, method | plain's tokens A = B | method's tokens A = B |")
    print("| --- | --- | --- | --- | --- |")
    mark = {1.0: "✓", 0.0: "✗"}
    for key in both:
        ra, rb = a[key], b[key]
        print(f"| {key[1]} | {mark[ra['plain'][0]]} {mark[ra[args.method][0]]} | {mark[rb['plain'][0]]} "
              f"{mark[rb[args.method][0]]} | {ra['plain'][1] == rb['plain'][1]} | "
              f"{ra[args.method][1] == rb[args.method][1]} |")
    print()
    for dataset in sorted({key[0] for key in both}):
        keys = [key for key in both if key[0] == dataset]
        fa = {key: flip(a[key], args.method) for key in keys}
        fb = {key: flip(b[key], args.method) for key in keys}
        same = sum(fa[key] is not None and fa[key] == fb[key] for key in keys)
        print(f"{dataset}: {len(keys)} problems; the method lost / gained {sum(v == 'lost' for v in fa.values())} / "
              f"{sum(v == 'gained' for v in fa.values())} in A, {sum(v == 'lost' for v in fb.values())} / "
              f"{sum(v == 'gained' for v in fb.values())} in B, the same flip on the same problem in both: {same}; "
              f"plain's tokens equal on {sum(a[key]['plain'][1] == b[key]['plain'][1] for key in keys)}, the "
              f"method's on {sum(a[key][args.method][1] == b[key][args.method][1] for key in keys)}")


if __name__ == "__main__":
    main()
