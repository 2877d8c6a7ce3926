"""Shared fixtures: tiny random models saved as ordinary HF folders, and the real default model."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest
import torch

from speculate import load_model
from speculate.models.cache import cache_root
from speculate.models.loader import QUANTIZED, quantized_cache_folder
from speculate.models.tiny import save_tiny_model
from speculate.server.background import free_port, wait_healthy

# A cost curve measured on a busy machine is not cached (policy/profile.py, Profile.doubtful): the suite's tests of
# caching must not depend on a quiet machine, so the suite (and the servers it starts) trusts every curve. The test
# of that rule sets its own tolerance.
os.environ["SPECULATE_BUSY_TOLERANCE"] = "1"

# Under pytest-xdist (.ci/run runs two workers) each worker takes its share of the cores: two workers each running
# torch's default team (one thread per core) would put twice as many threads as cores to work, and GNU OpenMP's
# teams then sleep between parallel regions (models/loader.py, ``check_thread``). No test's result may rest on the
# thread count: the kernels' rows are thread-invariant by construction, and the tests of that set their own counts
# (test_blocks.py, each layer; test_exactness.py, the whole forward at one and at two threads).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, torch.get_num_threads() // _WORKERS))


@contextlib.contextmanager
def torch_threads(n: int):
    """torch at ``n`` threads inside the block, and back to the count it had after (a test that needs one count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    folders = {seed: save_tiny_model(root / f"seed{seed}", seed=seed) for seed in (0, 1, 2)}
    yield folders
    # Tests that load these at int8 without a cache of their own quantize into the user's cache, under this
    # session's temporary paths: remove those entries, or every run would leave new ones behind.
    for folder in folders.values():
        for kind in QUANTIZED:
            shutil.rmtree(quantized_cache_folder(str(folder), folder, kind), ignore_errors=True)
    # ...and the --k auto cost profiles measured on them (policy/auto.py, profile_path: named after the folders' paths).
    mark = re.sub(r"[^A-Za-z0-9_.@+-]+", "_", f"{root.parent.name}/{root.name}/")
    for profile in (cache_root() / "profiles").glob(f"*{mark}*"):
        profile.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def tiny(tiny_folders):
    """seed → LoadedModel (loaded once per session)."""
    return {seed: load_model(str(folder)) for seed, folder in tiny_folders.items()}


def noisy_copy(loaded, scale: float, seed: int = 123):
    """A draft model: the target's weights plus Gaussian noise. Agrees with the target often, not always."""
    draft = copy.deepcopy(loaded)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return draft


@pytest.fixture(scope="session")
def default_model():
    """The embedded default (SmolLM2-135M-Instruct) at fp32, converted once into the cache."""
    return load_model(dtype="fp32")


def assert_chains_equal_one_token(kv, ids):
    """Through a KV model: a 70-token prefill, a 9-token chain, a rollback to 73 and a 17-token chain (the cache
    grows from 32 slots) give each row exactly the bits of feeding ``ids`` one token at a time."""
    kv.reset(32)
    got = [kv.forward(ids[:70]), kv.forward(ids[70:79])]
    kv.keep(73)
    got.append(kv.forward(ids[73:90]))
    kv.reset(32)
    rows = torch.cat([kv.forward(ids[i: i + 1]) for i in range(90)])
    assert torch.equal(got[0], rows[:70]) and torch.equal(got[1], rows[70:79]) and torch.equal(got[2], rows[73:90])


def assert_pytest_passed(done, skipped: bool = True) -> None:
    """A pytest run in a subprocess (``done``: its CompletedProcess) passed: exit 0 and, on its summary line,
    tests passed and none failed or errored (nor skipped, where ``skipped`` is False). The summary line only:
    test names and warnings may contain those words."""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and not re.search(r"\d+ (failed|errors?)\b", summary), summary
    assert skipped or not re.search(r"\d+ skipped", summary), summary


@contextlib.contextmanager
def serve_subprocess(args: list[str], env: dict, seconds: float = 60):
    """``speculate serve ARGS`` in a subprocess on a free loopback port, as a user starts it: yields (the process, its
    URL) once /health answers; kills it on the way out if the test has not stopped it."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "speculate", "serve", *args, "--port", str(port), "--log-level",
                             "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        healthy = wait_healthy(url, seconds, lambda: proc.poll() is None, interval=0.1)
        assert proc.poll() is None, proc.stdout.read()
        assert healthy, f"{url} did not answer /health within {seconds} s"
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(15)


@pytest.fixture
def seen(monkeypatch):
    """Fresh runs planned at their α as though they had evidence (``batch._unseen``: in a batch, a run with none
    drafts nothing in its first round)."""
    from speculate.policy import batch

    monkeypatch.setattr(batch, "_unseen", lambda run: False)
