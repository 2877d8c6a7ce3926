"""The bench report: per (method, dataset) the Consultant Decoding paper's measures, as markdown + CSV
shaped like its Table 1 (speedup and normalised quality) and Table 13 (acceptance length), and plots
like its Figures 4 and 5.

Definitions (all over the samples that every reported method finished, so the methods are compared on
the same prompts):

- speedup: tokens/s of the method ÷ tokens/s of ``plain`` (our engine, no drafts) on those samples,
  measured interleaved in the same run: of a resumed run, only the samples whose method and plain records one
  start of the bench timed (``timed_samples``; records.timed_together); 95 % percentile-bootstrap interval
  over samples;
- LLM-calls ratio: target forwards ÷ new tokens (1.0 for plain decoding); mean acceptance length τ:
  new tokens ÷ target forwards; acceptance by position i: P(draft i kept | drafted);
- quality: HumanEval pass@1 (sandboxed execution), GSM8K accuracy of the final number; MT-Bench and
  the copy prompts have no offline judge, so two labelled proxies: ROUGE-L F1 against the target's own
  greedy answer (``plain``) and the target's mean NLL of the answer (MT-Bench);
- normalised quality: the method's quality ÷ the target's greedy quality (plain), bootstrap interval.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections import defaultdict
from pathlib import Path

import numpy as np

from ..models.cache import atomic_write_text
from ..stats import alpha_mle
from .metrics import bootstrap_ci, keeps_quality, mcnemar, rouge_l
from .records import RUN_FILE, SAMPLES_FILE, read_records, timed_together

QUALITY = {"humaneval": "pass@1", "gsm8k": "accuracy", "mt_bench": "ROUGE-L vs target greedy (proxy)",
           "copy": "ROUGE-L vs target greedy (proxy)"}
CSV_FIELDS = ["method", "dataset", "samples", "new_tokens", "seconds", "tokens_per_second", "speedup",
              "speedup_low", "speedup_high", "timed_samples", "target_calls", "drafted_tokens", "llm_calls_ratio", "mean_accepted_length", "alpha",
              "acceptance_by_position", "quality_metric", "quality", "normalised_quality", "normalised_low",
              "normalised_high", "keeps_97", "discordant", "mcnemar_p", "target_nll", "identical_to_plain", "peak_rss_mb", "machine"]
MARKDOWN_FIELDS = CSV_FIELDS[:-1]  # the machine is in the markdown's heading
TARGET_SCORED_0 = "n/a (the target scored 0)"  # a normalised quality over a target quality of 0


def _quality(record: dict, plain: dict | None) -> float:
    q = record["quality"]
    if "passed" in q:
        return float(q["passed"])
    if "correct" in q:
        return float(q["correct"])
    if plain is None:
        return math.nan
    return float(np.mean([rouge_l(t["text"], p["text"]) for t, p in zip(record["turns"], plain["turns"])]))


def _sum(record: dict, key: str) -> float:
    return sum(t[key] for t in record["turns"])


def _stat(record: dict, key: str) -> float:
    return sum((t["stats"] or {}).get(key, 0) for t in record["turns"])


def _positions(records) -> list[float]:
    """P(draft position i kept | drafted), pooled over every round of ``records``."""
    drafted, accepted = defaultdict(int), defaultdict(int)
    for r in records:
        for t in r["turns"]:
            s = t["stats"] or {}
            for i, (d, a) in enumerate(zip(s.get("drafted_by_position", []), s.get("accepted_by_position", []))):
                drafted[i] += d
                accepted[i] += a
    return [accepted[i] / drafted[i] for i in sorted(drafted) if drafted[i]]


def summarise(records: list[dict], n_resamples: int = 2000, seed: int = 0) -> list[dict]:
    """One row per (method, dataset), plus an ``all`` row per method over every dataset."""
    by = defaultdict(dict)  # (method, dataset) → id → record
    for r in records:
        by[r["method"], r["dataset"]][r["id"]] = r
    methods = list(dict.fromkeys(r["method"] for r in records))
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    rows = []
    for dataset in datasets + ["all"]:
        ds = datasets if dataset == "all" else [dataset]
        plain = {(d, i): r for d in ds for i, r in by.get(("plain", d), {}).items()}
        # The methods run on every dataset of this row, and the samples all of them finished: the
        # comparison is on the same prompts (a method run on fewer datasets is left out of "all").
        here = [m for m in methods if all(by.get((m, d)) for d in ds)]
        keys = sorted(set.intersection(*[{(d, i) for d in ds for i in by.get((m, d), {})} for m in here])) \
            if "plain" in here else []
        if not keys:
            continue
        p_tok = np.array([_sum(plain[k], "new_tokens") for k in keys], float)
        p_sec = np.array([_sum(plain[k], "seconds") for k in keys], float)
        p_q = np.array([_quality(plain[k], None if k[0] in ("gsm8k", "humaneval") else plain[k]) for k in keys])
        for method in here:
            recs = [by[method, k[0]][k[1]] for k in keys]
            tok = np.array([_sum(r, "new_tokens") for r in recs], float)
            sec = np.array([_sum(r, "seconds") for r in recs], float)
            q = np.array([_quality(r, plain[k]) for r, k in zip(recs, keys)])
            idx = np.arange(len(keys))
            timed = idx[[timed_together(r, plain[k]) for r, k in zip(recs, keys)]]  # speed: one start's pairs

            # bootstrap_ci resamples the sample indices (as floats): both measures are ratios of sums over
            # the same resampled prompts, for the method and for plain decoding.
            def speed(i, tok=tok, sec=sec):
                i = i.astype(int)
                return (tok[i].sum() / sec[i].sum()) / (p_tok[i].sum() / p_sec[i].sum())

            def normalised(i, q=q):
                i = i.astype(int)
                return q[i].mean() / p_q[i].mean() if p_q[i].mean() > 0 else math.nan

            s_lo, s_hi = bootstrap_ci(timed, stat=speed, n_resamples=n_resamples, seed=seed) if timed.size \
                else (math.nan, math.nan)
            n_lo, n_hi = bootstrap_ci(idx, stat=normalised, n_resamples=n_resamples, seed=seed)
            calls = sum(_stat(r, "target_calls") for r in recs)
            accepted = sum(_stat(r, "accepted_draft_tokens") for r in recs)
            rejected = sum(_stat(r, "rejected_rounds") for r in recs)
            engine = recs[0]["turns"][0]["stats"] is not None
            nll = [t["target_nll"] for r in recs for t in r["turns"] if t.get("target_nll") is not None]
            same = sum(all(t["token_ids"] == p["token_ids"] for t, p in zip(r["turns"], plain[k]["turns"]))
                       for r, k in zip(recs, keys))
            rows.append({
                "method": method, "dataset": dataset, "samples": len(keys),
                "new_tokens": int(tok.sum()), "seconds": round(float(sec.sum()), 3),
                "tokens_per_second": round(float(tok.sum() / sec.sum()), 3),
                "speedup": round(float(speed(timed)), 3) if timed.size else None,
                "speedup_low": round(float(s_lo), 3) if timed.size else None,
                "speedup_high": round(float(s_hi), 3) if timed.size else None, "timed_samples": int(timed.size),
                "target_calls": int(calls) if engine else None,
                "drafted_tokens": int(sum(_stat(r, "drafted_tokens") for r in recs)) if engine else None,
                "llm_calls_ratio": round(calls / tok.sum(), 4) if engine else None,
                "mean_accepted_length": round(tok.sum() / calls, 3) if engine else None,
                "alpha": round(alpha, 4) if engine and (alpha := alpha_mle(accepted, rejected)) is not None else None,
                "acceptance_by_position": [round(a, 3) for a in _positions(recs)] if engine else None,
                "quality_metric": "mixed" if dataset == "all" else QUALITY.get(dataset, ""),
                "quality": round(float(np.nanmean(q)), 4),
                "normalised_quality": round(float(normalised(idx)), 4),
                "normalised_low": round(float(n_lo), 4), "normalised_high": round(float(n_hi), 4),
                # Does it keep 97 % of the target's quality (the paired interval above), and, for pass/fail tasks,
                # McNemar's exact test over the problems one solves and the other does not (b lost / c gained).
                **(paired := _paired_test(ds, q, p_q)),
                "keeps_97": keeps_quality(n_lo, n_hi, p_value=paired["mcnemar_p"]),
                "target_nll": round(float(np.mean(nll)), 4) if nll else None,
                "identical_to_plain": f"{same}/{len(keys)}",
                "peak_rss_mb": max(r.get("peak_rss_mb", 0) for r in recs),
                # bench/machine.py's summary line; " | " between several (a run resumed elsewhere)
                "machine": " | ".join(dict.fromkeys(r["machine"] for r in recs if r.get("machine"))),
            })
    return rows


def _paired_test(datasets: list[str], q: np.ndarray, p_q: np.ndarray) -> dict:
    """McNemar's fields where every dataset of the row is pass/fail (HumanEval, GSM8K); empty values otherwise."""
    if not all(d in ("humaneval", "gsm8k") for d in datasets):
        return {"discordant": None, "mcnemar_p": None}
    b, c, p = mcnemar(q, p_q)
    return {"discordant": f"{b} lost / {c} gained", "mcnemar_p": round(p, 4)}


