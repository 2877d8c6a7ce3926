"""Speculation against plain in one server, wave by wave (bench/ab.py): the waves' order, the paired ratio and its
interval, and a real server's two arms on the same prompts."""

from __future__ import annotations

import pytest

from speculate.bench import ab, script
from speculate.errors import SpeculateError


def test_waves_alternate_their_first_arm_and_every_wave_is_a_full_load():
    waves = ab.schedule(16, 4, 2)
    assert [(w.start, w.stop) for w, _ in waves] == [(0, 4), (4, 8), (8, 12), (12, 16)] * 2
    assert [order for _, order in waves] == [("a", "b"), ("b", "a")] * 4
    # A last stretch shorter than a wave is left out: every wave is the same load.
    assert [(w.start, w.stop) for w, _ in ab.schedule(6, 4, 3)] == [(0, 4)] * 3
    for bad in ((3, 4, 1), (16, 0, 1), (16, 1, 0)):
        with pytest.raises(SpeculateError):
            ab.schedule(*bad)


def fake_send(drift, b_cost, differ=()):
    """A server whose speed drifts from wave to wave (``drift``, both arms alike) where arm b takes ``b_cost`` x a's
    time for the same tokens (a function of the wave); prompts in ``differ`` answer otherwise in arm b."""
    calls = []

    def send(indices, arm):
        wave = len(calls) // 2
        calls.append((wave, arm, indices))
        seconds = drift[wave] * len(indices) * (b_cost(wave) if arm == "b" else 1.0)
        texts = [f"{i}{'!' if arm == 'b' and i in differ else ''}" for i in indices]
        counters = {"round_seconds_count": 10, "drafted_tokens_total": 4 if arm == "a" else 0,
                    "accepted_tokens_total": 3 if arm == "a" else 0, "peeked_rounds_total": 0}
        return texts, 20 * len(indices), seconds, counters

    return send, calls


def test_the_ratio_pairs_each_waves_two_runs_so_drift_cancels():
    # The machine slows 3x over the run, both arms alike; b is 1.25x slower in every wave: a ÷ b is 1.25 exactly,
    # and so is every resampling of the waves.
    send, calls = fake_send([1.0, 1.5, 2.0, 3.0, 2.5, 1.2, 1.1, 1.0], lambda w: 1.25, differ={5})
    waves = ab.measure(send, 16, 4, 2)
    assert [(w, arm) for w, arm, _ in calls[:4]] == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]
    assert [w["order"] for w in waves] == ["ab", "ba"] * 4
    s = ab.summary(waves)
    assert s["waves"] == 8 and s["a_over_b"] == pytest.approx(1.25) and s["median_wave_ratio"] == pytest.approx(1.25)
    assert s["interval_95"] == [pytest.approx(1.25), pytest.approx(1.25)]
    # Prompt 5 answers otherwise in b: once in each pass, in the wave of prompts 4-7.
    assert [w["texts_differ"] for w in waves] == [0, 1, 0, 0] * 2 and s["texts_differ"] == 2
    assert s["a_counters"] == {"round_seconds_count": 80, "drafted_tokens_total": 32, "accepted_tokens_total": 24,
                               "peeked_rounds_total": 0}
    assert s["b_counters"]["drafted_tokens_total"] == 0
    assert s["a_tokens_per_second"] == pytest.approx(640 / sum(w["a"]["seconds"] for w in waves), abs=0.01)


def test_the_interval_spans_the_waves_spread_and_is_seeded():
    send, _ = fake_send([1.0] * 8, lambda w: (0.9, 1.1, 1.0, 1.3, 0.95, 1.05, 1.2, 0.85)[w])
    s = ab.summary(ab.measure(send, 16, 4, 2))
    lo, hi = s["interval_95"]
    assert 0.85 < lo < s["a_over_b"] < hi < 1.3
    assert ab.summary(ab.measure(fake_send([1.0] * 8, lambda w: (0.9, 1.1, 1.0, 1.3, 0.95, 1.05, 1.2, 0.85)[w])[0],
                                 16, 4, 2))["interval_95"] == [lo, hi]
    table = ab.to_markdown({"loads": [{"clients": 4, **s}]}).splitlines()
    assert len(table) == 3 and table[2].startswith("| 4 | 8 | ") and f"| {lo:.3f}-{hi:.3f} | 32 / 24 | 0 |" in table[2]


def test_one_server_serves_both_arms_the_same_texts(tiny_folders):
    # A tiny model at fp32 (exact through the kernel), lookup at a k the request names (kept whatever the planner's
    # curve says) on the copy prompts, against {"drafter": "none"}: both arms decode every prompt to the same text, and
    # only arm a drafts.
    record = ab.run(str(tiny_folders[0]), clients=[2], repeats=1, max_tokens=12, prompts="copy",
                    a={"drafter": "lookup", "k": 3}, server_args=["--dtype", "fp32"], threads=1, ready_timeout=120)
    assert record["b"] == {"drafter": "none"} and record["server"][-2:] == ["--dtype", "fp32"]
    (load,) = record["loads"]
    assert load["clients"] == 2 and load["waves"] == 3 and load["texts_differ"] == 0
    assert [w["order"] for w in load["per_wave"]] == ["ab", "ba", "ab"]
    for w in load["per_wave"]:
        assert w["a"]["tokens"] == w["b"]["tokens"] and 2 <= w["a"]["tokens"] <= 24
    assert load["a_counters"]["drafted_tokens_total"] > 0 == load["b_counters"]["drafted_tokens_total"]
    lo, hi = load["interval_95"]
    assert lo <= load["a_over_b"] <= hi


def test_bad_input_is_one_line_before_any_server_starts(capsys):
    assert script(ab.main, ["--a", "[1]"]) == 2
    assert script(ab.main, ["--clients", "17"]) == 2
    assert script(ab.main, ["--prompts", "nope"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["speculate: an arm must be 'default' or a JSON object, got '[1]'",
                     "speculate: a wave of 17 clients needs 17 prompts; the set has 16",
                     "speculate: unknown prompt set 'nope'; choose one of: " + ", ".join(ab.PROMPTS)]
