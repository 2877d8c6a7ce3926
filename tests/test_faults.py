"""A damaged cache and killed builds (issue 42): what is left behind must never break the next start."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from speculate.models import kernel
from speculate.spec import SpeculativeSpec

LOAD_KERNELS = "from speculate.models import kernel; import sys; sys.exit(0 if kernel.load() is not None else 3)"


def run_python(code: str, cache, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SPECULATE_CACHE": str(cache), **env})


@pytest.mark.skipif(kernel._compiler() is None, reason="no C compiler")
def test_a_damaged_kernel_library_is_rebuilt_not_loaded(tmp_path):
    """A truncated .so was mapped and every later start died of SIGBUS with no message (a zeroed page: SIGSEGV);
    now the library's recorded sha256 is checked before loading, and a mismatch is rebuilt. A missing record (a
    build killed between its two writes) is rebuilt quietly."""
    first = run_python(LOAD_KERNELS, tmp_path)
    assert first.returncode == 0, first.stderr
    (built,) = (tmp_path / "kernels").glob("kernels-*.so")
    size = built.stat().st_size
    for damage in ("truncated", "zeroed", "no record"):
        if damage == "truncated":
            os.truncate(built, size // 3)
        elif damage == "zeroed":
            built.write_bytes(bytes(size))
        else:
            built.with_suffix(".sha256").unlink()
        again = run_python(LOAD_KERNELS, tmp_path)
        assert again.returncode == 0, (damage, again.returncode, again.stderr[-2000:])
        assert built.stat().st_size == size, damage
        assert built.with_suffix(".sha256").read_text() == kernel.sha256_file(built), damage
        assert ("do not match their recorded checksum" in again.stderr) == (damage != "no record"), damage


KILLED_BUILD = """
import os, sys, time
from pathlib import Path
from speculate.models.cache import building
with building(Path(sys.argv[1])) as tmp:
    (tmp / "model.safetensors").write_bytes(b"x" * 1000)
    print("writing", flush=True)
    time.sleep(600)
"""


def test_a_killed_builds_scratch_folder_is_swept_at_the_next_start(tmp_path):
    """A first conversion killed mid-way left its scratch folder (~0.5 GB for the default model) for good: the next
    build waited an hour for it, and once a build succeeded nothing looked again. Now the folder is locked while it
    is written, and any start (load_model) removes the folders whose lock is free, at once; a live build's stays."""
    from speculate import load_model
    from speculate.models.tiny import save_tiny_model

    cache = tmp_path / "cache"
    cache.mkdir()
    model = save_tiny_model(tmp_path / "tiny", seed=0)

    def start_build(name):
        proc = subprocess.Popen([sys.executable, "-c", KILLED_BUILD, str(cache / name)], stdout=subprocess.PIPE,
                                text=True, env={**os.environ, "SPECULATE_CACHE": str(cache)})
        assert proc.stdout.readline().strip() == "writing"
        return proc

    killed, live = start_build("m.q4"), start_build("other.int8")
    killed.kill()
    killed.wait()
    scratch = sorted(p.name for p in cache.iterdir())
    assert len(scratch) == 2 and all(name.startswith((".m.q4.", ".other.int8.")) for name in scratch)
    try:
        os.environ["SPECULATE_CACHE"] = str(cache)
        load_model(str(model))  # any start sweeps: fp32, a local folder, nothing to build
    finally:
        del os.environ["SPECULATE_CACHE"]
        live.kill()
        live.wait()
    assert [p.name for p in cache.iterdir()] == [n for n in scratch if n.startswith(".other.int8.")]


def test_tampered_quantized_weights_are_converted_again(tmp_path, monkeypatch):
    """q4 tensors changed in the cache, with the manifest rewritten to match, loaded silently: the digest recorded
    at conversion was never compared with the tensors. Now they are, and a mismatch is converted again."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from speculate import load_model
    from speculate.models.cache import write_manifest
    from speculate.models.loader import CacheWarning
    from speculate.models.tiny import save_tiny_model

    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path / "cache"))
    model = save_tiny_model(tmp_path / "tiny", seed=1)
    first = load_model(str(model), dtype="int8")
    (folder,) = (tmp_path / "cache").glob("*.int8")
    file = folder / "int8.safetensors"
    with safe_open(file, "pt") as f:
        meta = f.metadata()
    tensors = load_file(file)
    name = next(n for n, t in tensors.items() if t.dtype == torch.int8)
    tensors[name] = tensors[name].flip(0).contiguous()  # other weights, the same shape and type
    save_file(tensors, file, metadata=meta)
    write_manifest(folder)  # the manifest rewritten to match: the files alone look intact
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with pytest.warns(CacheWarning, match="converting again"):
        again = load_model(str(model), dtype="int8")
    assert torch.equal(first.model(ids).logits, again.model(ids).logits)
    assert not load_file(file)[name].equal(tensors[name])  # the cache was written again, from the conversion


def no_space(*args, **kwargs):
    import errno

    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_during_a_first_conversion_is_one_line(tmp_path, monkeypatch, capsys):
    """It printed a 48-line traceback; now one line, exit 2, and nothing half-written left in the cache."""
    import safetensors.torch

    from speculate.cli import main
    from speculate.models.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "tiny", seed=2)
    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(safetensors.torch, "save_file", no_space)  # the int8 tensors' write
    capsys.readouterr()  # (the tiny model's own saving)
    assert main(["generate", "hi", "--model", str(model), "--dtype", "int8", "--max-new-tokens", "2"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    # (a CPU without VNNI also warns, one line, that int8 runs 7-bit activation rows there: models/loader.py)
    warned = [line for line in err if line.startswith("speculate: warning: int8 on this CPU: ")]
    err = [line for line in err if line not in warned]
    assert len(warned) <= 1 and len(err) == 1 and err[0].startswith("speculate: error: cannot write the cache in "), err
    assert "No space left on device" in err[0]
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name == "kernels"] == []


def test_a_full_disk_while_serving_is_a_server_fault_not_the_requests(tiny_folders, tmp_path, monkeypatch):
    """k: "auto" measures and writes the machine's cost profile on first use; a full disk there was a 400
    invalid_request_error. It is the server's fault: 507 (a 5xx), and the next request that needs no write works (one
    that names its k: the server's k as a cap is planned on the batch curve, which this test's profile path hides)."""
    import httpx

    from speculate.policy import auto
    from speculate.models import cache
    from speculate.server import ServerConfig, create_app, load_models
    from speculate.server.background import BackgroundServer

    config = ServerConfig(model=str(tiny_folders[0]), spec=SpeculativeSpec(k=3))
    target, draft = load_models(config)
    server = BackgroundServer(create_app(config, target, draft))
    monkeypatch.setattr(auto, "profile_path", lambda target, draft=None: tmp_path / "profile.json")
    monkeypatch.setattr(cache, "atomic_write_text", no_space)
    try:
        body = {"model": config.model, "prompt": "abc abc", "max_tokens": 4, "temperature": 0}
        r = httpx.post(server.url + "/v1/completions", json={**body, "speculative": {"k": "auto"}}, timeout=120)
        assert r.status_code == 507 and r.json()["error"]["type"] == "server_error", r.text
        assert "No space left on device" in r.json()["error"]["message"]
        named = {**body, "speculative": {"k": 3}}
        assert httpx.post(server.url + "/v1/completions", json=named, timeout=60).status_code == 200
    finally:
        server.stop()