def _table(rows: list[dict], value) -> str:
    """Methods × datasets, one cell per pair (Table 1 / Table 13 layout)."""
    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    cell = {(r["method"], r["dataset"]): r for r in rows}
    out = ["| method | " + " | ".join(datasets) + " |", "|---" * (len(datasets) + 1) + "|"]
    for m in methods:
        out.append(f"| {m} | " + " | ".join(value(cell[m, d]) if (m, d) in cell else "" for d in datasets) + " |")
    return "\n".join(out)


def _speedup(row: dict) -> str:
    """A row's speedup and interval, with how many of its samples it was timed on where that is fewer."""
    if row["speedup"] is None:
        return "not timed with plain"
    fewer = f" ({row['timed_samples']} of {row['samples']} timed with plain)" \
        if row["timed_samples"] < row["samples"] else ""
    interval = "[no interval: one sample]" if math.isnan(row["speedup_low"]) else \
        f"[{row['speedup_low']:.2f}, {row['speedup_high']:.2f}]"
    return f"{row['speedup']:.2f}× {interval}{fewer}"


def _normalised(row: dict) -> str:
    q = row["normalised_quality"]
    return TARGET_SCORED_0 if math.isnan(q) else f"{q:.3f}"


def _cell(row: dict, field: str) -> str:
    """A cell of the table of every measure: empty for None, n/a for a measure that has no value (nan)."""
    value = row[field]
    if isinstance(value, float) and math.isnan(value):
        return TARGET_SCORED_0 if field == "normalised_quality" else "n/a"
    return "" if value is None else str(value)


