"""The paper's Table 1 from one or more `speculate bench` folders (docs/results.md, "Consultant Decoding at scale").

    python benchmarks/probes/table1.py RUN_DIR [RUN_DIR ...] [--reference "SD/model k=6"] [--n-resamples 2000]

The folders' records are pooled (e.g. GSM8K 0-99 and 100-199, run on two cores as two folders; a sample in two
folders is an error), then summarised as the bench report does (speedup over plain on the same samples, paired
bootstrap intervals over samples, McNemar's exact test for pass/fail tasks, the 97 % verdict). Per dataset and
method: normalised quality [interval], McNemar's discordant problems and p, "keeps 97 %", speedup [interval],
speedup ÷ the reference's (default: the lossless method with the same drafter and k), the LLM-calls ratio and
÷ the reference's, τ, and how many samples every method finished. Prints markdown.
"""

import argparse
import sys
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--reference", default="SD/model k=6", help="the method the ÷ columns divide by")
    ap.add_argument("--n-resamples", type=int, default=2000)
    args = ap.parse_args()
    rows = summarise(pooled(args.runs), n_resamples=args.n_resamples)
    ref = {r["dataset"]: r for r in rows if r["method"] == args.reference}
    print("| dataset | method | samples | quality (normalised) [95 % paired interval] | lost / gained, McNemar p | "
          "keeps 97 % | speedup [95 %] | ÷ SD | LLM-calls ratio | ÷ SD | τ |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        sd = ref.get(r["dataset"])
        over = lambda key: f"{r[key] / sd[key]:.3f}" if sd and sd.get(key) and r.get(key) else "—"  # noqa: E731
        mc = f"{r['discordant']}, p = {r['mcnemar_p']:.3g}" if r.get("mcnemar_p") is not None else "—"
        calls = f"{r['llm_calls_ratio']:.3f}" if r.get("llm_calls_ratio") is not None else "—"
        tau = f"{r['mean_accepted_length']:.2f}" if r.get("mean_accepted_length") is not None else "—"
        print(f"| {r['dataset']} | {r['method']} | {r['samples']} | {r['quality']:.3f} ({r['normalised_quality']:.3f}) "
              f"[{r['normalised_low']:.3f}, {r['normalised_high']:.3f}] | {mc} | {r['keeps_97']} | "
              f"{r['speedup']:.2f}× [{r['speedup_low']:.2f}, {r['speedup_high']:.2f}] | {over('speedup')} | "
              f"{calls} | {over('llm_calls_ratio')} | {tau} |")


if __name__ == "__main__":
    main()
