"""A drafter or a verifier is one file: a throw-away module outside the package, named in SPECULATE_PLUGINS, is a
choice of `speculate generate`, of a server request's `speculative` object and of a bench method, with its option
given as each of them takes options, and decodes losslessly (greedy: plain decoding's tokens). A process reads the
plugins once, when it first uses a registry, so each path runs in a subprocess of its own, as a user runs it."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import httpx
import pytest

from speculate import SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.drafters import DRAFTERS

from conftest import serve_subprocess

PROMPT = "abc abc abc abd abc"
N = 24

# Drafts the last token ``times`` times, certain of it (one-hot): nothing the target could not have decoded itself.
REPEAT = '''
import torch

from speculate.drafters.base import Draft, Drafter
from speculate.params import Param


class RepeatDrafter(Drafter):
    name = "repeat"
    summary = "the last token again"
    params = (Param("times", 1, "how many copies of the last token a round drafts"),)

    def __init__(self, times=1):
        self.times = times

    def propose(self, tokens, k):
        return Draft(torch.tensor([tokens[-1]] * min(self.times, k), dtype=torch.long))
'''

# Greedy's rule, keeping at most ``cap`` drafts a round: still the target's argmax tokens, fewer per round.
CAPPED = '''
from speculate.params import Param
from speculate.verifiers import Verdict, Verifier


class CappedVerifier(Verifier):
    name = "capped"
    params = (Param("cap", 64.0, "the most drafts a round keeps", low=0),)
    needs_draft_probs = False
    lossless = True

    def verify(self, draft_tokens, draft_probs, target_probs, state=None, generator=None, sample_probs=None):
        argmax = target_probs.argmax(dim=-1)
        n = 0
        while n < min(len(draft_tokens), int(self.cap)) and int(draft_tokens[n]) == int(argmax[n]):
            n += 1
        return Verdict(n, int(argmax[n]), state)
'''


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """The environment of a process that has the two plugins: their folder on PYTHONPATH, their modules named."""
    root = tmp_path_factory.mktemp("plugins")
    (root / "repeat_drafter.py").write_text(REPEAT)
    (root / "capped_verifier.py").write_text(CAPPED)
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "SPECULATE_PLUGINS": "repeat_drafter, capped_verifier",
            "SPECULATE_CACHE": str(root / "cache")}


@pytest.fixture(scope="module")
def plain(tiny):
    """Plain greedy decoding of PROMPT on tiny model 0: what every lossless run must give."""
    return SpeculativeDecoder(tiny[0], SpeculativeSpec("none")).generate(PROMPT, max_new_tokens=N, chat=False)


def _speculate(env, *args, timeout=300) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "speculate", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _generate(env, folder, *flags) -> dict:
    done = _speculate(env, "generate", PROMPT, "--model", str(folder), "--no-chat", "--max-new-tokens", str(N),
                      "--k", "4", "--json", *flags)
    return json.loads(done.stdout)


def test_generate_takes_a_plugin_drafter_and_its_option(plugin_env, tiny_folders, plain):
    out = _generate(plugin_env, tiny_folders[0], "--drafter", "repeat", "--drafter-opt", "times=3")
    assert out["token_ids"] == plain.token_ids
    # times=3 reached it: rounds drafted 3 tokens (the default, 1, drafts one; k = 4 would allow 4)
    assert len(out["stats"]["drafted_by_position"]) == 3 and out["stats"]["drafted_by_position"][2] > 0
    shown = _speculate(plugin_env, "generate", "--help").stdout
    assert "repeat: the last token again" in " ".join(shown.split())  # --drafter's help, from its declaration
    assert "repeat: times=1" in " ".join(shown.split())  # --drafter-opt's


def test_generate_takes_a_plugin_verifier_and_its_parameter(plugin_env, tiny_folders, plain):
    """The target drafting for itself: greedy keeps all 4 drafts of a round; the plugin, with --cap 2, two."""
    flags = ["--drafter", "model", "--draft-model", str(tiny_folders[0])]
    free = _generate(plugin_env, tiny_folders[0], *flags, "--verifier", "capped")
    capped = _generate(plugin_env, tiny_folders[0], *flags, "--verifier", "capped", "--cap", "2")
    assert free["token_ids"] == capped["token_ids"] == plain.token_ids
    assert [n > 0 for n in free["stats"]["accepted_by_position"]] == [True] * 4
    assert [n > 0 for n in capped["stats"]["accepted_by_position"]] == [True, True, False, False]


def test_a_server_request_names_a_plugin_drafter_and_verifier(plugin_env, tiny_folders, plain):
    folder = str(tiny_folders[0])
    args = ["--model", folder, "--drafter", "model", "--draft-model", folder, "--k", "4"]
    with serve_subprocess(args, plugin_env, seconds=120) as (proc, url):
        def complete(speculative):
            body = {"model": folder, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "speculative": speculative}
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"], r.json()["speculative_stats"]

        text, _ = complete({"drafter": "none"})
        assert text == plain.text
        repeat_text, repeat = complete({"drafter": "repeat", "k": 4})  # (k named: not the planner's timed cap)
        assert repeat_text == text and repeat["drafter"] == "repeat"
        assert len(repeat["drafted_by_position"]) == 1 and repeat["drafted_tokens"] > 0  # its default, times=1
        capped_text, capped = complete({"drafter": "model", "verifier": "capped", "cap": 2, "k": 4})
        assert capped_text == text and capped["verifier"] == "capped"
        assert [n > 0 for n in capped["accepted_by_position"]] == [True, True, False, False]
        r = httpx.post(url + "/v1/completions", json={"model": folder, "prompt": PROMPT,
                                                       "speculative": {"drafter": "repeats"}}, timeout=60)
        assert r.status_code == 400 and "choose one of: auto, none, lookup" in r.text and "repeat" in r.text


def test_a_bench_method_names_a_plugin_drafter_and_verifier(plugin_env, tiny_folders, tmp_path):
    out = tmp_path / "run"
    config = tmp_path / "c.toml"
    config.write_text(f'model = "{tiny_folders[0]}"\nout = "{out}"\ndatasets = ["copy"]\nlimit = 1\n'
                      f'max_new_tokens = 16\ncalibrate = false\ndrafters = []\nverifiers = []\nbaselines = []\n'
                      'method = ["drafter=repeat,k=4,times=3", "drafter=lookup,verifier=capped,k=4"]\n')
    _speculate(plugin_env, "bench", "--config", str(config), timeout=600)
    turns = {r["method"]: r["turns"][0] for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}
    assert set(turns) == {"plain", "SD/repeat k=4 times=3", "capped/lookup k=4"}
    for turn in turns.values():
        assert turn["token_ids"] == turns["plain"]["token_ids"] and len(turn["token_ids"]) == 16
    assert len(turns["SD/repeat k=4 times=3"]["stats"]["drafted_by_position"]) == 3  # times=3 reached the drafter


def test_a_plugin_that_cannot_be_imported_is_named_in_one_line(plugin_env, tiny_folders):
    env = {**plugin_env, "SPECULATE_PLUGINS": "repeat_drafter,no_such_plugin"}
    done = subprocess.run([sys.executable, "-m", "speculate", "generate", "hi", "--model", str(tiny_folders[0])],
                          env=env, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("speculate: error: SPECULATE_PLUGINS names 'no_such_plugin', which cannot be imported")


def test_each_drafters_declared_defaults_are_its_constructors():
    """A declared option's default is what the registry passes; the constructor's own default (used when a drafter
    is built directly) must be the same value, or the two ways of building it would differ."""
    checked = 0
    for name, entry in DRAFTERS.items():
        if name != entry.cls.name:
            continue  # a variant's defaults may differ from the constructor's on purpose (eagle-chain's gate)
        signature = inspect.signature(entry.cls.__init__).parameters
        for param in entry.params:
            assert param.name in signature, (name, param.name)
            assert signature[param.name].default == param.default, (name, param.name)
            checked += 1
    assert checked >= 20