def to_markdown(rows: list[dict], run: dict) -> str:
    s = run.get("settings", {})
    # The machines the samples were measured on (each record names its own: run.json names the latest run's,
    # which may only have rewritten the report), else run.json's (records written before they named it).
    machines = list(dict.fromkeys(m for r in rows for m in (r.get("machine") or "").split(" | ") if m))
    lines = [f"# speculate bench: {s.get('model')}" + (f" ← {s['draft_model']}" if s.get("draft_model") else ""),
             "", f"Machine: {' | '.join(machines) or run.get('machine') or 'not recorded'}.", "",
             f"torch {run.get('torch', '')}; started {run.get('started', '')}; "
             f"precision {s.get('dtype')}; max_new_tokens {s.get('max_new_tokens')}; GSM8K shots "
             f"{s.get('shots')}; seed {s.get('seed')}."]
    if len(machines) > 1:
        lines += ["", "**The samples were measured on more than one machine** (a resumed run): "
                  + " | ".join(machines) + ". Speedups compare methods across them."]
    lines += ["", "Speedup: tokens/s over plain decoding in our engine, interleaved in this run [95 % bootstrap "
                  "interval]. Normalised quality: quality ÷ the target's greedy quality (plain). MT-Bench and copy "
                  "quality are proxies (ROUGE-L against the target's greedy answer), not a judge's score.", ""]
    if "eps_auto" in run:
        lines += [f"eps auto (the target's mean NLL on the calibration text): {run['eps_auto']}; the paper's "
                  f"Chinchilla estimate: " + (f"{run['eps_chinchilla']:.3f}" if run.get("eps_chinchilla") else "n/a"),
                  ""]
    lines += ["## Speedup and normalised quality (the paper's Table 1)", "",
              _table(rows, lambda r: f"{_speedup(r)}; {_normalised(r)}"), "",
              "## Mean acceptance length τ and LLM-calls ratio (Table 13)", "",
              _table(rows, lambda r: "" if r["mean_accepted_length"] is None else
                     f"τ {r['mean_accepted_length']:.2f}; calls {r['llm_calls_ratio']:.3f}"), "",
              "## Every measure", "", "| " + " | ".join(MARKDOWN_FIELDS) + " |", "|---" * len(MARKDOWN_FIELDS) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r, f) for f in MARKDOWN_FIELDS) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_FIELDS)
    w.writeheader()
    for r in rows:
        w.writerow({**r, "acceptance_by_position": json.dumps(r["acceptance_by_position"])})
    return buf.getvalue()


