"""``speculate calc``: the lesson's speedup arithmetic (its three exercises), the exact model, the best k on a
cost curve, the measured profile, Consultant Decoding's eq. 9, and one-line errors for bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from speculate.policy import (Profile, acceptance_rate, best_k, chinchilla_loss, expected_tokens, lesson_speedup,
                            load_profile, measure_profile, recommend_k, residual_distribution, save_profile, speedup)
from speculate.cli import main
from speculate.errors import SpeculateError

# Lesson, Exercise 1 (the lesson's q is the target, its p the draft)
P_TARGET = [0.6, 0.1, 0.3]
P_DRAFT = [0.5, 0.3, 0.2]


def calc(capsys, *args):
    rc = main(["calc", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


# --- Exercise 1: α and the residual ---------------------------------------------------------------------

def test_exercise1_alpha_and_residual():
    assert acceptance_rate(P_TARGET, P_DRAFT) == pytest.approx(0.8, abs=1e-12)
    residual = residual_distribution(P_TARGET, P_DRAFT)
    assert residual == pytest.approx([0.5, 0.0, 0.5], abs=1e-12)
    assert math.fsum(residual) == pytest.approx(1.0, abs=1e-12)
    # symmetric in α, not in the residual
    assert acceptance_rate(P_DRAFT, P_TARGET) == pytest.approx(0.8, abs=1e-12)
    assert residual_distribution(P_DRAFT, P_TARGET) == pytest.approx([0.0, 1.0, 0.0], abs=1e-12)
    # identical distributions: α = 1, nothing to resample
    assert acceptance_rate(P_TARGET, P_TARGET) == pytest.approx(1.0)
    assert residual_distribution(P_TARGET, P_TARGET) is None


@pytest.mark.parametrize("p_target, p_draft, message", [
    ([0.6, 0.3], [0.5, 0.5], "sums to"),
    ([1.2, -0.2], [0.5, 0.5], ">= 0"),
    ([0.5, 0.5], [0.2, 0.3, 0.5], "outcomes"),
    ([], [1.0], "empty"),
    ([float("nan"), 1.0], [0.5, 0.5], ">= 0"),
])
def test_distributions_are_validated(p_target, p_draft, message):
    with pytest.raises(SpeculateError, match=message):
        acceptance_rate(p_target, p_draft)


def test_exercise1_cli(capsys):
    rc, out, err = calc(capsys, "--p-target", "0.6,0.1,0.3", "--p-draft", "0.5,0.3,0.2")
    assert rc == 0 and err == ""
    assert "α = Σ min(p_draft, p_target) = 0.8 " in out
    assert "= (0.5, 0, 0.5)" in out


# --- Exercise 2: the lesson's approximation, and why k = 20 is not 5× ------------------------------------

def test_exercise2_lesson_approximation():
    assert lesson_speedup(0.8, 4, 8) == pytest.approx(4.2 / 1.5) == pytest.approx(2.8)
    assert lesson_speedup(0.8, 4, math.inf) == pytest.approx(1 + 4 * 0.8)
    # k = 20 is 5× the draft length but nowhere near 5× the gain, even in the lesson's own formula ...
    k4, k20 = lesson_speedup(0.8, 4, 8), lesson_speedup(0.8, 20, 8)
    assert k20 == pytest.approx(17 / 3.5)
    assert k20 / k4 < 2
    # ... and in the exact model it is slower than k = 4: E saturates below 1/(1 - α) = 5 ...
    assert expected_tokens(0.8, 4) == pytest.approx((1 - 0.8 ** 5) / 0.2) == pytest.approx(3.3616)
    assert expected_tokens(0.8, 20) == pytest.approx((1 - 0.8 ** 21) / 0.2)
    assert expected_tokens(0.8, 20) < 5 < 1 + 20 * 0.8
    # ... while the draft cost 1 + k/s keeps growing
    assert speedup(0.8, 4, c=1 / 8) == pytest.approx(3.3616 / 1.5)
    assert speedup(0.8, 20, c=1 / 8) == pytest.approx(expected_tokens(0.8, 20) / 3.5)
    assert speedup(0.8, 20, c=1 / 8) < speedup(0.8, 4, c=1 / 8)
    assert best_k(None, 0.8, 1 / 8, k_max=20) == (5, pytest.approx(((1 - 0.8 ** 6) / 0.2) / 1.625))


def test_exercise2_cli(capsys):
    rc, out, err = calc(capsys, "--alpha", "0.8", "--k", "4", "--speed-ratio", "8")
    assert rc == 0 and err == ""
    assert "(1 + kα)/(1 + k/s) = 4.2/1.5 = 2.8×" in out
    assert "= 3.362/(1 + 0.5) = 2.241×" in out           # exact, flat curve, c = 1/8
    rows = {int(line.split()[0]): line.split() for line in out.splitlines()
            if line.strip() and line.split()[0].isdigit()}
    assert sorted(rows) == list(range(1, 21))
    assert rows[20][4] == "1.415×" and rows[20][5] == "4.857×"
    assert rows[4][4] == "2.241×" and rows[4][5] == "2.800×"
    assert "best k (exact): 5, 2.27×" in out
    assert "Why k = 20 does not give 5× the gain of k = 4" in out


# --- Exercise 3: the accept-reject step outputs p_target --------------------------------------------------

def test_exercise3_sample_verifier_output_follows_p_target():
    from speculate.verifiers import get_verifier

    verifier = get_verifier("sample")
    g = torch.Generator().manual_seed(0)
    p_target, p_draft = torch.tensor(P_TARGET), torch.tensor(P_DRAFT)
    draft_probs = p_draft[None]                       # [1, 3]
    target_probs = torch.stack([p_target, p_target])  # [2, 3]: row 1 is the bonus position
    n = 30_000
    drafts = torch.multinomial(p_draft, n, replacement=True, generator=g)
    counts = [0, 0, 0]
    for x in drafts.tolist():
        verdict = verifier.verify(torch.tensor([x]), draft_probs, target_probs, generator=g)
        first = x if verdict.n_accepted == 1 else verdict.next_token
        counts[first] += 1
    empirical = [c / n for c in counts]
    assert empirical == pytest.approx(P_TARGET, abs=0.012)   # ~4 standard deviations at n = 30k
    assert abs(empirical[1] - P_DRAFT[1]) > 0.1              # and not p_draft


# --- E(α, k) and the exact speedup ----------------------------------------------------------------------

@pytest.mark.parametrize("alpha, k", [(0.8, 4), (0.5, 3), (0.95, 10), (0.3, 1)])
def test_expected_tokens_matches_monte_carlo(alpha, k):
    g = torch.Generator().manual_seed(1)
    n = 200_000
    accepted = torch.rand(n, k, generator=g) < alpha
    tokens = accepted.int().cumprod(dim=1).sum(dim=1) + 1   # accepted prefix + the target's one token
    mean = tokens.double().mean().item()
    stderr = tokens.double().std().item() / math.sqrt(n)
    assert abs(mean - expected_tokens(alpha, k)) < 4 * stderr + 1e-9
    assert expected_tokens(alpha, k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha), rel=1e-12)


def test_expected_tokens_edges():
    for k in (0, 1, 4, 20):
        assert expected_tokens(1.0, k) == k + 1
        assert expected_tokens(0.0, k) == 1.0
    assert expected_tokens(0.999999, 5) == pytest.approx(6, rel=1e-5)


def test_speedup_flat_curve_free_draft_is_e():
    for alpha in (0.0, 0.3, 0.8, 1.0):
        for k in (1, 4, 15):
            assert speedup(alpha, k, c=0.0) == pytest.approx(expected_tokens(alpha, k))
            assert speedup(alpha, k, c=0.0, curve={n: 1.0 for n in range(1, 17)}) == pytest.approx(
                expected_tokens(alpha, k))
    # a measured curve divides by T(k+1)/T(1) + k·c
    assert speedup(0.8, 3, c=0.1, curve={1: 1.0, 2: 1.1, 3: 1.2, 4: 1.5}) == pytest.approx(2.952 / 1.8)


@pytest.mark.parametrize("call, message", [
    (lambda: expected_tokens(1.5, 4), "alpha"),
    (lambda: expected_tokens(-0.1, 4), "alpha"),
    (lambda: expected_tokens(0.5, -1), "k must be"),
    (lambda: lesson_speedup(0.8, 4, 0), "speed ratio"),
    (lambda: speedup(0.8, 4, c=-1), "cost ratio"),
    (lambda: speedup(0.8, 4, curve={1: 1.0, 2: 1.1}), r"T\(5\)"),
])
def test_bad_arguments_raise(call, message):
    with pytest.raises(SpeculateError, match=message):
        call()


# --- recommend_k on a step-shaped curve ------------------------------------------------------------------

def test_recommend_k_on_a_step_curve():
    # T(1..3) = 1, T(4+) = 2 (a stylised form of the fp32 step at 4 rows, docs/benchmarks.md,
    # "Verification cost T(n)"), α = 0.8, c = 0.2.
    # E(0.8, k) = (1 - 0.8^(k+1)) / 0.2; cost = T(k+1) + 0.2 k:
    #   k = 1: 1.8 / 1.2 = 1.5;  k = 2: 2.44 / 1.4 = 1.743;  k = 3: 2.952 / 2.6 = 1.135 (T(4) = 2);
    #   k = 4: 3.3616 / 2.8 = 1.2;  k > 4 stays below: E < 5 while the cost is 2 + 0.2 k >= 3.
    curve = {n: (1.0 if n <= 3 else 2.0) for n in range(1, 17)}
    assert recommend_k(curve, 0.8, 0.2) == 2
    k, s = best_k(curve, 0.8, 0.2)
    assert (k, s) == (2, pytest.approx(2.44 / 1.4))
    assert speedup(0.8, 3, 0.2, curve) == pytest.approx(2.952 / 2.6)
    # free drafts (prompt lookup): past the step only when E grows enough: k = 15 gives 4.86 / 2 = 2.43 < 2.44
    assert recommend_k(curve, 0.8, 0.0) == 2
    # a flat curve and free drafts: the longest k the curve covers
    assert recommend_k({n: 1.0 for n in range(1, 17)}, 0.8, 0.0) == 15
    # a Profile works the same as its curve
    prof = Profile(target_seconds={n: 0.01 * v for n, v in curve.items()})
    assert recommend_k(prof, 0.8, 0.2) == 2


# --- the measured profile --------------------------------------------------------------------------------

def test_profile_on_a_tiny_model(tiny, tmp_path):
    prof = measure_profile(tiny[0], tiny[1], context=32, max_n=4, repeats=1)
    assert sorted(prof.curve) == [1, 2, 3, 4]
    assert prof.curve[1] == 1.0
    assert all(0 < v < math.inf for v in prof.curve.values())
    assert all(0 < t < math.inf for t in prof.target_seconds.values())
    assert 0 < prof.c < math.inf and prof.draft_model == tiny[1].name
    assert prof.context == 32 and prof.repeats == 1 and prof.dtype == "fp32"
    assert 1 <= recommend_k(prof, 0.8, prof.c) <= 3
    path = save_profile(prof, tmp_path / "sub" / "p.json")
    again = load_profile(path)
    assert again.target_seconds == prof.target_seconds and again.c == pytest.approx(prof.c)
    assert again.curve == prof.curve and recommend_k(again, 0.8, 0.0) == recommend_k(prof, 0.8, 0.0)
    # the draft model's prefill of the context (calc --from-results charges each prompt's at this rate)
    assert 0 < prof.draft_prefill_seconds < math.inf and again.draft_prefill_seconds == prof.draft_prefill_seconds
    older = {k: v for k, v in prof.to_dict().items() if k != "draft_prefill_seconds"}  # a profile from before it
    assert Profile.from_dict(older).draft_prefill_seconds is None
    assert not [p for p in path.parent.iterdir() if p.name != "p.json"]  # no temporary left behind


def test_profile_context_must_fit(tiny):
    with pytest.raises(SpeculateError, match="context window"):
        measure_profile(tiny[0], context=1020, max_n=16, repeats=1)


def test_profile_cli_saves_json(capsys, tiny_folders, tmp_path):
    out_file = tmp_path / "profile.json"
    rc, out, err = calc(capsys, "--profile", "--model", str(tiny_folders[0]), "--draft-model",
                        str(tiny_folders[1]), "--context", "16", "--max-n", "4", "--repeats", "1",
                        "--save", str(out_file))
    assert rc == 0, err
    assert "T(n)/T(1)" in out and "prompt lookup (c = 0)" in out and "draft model (c = " in out
    for alpha in ("0.6", "0.7", "0.8", "0.9"):
        assert any(line.split()[:1] == [alpha] and "k = " in line for line in out.splitlines())
    data = json.loads(out_file.read_text())
    assert data["format"] == "speculate-profile" and data["curve"]["1"] == 1.0
    assert sorted(map(int, data["target_seconds"])) == [1, 2, 3, 4]
    # the saved curve feeds the --alpha table
    rc, out, err = calc(capsys, "--alpha", "0.8", "--speed-ratio", "inf", "--curve", str(out_file), "--k", "3")
    assert rc == 0, err
    rows = [line.split()[0] for line in out.splitlines() if line.strip() and line.split()[0].isdigit()]
    assert rows == ["1", "2", "3"]


def test_load_profile_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.json"
    for text, message in [("{", "not valid JSON"), ("{}", "not a speculate profile"),
                          (json.dumps({"format": "speculate-profile", "version": 1,
                                       "target_seconds": {"1": 0.01, "3": 0.02}}), "without gaps"),
                          (json.dumps({"format": "speculate-profile", "version": 1,
                                       "target_seconds": {"1": 0.01, "2": -1}}), "> 0")]:
        bad.write_text(text)
        with pytest.raises(SpeculateError, match=message):
            load_profile(bad)
    with pytest.raises(SpeculateError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


# --- Consultant Decoding eq. 9 ---------------------------------------------------------------------------

def test_chinchilla_eq9():
    n, d = 135e6, 2e12
    expected = 1.69 + 406.4 / n ** 0.34 + 410.7 / d ** 0.28
    assert chinchilla_loss(n, d) == pytest.approx(expected, rel=1e-12)
    assert chinchilla_loss(n, d) == pytest.approx(2.537, abs=1e-3)
    assert chinchilla_loss(1e30, 1e30) == pytest.approx(1.69, abs=1e-5)


def test_chinchilla_cli(capsys):
    rc, out, err = calc(capsys, "--eps-chinchilla", "--params", "135M", "--tokens", "2e12")
    assert rc == 0 and err == ""
    assert "= 2.537 nats per token" in out and "--eps 2.54" in out


# --- bad input: one line, exit 2 -------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--alpha", "1.5", "--speed-ratio", "8"], "--alpha must be in [0, 1]"),
    (["--alpha", "-0.1", "--speed-ratio", "8"], "--alpha"),
    (["--alpha", "nan", "--speed-ratio", "8"], "--alpha"),
    (["--alpha", "0.8", "--k", "0", "--speed-ratio", "8"], "--k must be >= 1"),
    (["--alpha", "0.8", "--k", "two", "--speed-ratio", "8"], "--k"),
    (["--alpha", "0.8", "--speed-ratio", "0"], "--speed-ratio must be > 0"),
    (["--alpha", "0.8", "--speed-ratio", "-2"], "--speed-ratio must be > 0"),
    (["--alpha", "0.8"], "needs --speed-ratio"),
    (["--p-target", "0.6,0.1,0.3", "--p-draft", "0.5,0.3"], "--p-draft sums to"),
    (["--p-target", "0.6,0.1,x", "--p-draft", "0.5,0.3,0.2"], "not a number"),
    (["--p-target", "1.2,-0.2", "--p-draft", "0.5,0.5"], ">= 0"),
    (["--p-target", "0.6,0.4", "--p-draft", "0.5,0.3,0.2"], "outcomes"),
    (["--p-target", "0.6,0.4"], "needs --p-draft"),
    (["--profile", "--model", "no-such-model"], "unknown model"),
    (["--profile", "--repeats", "0"], "--repeats must be >= 1"),
    (["--profile", "--max-n", "1"], "--max-n must be >= 2"),
    (["--profile", "--dtype", "fp8"], "--dtype"),
    (["--eps-chinchilla", "--params", "0", "--tokens", "2T"], "--params"),
    (["--eps-chinchilla", "--params", "135M"], "needs --tokens"),
    ([], "calc needs one of"),
    (["--alpha", "0.8", "--speed-ratio", "8", "--profile"], "separate calculations"),
    (["--alpha", "0.8", "--speed-ratio", "8", "--repeats", "3"], "--repeats does not apply"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    rc, out, err = calc(capsys, *args)
    lines = err.strip().splitlines()
    assert rc == 2 and out == ""
    assert len(lines) == 1 and lines[0].startswith("speculate: error:") and message in lines[0], lines


def test_bad_input_in_a_real_process():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "speculate", "calc", "--alpha", "2", "--speed-ratio", "8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == ["speculate: error: --alpha must be in [0, 1], got 2"]
