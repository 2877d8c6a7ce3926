"""What a lower weight precision costs in quality, on whole answers (models/quality.py says what is measured):

    python -m speculate.bench.precision [--model M] [--dtypes fp32,int8,q4] [--mt-bench 80] [--gsm8k 50]
                                        [--copy 99] [--tokens 128] [--out FILE.json]

A quantized precision may name its activation rows a row: ``q4:1`` is q4 with one (llama.cpp's 8-bit activations
per block of 32, what q4 ran before issue 34), ``q4:2`` as served (models/quantize.py, ``set_activation_passes``).

The first precision is the reference: its greedy answer to each prompt (MT-Bench first turns, GSM8K questions
zero-shot, the copy and paraphrase prompts) through the engine's plain decoding; every other precision answers the
same prompts and scores the reference's answer teacher-forced (both through the engine's own forward, where the
model has one). Reported per dataset and precision: the mean and the worst prompt's NLL gap, the mean first
differing position, equal answers, mean ROUGE-L against the reference's answer, degenerate answers (the
precision's, and the reference's), and whether the conversion gate's rule holds.
Speculative decoding reproduces the target as run: this is how far each precision's target is from fp32's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from datetime import date

from ..engine import SpeculativeDecoder
from ..spec import SpeculativeSpec
from ..models import DEFAULT_MODEL, DTYPES, load_model
from ..models import quality, quantize
from ..models.loader import QUANTIZED
from ..models.fast import FastKVModel, supports
from . import emit, machine_header, script
from .datasets import load_dataset
from .metrics import rouge_l


def prompts(mt_bench: int, gsm8k: int, copy: int) -> list[tuple[str, str, str]]:
    """(dataset, id, prompt): the first user turn of the first ``n`` samples of each dataset (GSM8K without shots)."""
    out = []
    for name, n in (("mt_bench", mt_bench), ("gsm8k", gsm8k), ("copy", copy)):
        if n > 0:
            out += [(s.dataset, s.id, s.turns[0]) for s in load_dataset(name, limit=n, shots=0)]
    return out


def answers(loaded, items, tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's prompt ids and the model's greedy answer (the engine's plain decoding, ``tokens`` at most)."""
    decoder = SpeculativeDecoder(loaded, SpeculativeSpec("none"))
    ids = [quality.prompt_ids(loaded.tokenizer, prompt) for _, _, prompt in items]
    return ids, [decoder.generate(p, max_new_tokens=tokens).token_ids for p in ids]


def summarise(rows: list[dict]) -> dict:
    """One dataset and precision: the gate's numbers and the answers' similarity."""
    verdict = quality.verdict([quality.Row(**{k: r[k] for k in quality.Row.__dataclass_fields__}) for r in rows])
    worst = max(rows, key=lambda r: r["nll_gap"])
    n = len(rows)
    return {"prompts": n, "mean_nll_gap": verdict.mean_gap, "worst_nll_gap": verdict.worst_gap, "worst_prompt": worst["id"],
            "mean_first_difference": round(sum(r["first_difference"] for r in rows) / n, 2),
            "equal": sum(r["equal"] for r in rows), "mean_rouge_l": round(sum(r["rouge_l"] for r in rows) / n, 4),
            "degenerate": sum(r["degenerate"] for r in rows),
            "reference_degenerate": sum(r["reference_degenerate"] for r in rows),
            "broken": [r["id"] for r in rows if r["degenerate"] and not r["reference_degenerate"]],
            "gate": "pass" if verdict.passed else "fail: " + "; ".join(verdict.reasons)}