def plot(rows: list[dict], run: dict, out: Path) -> list[Path]:
    """speedup_vs_quality.png (Figure 4), acceptance_vs_k.png (Figure 5), acceptance_by_position.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = run.get("methods", {})
    made = []
    allrows = [r for r in rows if r["dataset"] != "all" and r["speedup"] is not None]

    def save(fig, name):
        path = out / name
        tmp = out / f".{name}.tmp.png"
        fig.tight_layout()
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        tmp.replace(path)  # atomic: no half-written image
        made.append(path)

    # Figure 4: speedup against normalised quality; CD points joined across eps.
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for dataset in dict.fromkeys(r["dataset"] for r in allrows):
        pts = [r for r in allrows if r["dataset"] == dataset]
        ax.scatter([r["normalised_quality"] for r in pts], [r["speedup"] for r in pts], label=dataset, s=18)
        for r in pts:  # which method each point is
            ax.annotate(r["method"], (r["normalised_quality"], r["speedup"]), fontsize=5, alpha=0.8,
                        xytext=(3, 2), textcoords="offset points")
        for cd in _eps_lines(pts, specs, run.get("eps_auto")):
            if len(cd) > 1:
                ax.plot([r["normalised_quality"] for _, r in cd], [r["speedup"] for _, r in cd], lw=0.8)
            for eps, r in cd:  # --eps auto's choice, at its calibrated ε on the line
                if specs[r["method"]].get("eps") == "auto":
                    ax.scatter([r["normalised_quality"]], [r["speedup"]], marker="*", s=90, color="black", zorder=3)
                    ax.annotate(f"ε auto = {eps:.2f}", (r["normalised_quality"], r["speedup"]), fontsize=6,
                                xytext=(4, -9), textcoords="offset points")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("quality ÷ target greedy quality")
    ax.set_ylabel("speedup over plain decoding")
    ax.set_title("speedup against quality (paper Fig. 4)")
    ax.legend(fontsize=7)
    save(fig, "speedup_vs_quality.png")

    # Figure 5: acceptance length against draft length, per verifier family (fixed k only).
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    series = defaultdict(list)
    for r in rows:
        spec = specs.get(r["method"], {})
        if r["dataset"] == "all" and isinstance(spec.get("k"), int) and spec.get("kind") == "engine":
            label = r["method"].replace(f" k={spec['k']}", "")
            series[label].append((spec["k"], r["mean_accepted_length"]))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("mean acceptance length τ")
    ax.set_title("acceptance length against k (paper Fig. 5)")
    if series:
        ax.legend(fontsize=7)
    save(fig, "acceptance_vs_k.png")

    # Acceptance by draft position.
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in rows:
        if r["dataset"] == "all" and r["acceptance_by_position"]:
            acc = r["acceptance_by_position"]
            ax.plot(range(1, len(acc) + 1), acc, marker=".", label=r["method"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | drafted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("acceptance by position")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6)
    save(fig, "acceptance_by_position.png")
    return made


def _eps_lines(rows: list[dict], specs: dict, eps_auto: float | None) -> list[list[tuple[float, dict]]]:
    """Figure 4's lines: the consultant methods that differ in ε only (same drafter, k, β, argmax clause,
    temperature), each as (ε, row) sorted by ε; ``eps = auto`` at the ε it calibrated to (run.json)."""
    lines = defaultdict(list)
    for r in rows:
        spec = specs.get(r["method"], {})
        eps = eps_auto if spec.get("eps") == "auto" else spec.get("eps")
        if spec.get("verifier") == "consultant" and isinstance(eps, (int, float)):
            key = tuple(spec.get(k) for k in ("drafter", "k", "beta", "argmax", "temperature"))
            lines[key].append((float(eps), r))
    return [sorted(line, key=lambda p: p[0]) for line in lines.values()]


def write_report(out: Path) -> list[dict]:
    """summary.md, summary.csv and the plots from ``out``'s samples.jsonl and run.json (atomically)."""

    out = Path(out)
    run = json.loads((out / RUN_FILE).read_text()) if (out / RUN_FILE).is_file() else {}
    rows = summarise(read_records(out / SAMPLES_FILE, repair=False))  # the run repairs before it appends
    atomic_write_text(out / "summary.md", to_markdown(rows, run))
    atomic_write_text(out / "summary.csv", to_csv(rows))
    atomic_write_text(out / "summary.json", json.dumps(rows, indent=1) + "\n")
    if rows:
        plot(rows, run, out)
    return rows
