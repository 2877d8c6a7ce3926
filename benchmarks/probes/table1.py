"""The paper's Table 1 from one or more `speculate bench` folders (docs/results.md, "Consultant Decoding at scale").

    python benchmarks/probes/table1.py RUN_DIR [RUN_DIR ...] [--reference "SD/model k=6"] [--n-resamples 2000]
        [--samples-of OTHER_RUN_DIR]

``--samples-of`` keeps only the samples that another run holds too: e.g. the int8 records of the problems an fp32
run of the same methods has reached, to set the two precisions side by side on the same problems.

The folders' records are pooled (e.g. GSM8K 0-99 and 100-199, run on two cores as two folders; a sample in two
folders is an error), then summarised as the bench report does (paired bootstrap intervals over samples, McNemar's
exact test for pass/fail tasks, the 97 % verdict). Two markdown tables:

- quality and calls, over every pooled sample: per dataset and method, normalised quality [interval], McNemar's
  discordant problems and p, "keeps 97 %", the LLM-calls ratio and ÷ the reference's (default: the lossless method
  with the same drafter and k), τ. None of these depends on the machine's speed; each sample's methods are paired
  within its own folder, against that machine's plain decoding (before quantize.FORMAT 2 each CPU converted
  its own int8 model, so pooled folders from two CPUs mean "against the int8 target it verified with":
  docs/benchmarks.md, "Consultant Decoding at scale");
- speed, per machine (each record names the CPU it ran on, and a run resumed on another CPU would otherwise mix two
  machines' seconds in one ratio): speedup over plain on the same samples [interval] and ÷ the reference's; of
  those, only the samples one start of the bench timed both for (the report's ``timed_samples``).
"""

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

from speculate.bench.records import read_records
from speculate.bench.report import summarise


def pooled(folders: list[Path]) -> list[dict]:
    seen, records = {}, []
    for folder in folders:
        for r in read_records(folder / "samples.jsonl", repair=False):
            key = r["method"], r["dataset"], r["id"]
            if key in seen:
                sys.exit(f"table1: {key} is in both {seen[key]} and {folder}")
            seen[key] = folder
            records.append(r)
    return records


def by_machine(records: list[dict]) -> dict[str, list[dict]]:
    """The records grouped by the CPU they ran on: the machine line's CPU, ISA and BLAS (its core and thread counts
    are the run's settings, the same for every folder of one table)."""
    groups = defaultdict(list)
    for r in records:
        groups[re.sub(r", \d+ cores.*", "", r.get("machine", "unknown machine"))].append(r)
    return dict(groups)


def over(row: dict, ref: dict | None, key: str) -> str:
    """``row[key] ÷ ref[key]`` to three places, or a dash where either is missing."""
    return f"{row[key] / ref[key]:.3f}" if ref and ref.get(key) and row.get(key) else "—"


def shown(rows: list[dict]) -> list[dict]:
    """summarise's rows without its ``all`` rows where there is one dataset (they would repeat it)."""
    one = len({r["dataset"] for r in rows if r["dataset"] != "all"}) == 1
    return [r for r in rows if not (one and r["dataset"] == "all")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--reference", default="SD/model k=6", help="the method the ÷ columns divide by")
    ap.add_argument("--n-resamples", type=int, default=2000)
    ap.add_argument("--samples-of", type=Path, help="keep only the samples this run folder holds too")
    args = ap.parse_args()
    records = pooled(args.runs)
    if args.samples_of:
        keep = {(r["dataset"], r["id"]) for r in pooled([args.samples_of])}
        records = [r for r in records if (r["dataset"], r["id"]) in keep]
    rows = summarise(records, n_resamples=args.n_resamples)
    ref = {r["dataset"]: r for r in rows if r["method"] == args.reference}
    print("| dataset | method | samples | quality (normalised) [95 % paired interval] | lost / gained, McNemar p | "
          "keeps 97 % | LLM-calls ratio | ÷ SD | τ |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in shown(rows):
        mc = f"{r['discordant']}, p = {r['mcnemar_p']:.3g}" if r.get("mcnemar_p") is not None else "—"
        calls = f"{r['llm_calls_ratio']:.3f}" if r.get("llm_calls_ratio") is not None else "—"
        tau = f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") is not None else "—"
        print(f"| {r['dataset']} | {r['method']} | {r['samples']} | {r['quality']:.3f} ({r['normalised_quality']:.3f}) "
              f"[{r['normalised_low']:.3f}, {r['normalised_high']:.3f}] | {mc} | {r['keeps_97']} | "
              f"{calls} | {over(r, ref.get(r['dataset']), 'llm_calls_ratio')} | {tau} |")
    print("\n| machine | dataset | method | samples | speedup [95 %] | ÷ SD |")
    print("| --- | --- | --- | --- | --- | --- |")
    for machine, group in by_machine(records).items():
        rows = summarise(group, n_resamples=args.n_resamples)
        ref = {r["dataset"]: r for r in rows if r["method"] == args.reference}
        for r in shown(rows):  # the samples each method and plain decoding were timed on together
            if r["speedup"] is not None:
                print(f"| {machine} | {r['dataset']} | {r['method']} | {r['timed_samples']} | {r['speedup']:.2f}× "
                      f"[{r['speedup_low']:.2f}, {r['speedup_high']:.2f}] | "
                      f"{over(r, ref.get(r['dataset']), 'speedup')} |")


if __name__ == "__main__":
    main()
