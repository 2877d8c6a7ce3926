"""Numbers derived from a `speculate bench` record (its samples.jsonl), quoted in docs/benchmarks.md.

    python benchmarks/probes/records.py RUN_DIR [--base METHOD] [--compare OTHER_RUN_DIR] [--per-sample]

Per method: total seconds, the prefill's share of them, and decoding alone (prefill left out) in tokens/s,
ms per target call and as a ratio over plain decoding's. ``--base``: each method's speed over METHOD's on
the same samples (total tokens/s ÷ total tokens/s), with a 95 % bootstrap interval over samples (2,000
resamples, seed 0) and on how many samples it was faster. ``--compare``: generations token-identical
between the two runs, and each method's total seconds in both. ``--per-sample``: each sample's speedup
over plain decoding. Speeds divide only seconds one start of the bench timed for both methods (a resumed run's
later start: bench/records.timed_together).
"""

import argparse
import collections
import json
import random
from pathlib import Path

from speculate.bench.records import timed_together


def load(run: Path) -> dict:
    """(method, dataset, id) → the first turn's record, with the record's start of the bench (``started``)."""
    out = {}
    for line in (run / "samples.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[r["method"], r["dataset"], r["id"]] = {**r["turns"][0], "started": r.get("started")}
    return out


def totals(rec: dict) -> None:
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])  # tokens, seconds, prefill seconds, target calls
    for (method, _, _), t in rec.items():
        a = agg[method]
        a[0] += t["new_tokens"]
        a[1] += t["seconds"]
        a[2] += t["stats"]["prefill_seconds"]
        a[3] += t["stats"]["target_calls"]
    plain = agg["plain"]
    plain_decode = plain[0] / (plain[1] - plain[2])
    one_start = len({t["started"] for t in rec.values()}) == 1  # else totals over other samples: use --base
    for method, (tokens, seconds, prefill, calls) in agg.items():
        decode = tokens / (seconds - prefill)
        over = f"{decode / plain_decode:.2f}x plain" if one_start else "several starts: see --base plain"
        print(f"{method:45s} {seconds:8.1f} s, prefill {prefill / seconds:5.1%}, decoding {decode:6.2f} tokens/s "
              f"({over}), {1e3 * (seconds - prefill) / calls:.0f} ms per target call")


def paired(rec: dict, base: str) -> None:
    samples = collections.defaultdict(dict)
    for (method, dataset, sid), t in rec.items():
        samples[dataset, sid][method] = (t["new_tokens"], t["seconds"])
    rng = random.Random(0)
    methods = sorted({m for v in samples.values() for m in v} - {base, "plain"})
    for dataset in sorted({d for d, _ in samples}) + ["all"]:
        for m in methods:
            keys = [k for k in samples if dataset in ("all", k[0]) and m in samples[k] and base in samples[k]
                    and timed_together(rec[(m, *k)], rec[(base, *k)])]
            if not keys:
                continue

            def ratio(ks):
                a = sum(samples[k][m][0] for k in ks) / sum(samples[k][m][1] for k in ks)
                return a / (sum(samples[k][base][0] for k in ks) / sum(samples[k][base][1] for k in ks))
            boots = sorted(ratio([rng.choice(keys) for _ in keys]) for _ in range(2000))
            wins = sum(samples[k][m][0] / samples[k][m][1] > samples[k][base][0] / samples[k][base][1] for k in keys)
            print(f"{dataset:10s} {m:50s} over {base}: {ratio(keys):.3f} [{boots[50]:.3f}, {boots[1949]:.3f}], "
                  f"faster on {wins}/{len(keys)}")


def per_sample(rec: dict) -> None:
    for (method, dataset, sid), t in sorted(rec.items(), key=lambda kv: kv[0][1:]):
        p = rec.get(("plain", dataset, sid))
        if method != "plain" and p and timed_together(t, p):
            print(f"{sid:14s} {method:45s} {(t['new_tokens'] / t['seconds']) / (p['new_tokens'] / p['seconds']):.2f}x")


def compare(rec: dict, other: dict) -> None:
    shared = [k for k in rec if k in other]
    same = sum(rec[k]["token_ids"] == other[k]["token_ids"] for k in shared)
    print(f"token-identical generations: {same}/{len(shared)}")
    for m in sorted({k[0] for k in shared}):
        a = sum(rec[k]["seconds"] for k in shared if k[0] == m)
        b = sum(other[k]["seconds"] for k in shared if k[0] == m)
        print(f"{m:45s} {a:.1f} s here, {b:.1f} s there ({a / b:.2f}x)")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path)
    p.add_argument("--base")
    p.add_argument("--compare", type=Path)
    p.add_argument("--per-sample", action="store_true")
    a = p.parse_args()
    records = load(a.run)
    totals(records)
    if a.base:
        paired(records, a.base)
    if a.per_sample:
        per_sample(records)
    if a.compare:
        compare(records, load(a.compare))
