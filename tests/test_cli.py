"""The command line, as a user runs it: JSON output, and one-line errors with a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speculate import SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.cli import main


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "speculate", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def test_generate_json_matches_the_api(tiny_folders, tiny):
    folder = str(tiny_folders[0])
    r = run("generate", "hello hello hello", "--model", folder, "--json", "--max-new-tokens", "20", "--k", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    api = SpeculativeDecoder(tiny[0],
                             SpeculativeSpec("lookup", verifier="greedy",
                                             k=3)).generate("hello hello hello", max_new_tokens=20)
    assert out["text"] == api.text and out["token_ids"] == api.token_ids
    st = out["stats"]
    assert st["new_tokens"] == len(out["token_ids"]) == 20
    assert st["mean_accepted_length"] == pytest.approx(st["new_tokens"] / st["target_calls"], abs=1e-3)
    assert st["llm_calls_ratio"] == pytest.approx(st["target_calls"] / st["new_tokens"], abs=1e-3)
    for key in ("drafted_tokens", "accepted_draft_tokens", "acceptance_by_position", "wall_seconds",
                "tokens_per_second"):
        assert key in st


def test_stream_prints_the_same_text(tiny_folders):
    folder = str(tiny_folders[1])
    a = run("generate", "abc abc", "--model", folder, "--max-new-tokens", "15", "--stream", "--no-chat")
    b = run("generate", "abc abc", "--model", folder, "--max-new-tokens", "15", "--no-chat")
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout and "tokens/s" in a.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "no-such-model"], "unknown model"),
    (["--k", "0"], "--k"),
    (["--verifier", "consultant", "--eps", "0"], "eps"),
    (["--verifier", "consultant", "--beta", "1"], "beta"),
    (["--verifier", "consultant", "--beta", "-0.1"], "beta"),
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "inf"], "finite"),
    (["--draft-dtype", "int8"], "needs --draft-model"),
    (["--stream", "--json"], "choose one"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--max-new-tokens", "-3"], "max-new-tokens"),
    (["--max-new-tokens", "100000"], "context window"),
    (["--drafter", "nope"], "drafter"),
    (["--verifier", "nope"], "verifier"),
    (["--k", "two"], "--k"),
    (["--eps", "lots"], "--eps"),
    (["--eps", "auto"], "consultant"),  # auto calibrates CD's NLL threshold only
    (["--drafter-opt", "base_k=2"], "takes: max_ngram, min_ngram"),  # lookup's options
    (["--drafter-opt", "max_ngram=three"], "an integer"),
    (["--drafter-opt", "max_ngram=1", "--drafter-opt", "min_ngram=2"], "min_ngram <= max_ngram"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_folders, capsys, args, message):
    # In-process (an unexpected exception would escape main() and fail the test); the subprocess
    # tests below check the same through a real process.
    model = [] if "--model" in args else ["--model", str(tiny_folders[0])]
    assert main(["generate", "hello", *model, *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines


def test_bad_model_folder_and_empty_prompt(tmp_path, tiny_folders):
    for args, message in [(["hello", "--model", str(tmp_path)], "not a Hugging Face model folder"),
                          (["  ", "--model", str(tiny_folders[0])], "empty")]:
        r = run("generate", *args)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr


def test_mismatched_draft_tokenizer_is_refused(tmp_path, tiny_folders):
    from speculate.models.tiny import save_tiny_model, tiny_tokenizer

    other = save_tiny_model(tmp_path / "other", seed=3)
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|extra|>"]})
    tok.save_pretrained(other)
    r = run("generate", "hello", "--model", str(tiny_folders[0]), "--drafter", "model", "--draft-model", str(other))
    assert r.returncode == 2 and "tokenizer" in r.stderr and "Traceback" not in r.stderr


def test_drafter_options_reach_the_drafter(tiny_folders, tmp_path, capsys):
    """--drafter-opt: an EAGLE chain gated at confidence 1 drafts nothing (its random head is never sure),
    ungated it drafts every round; the tokens are the same (greedy)."""
    from speculate.heads import EagleHead, save_heads
    from speculate.models import load_model

    folder = str(tiny_folders[0])
    loaded = load_model(folder)
    torch.manual_seed(0)
    save_heads(tmp_path, EagleHead.for_target(loaded.model.config), loaded.name, 259)
    runs = {}
    for gate in ("0", "1"):
        assert main(["generate", "abc abc", "--model", folder, "--no-chat", "--max-new-tokens", "12", "--json",
                     "--drafter", "eagle-chain", "--heads", str(tmp_path), "--drafter-opt", f"min_confidence={gate}"]) == 0
        runs[gate] = json.loads(capsys.readouterr().out)
    assert runs["0"]["token_ids"] == runs["1"]["token_ids"]
    assert runs["1"]["stats"]["drafted_tokens"] == 0 and runs["0"]["stats"]["drafted_tokens"] > 0


def test_train_heads_end_to_end(tiny_folders, tmp_path, capsys):
    """`speculate train-heads` on a tiny model: data (prompts, answers, hidden rows), training, saved heads
    whose config records the data and the time; the heads then draft through `generate`. Bad input: one line."""
    out = tmp_path / "medusa"
    args = ["train-heads", "--kind", "medusa", "--model", str(tiny_folders[0]), "--out", str(out), "--prompts", "4",
            "--max-new-tokens", "6", "--steps", "3", "--vocab-subset", "0", "--quiet"]
    assert main(args) == 0
    config = json.loads((out / "config.json").read_text())
    training = config["training"]
    assert config["kind"] == "medusa" and training["steps"] == 3 and training["data"]["prompts"] == 4
    assert training["train_seconds_total"] >= training["train_seconds"] >= 0
    assert not (out / "data-4x6.prompts.json").exists()  # the prompt list is kept only until the data exists
    capsys.readouterr()
    assert main(["generate", "hello", "--model", str(tiny_folders[0]), "--drafter", "medusa", "--heads", str(out),
                 "--max-new-tokens", "5"]) == 0
    capsys.readouterr()
    for bad, flag in (([a if a != "3" else "0" for a in args], "--steps"),  # --steps 0
                      (args + ["--feature-layers", "0"], "--feature-layers"),  # medusa
                      (args[:2] + ["eagle"] + args[3:] + ["--feature-layers", "0,x"], "--feature-layers"),
                      (args[:2] + ["eagle"] + args[3:] + ["--feature-layers", "1"], "feature layers"),  # the last
                      (args[:2] + ["eagle"] + args[3:] + ["--loss-weights", "1"], "--loss-weights"),
                      (args[:2] + ["eagle"] + args[3:] + ["--loss-weights", "0,0"], "--loss-weights")):
        assert main(bad) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flag in err[0], err


def test_unwritable_outputs_are_one_line_before_any_model_loads(tmp_path, capsys, monkeypatch):
    """train-heads with an --out that cannot be a folder, and calc --from-results on a damaged run: one line,
    exit 2; calc only reads a results folder (a torn last line stays for the run that resumes to repair)."""
    import speculate.models as models

    def no_loading(*a, **k):
        raise AssertionError("the model should not load")

    monkeypatch.setattr(models, "load_model", no_loading)
    (tmp_path / "file.txt").write_text("not a folder")
    assert main(["train-heads", "--kind", "medusa", "--out", str(tmp_path / "file.txt" / "sub")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--out" in lines[0] and "cannot create the folder" in lines[0], lines
    run = tmp_path / "run"
    run.mkdir()
    real = Path(__file__).parent.parent / "docs" / "runs" / "retrieval-int8" / "samples.jsonl"
    plain = next(line for line in real.read_text().splitlines() if '"method": "plain"' in line)
    (run / "samples.jsonl").write_text(plain + '\n{"meth')  # a record of a real run, then a torn line
    for content in ("not json", "[]", "{}"):
        (run / "run.json").write_text(content)
        assert main(["calc", "--from-results", str(run)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and "damaged" in lines[0], lines
    (run / "run.json").write_text((real.parent / "run.json").read_text())
    before = (run / "samples.jsonl").read_bytes()
    assert main(["calc", "--from-results", str(run)]) == 2  # nothing it can predict: one line
    assert "no speculative method" in capsys.readouterr().err
    assert (run / "samples.jsonl").read_bytes() == before
    (run / "samples.jsonl").write_text('{"method": 5}\n')
    assert main(["calc", "--from-results", str(run)]) == 2
    assert "not a result record" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ issue 35
def _subparsers():
    import argparse

    from speculate.cli import _parser

    p = _parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


def test_every_flag_of_every_subcommand_has_help_and_shows_its_default():
    import argparse

    subcommands = _subparsers()
    assert {"generate", "serve", "bench", "calc", "train-heads", "train-answers"} <= set(subcommands)
    for name, parser in subcommands.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert (action.help or "").strip(), f"{flag} has no help"
            default = action.default
            if default is None or default is argparse.SUPPRESS:
                continue
            shown = formatter._expand_help(action)  # the text --help prints for it
            if isinstance(default, bool):
                assert "default" in shown, f"{flag}: {shown!r} does not say its default"
            else:
                forms = {str(default)} | ({f"{default:g}"} if isinstance(default, float) else set())
                assert any(form in shown for form in forms), f"{flag}: {shown!r} does not show {default!r}"
    shown = subcommands["generate"].format_help()
    assert "(default: 1.0)" in shown and "(default: 256)" in shown  # --top-p, --max-new-tokens


@pytest.mark.parametrize("args, message", [
    (["--temperature", "-0.5"], "temperature must be a finite number >= 0, got -0.5"),
    (["--top-p", "2"], "top_p must be in (0, 1], got 2.0"),
    (["--top-k", "-3"], "top_k must be >= 0, got -3"),
    (["--seed", "-1", "--temperature", "0.7"], "seed must be an integer in [0, 2^63), got -1"),
    (["--seed", str(2**63)], "seed must be an integer in [0, 2^63)"),
    (["--max-new-tokens", "-3"], "--max-new-tokens"),
    (["--stream", "--json"], "choose one"),
])
def test_bad_sampling_flags_are_refused_before_the_model_loads(tmp_path, monkeypatch, capsys, args, message):
    """The default model, an empty cache: a bad flag is one line and exit 2, and nothing was converted or
    loaded into the cache (it stays empty)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("SPECULATE_CACHE", str(cache))
    assert main(["generate", "hi", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("speculate: error: ") and message in lines[0], lines
    assert list(cache.iterdir()) == []


def test_bad_sampling_flag_in_a_real_process_is_one_line(tmp_path):
    r = run("generate", "hi", "--top-p", "2", env={"SPECULATE_CACHE": str(tmp_path)})
    assert r.returncode == 2 and r.stderr.strip() == "speculate: error: top_p must be in (0, 1], got 2.0"
    assert list(tmp_path.iterdir()) == []


def test_stats_line_names_the_draft_positions_it_shows():
    from speculate.cli import stats_line
    from speculate.stats import Stats

    s = Stats(new_tokens=16, wall_seconds=1.0)
    s.record(12, 12)  # a copy 12 long, accepted whole
    s.record(3, 1)  # then one of 3, its first kept
    line = stats_line("lookup/greedy k=6", s, 6)
    assert line.endswith("2 target calls, 8.00 tokens per call, acceptance by draft position (1..12, past k = 6: "
                         "this drafter's copies grow longer than k) [1.0, 0.5, 0.5" + ", 1.0" * 9 + "]"), line
    s = Stats(new_tokens=3, wall_seconds=1.0)
    s.record(2, 1)
    assert stats_line("lookup/greedy k=6", s, 6).endswith("acceptance by draft position (1..2) [1.0, 0.0]")
    assert stats_line("plain", Stats(new_tokens=3, target_calls=3, wall_seconds=1.0), 6).endswith("no drafts")


def test_generate_prints_the_stats_line(tiny_folders, capsys):
    assert main(["generate", "abc abc abc", "--model", str(tiny_folders[0]), "--no-chat", "--max-new-tokens", "12",
                 "--drafter", "lookup", "--k", "2"]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("[lookup/greedy k=2] 12 tokens in ") and "acceptance by draft position (1.." in line, line


def test_compare_prints_plain_decodings_speed_and_the_same_tokens(tiny_folders, tiny, capsys):
    """--compare decodes the prompt a second time without a drafter: at temperature 0 the tokens must be equal, and
    the line says so (and the JSON carries plain decoding's own tokens and stats)."""
    args = ["generate", "abc abc abc abc", "--model", str(tiny_folders[0]), "--no-chat", "--max-new-tokens", "12",
            "--drafter", "lookup", "--k", "3", "--compare"]
    assert main(args) == 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-2].startswith("[lookup/greedy k=3] 12 tokens in "), lines
    assert lines[-1].startswith("[plain] 12 tokens in ") and lines[-1].endswith("as fast, the same tokens"), lines
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plain = SpeculativeDecoder(tiny[0], SpeculativeSpec("none")).generate(
        "abc abc abc abc", max_new_tokens=12, chat=False)
    assert out["plain"]["token_ids"] == out["token_ids"] == plain.token_ids
    assert out["plain"]["stats"]["target_calls"] == 12 and out["plain"]["stats"]["drafted_tokens"] == 0
    assert out["plain"]["speedup"] == pytest.approx(
        out["stats"]["tokens_per_second"] / out["plain"]["stats"]["tokens_per_second"], rel=1e-2)


def test_compare_says_when_the_tokens_differ():
    from types import SimpleNamespace

    from speculate.cli import compare_line
    from speculate.stats import Stats

    def gen(ids, seconds):
        return SimpleNamespace(token_ids=ids, stats=Stats(new_tokens=len(ids), target_calls=len(ids),
                                                          wall_seconds=seconds))

    assert compare_line(gen([1, 2, 3, 4], 1.0), gen([1, 2, 3, 4], 2.0), True).endswith(
        "2.00x as fast, the same tokens")
    assert compare_line(gen([1, 2, 5, 4], 1.0), gen([1, 2, 3, 4], 2.0), True).endswith(
        "different tokens from token 3 (a lossy verifier)")
    assert "not the same draws" in compare_line(gen([1, 5], 1.0), gen([1, 2], 1.0), False)


@pytest.mark.slow
def test_the_readmes_demo_is_an_edit_where_speculation_pays():
    """The README's first command, on the default model: a sensible answer (the typos fixed), plain decoding's
    tokens exactly, and more than 2.5 tokens per target call (a count, not a timing)."""
    import re
    import shlex

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    command = re.search(r"^pip install --no-deps .*? && speculate (generate .*)$", readme, re.M).group(1)
    args = shlex.split(command)
    assert "--compare" in args
    r = run(*args, "--json", "--max-new-tokens", "96")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for word in ("beautiful", "Saturday", "library", "restaurant"):
        assert word in out["text"], out["text"]
    for typo in ("beautifull", "libary"):
        assert typo not in out["text"], out["text"]
    assert out["token_ids"] == out["plain"]["token_ids"]
    assert out["stats"]["mean_accepted_length"] > 2.5, out["stats"]