def run(model: str, dtypes: list[str], items, tokens: int) -> dict:
    machine = machine_header()  # at the start: the threads and load as the run begins
    reference: list[quality.Answer] = []
    rows: dict[str, list[dict]] = {}
    weights = {}
    for i, dtype in enumerate(dtypes):  # one model in memory at a time: the 1.5B in fp32 holds ~7 GB
        base, _, rows_a_row = dtype.partition(":")
        loaded = load_model(model, dtype=base)
        if rows_a_row:  # (before anything runs: the lean decoder copies each layer's rows as it is built)
            quantize.set_activation_passes(loaded.model, int(rows_a_row))
        weights[dtype] = loaded.weights
        ids, got = answers(loaded, items, tokens)
        targets = [r.ids for r in reference] if reference else got  # every precision scores the reference's answers
        # (scored by the engine's own forward where it has one: the arithmetic it serves)
        scorer = FastKVModel(loaded) if supports(loaded.model) else loaded.model
        scored = [quality.Answer(a, quality.mean_answer_nll(scorer, p, t)) for p, a, t in zip(ids, got, targets)]
        if i == 0:
            reference = scored
        else:
            decode = loaded.tokenizer.decode
            rows[dtype] = [{"dataset": d, "id": sid, **asdict(quality.compare(prompt, ref, cand)),
                            "rouge_l": round(rouge_l(decode(cand.ids), decode(ref.ids)), 4),
                            "answer": decode(cand.ids), "reference": decode(ref.ids)}
                           for (d, sid, prompt), ref, cand in zip(items, reference, scored)]
        del loaded
    summary = {dtype: {d: summarise([r for r in rs if r["dataset"] == d]) for d in dict.fromkeys(r["dataset"] for r in rs)}
               for dtype, rs in rows.items()}
    return {"date": date.today().isoformat(), **machine, "model": model, "dtypes": dtypes, "weights": weights,
            "tokens": tokens, "summary": summary, "rows": rows}


def valid_dtype(name: str) -> bool:
    """A precision :func:`run` takes: one of DTYPES, or a quantized one with its activation rows a row (``q4:1``)."""
    base, colon, rows_a_row = name.partition(":")
    return base in DTYPES and (not colon or (base in QUANTIZED and rows_a_row in ("1", "2")))


def table(result: dict) -> str:
    """The summary as a Markdown table (what docs/results.md quotes)."""
    lines = ["| precision | dataset | prompts | NLL gap mean / worst | first difference | equal | ROUGE-L | degenerate "
             "(fp32's) | gate |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dtype, per in result["summary"].items():
        for d, s in per.items():
            lines.append(f"| {dtype} | {d} | {s['prompts']} | {s['mean_nll_gap']:.4f} / {s['worst_nll_gap']:.4f} | "
                         f"{s['mean_first_difference']:.1f} | {s['equal']} | {s['mean_rouge_l']:.3f} | "
                         f"{s['degenerate']} ({s['reference_degenerate']}) | {s['gate']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.precision", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="an alias or a local Hugging Face folder")
    p.add_argument("--dtypes", default="fp32,int8,q4", help=f"comma-separated, the first is the reference ({', '.join(DTYPES)})")
    p.add_argument("--mt-bench", type=int, default=80, help="MT-Bench questions (first turns)")
    p.add_argument("--gsm8k", type=int, default=50, help="GSM8K test questions (zero-shot)")
    p.add_argument("--copy", type=int, default=99, help="copy and paraphrase prompts (all of them by default)")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per answer at most")
    p.add_argument("--out", help="write the result as JSON here (atomically)")
    a = p.parse_args(argv)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if len(dtypes) < 2 or not all(map(valid_dtype, dtypes)) or a.tokens < 2:
        p.error(f"--dtypes needs two or more of {', '.join(DTYPES)} (a quantized one may end in :1 or :2, its "
                f"activation rows a row); --tokens >= 2")
    if min(a.mt_bench, a.gsm8k, a.copy) < 0 or a.mt_bench + a.gsm8k + a.copy == 0:
        p.error("--mt-bench, --gsm8k and --copy take counts >= 0, not all 0")
    result = run(a.model, dtypes, prompts(a.mt_bench, a.gsm8k, a.copy), a.tokens)
    print(table(result), file=sys.stderr)
    return emit(result, a.out)


if __name__ == "__main__":
    sys.exit(script(main))
