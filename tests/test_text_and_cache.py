"""Detokenization with stop strings, and the atomic, checksummed model cache."""

from __future__ import annotations

import json

import pytest

from speculate.models.cache import building, verified
from speculate.models.tiny import tiny_tokenizer
from speculate.text import Detokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def feed(tok, text, stop):
    d = Detokenizer(tok, stop)
    pieces = []
    for t in tok(text)["input_ids"]:
        pieces.append(d.add(t))
        if d.stopped:
            break
    pieces.append(d.flush())
    return d, pieces


def test_stop_string_across_tokens_is_cut_and_never_streamed(tok):
    d, pieces = feed(tok, "hello world, goodbye", ["wor"])
    assert d.text == "hello " and "".join(pieces) == "hello "
    assert d.stopped
    # The held-back "wo" was never shown before the stop was found.
    assert all("w" not in p for p in pieces)


def test_prefix_of_a_stop_string_is_released_when_it_does_not_complete(tok):
    d, pieces = feed(tok, "abcab abd", ["abd!"])
    assert not d.stopped and d.text == "abcab abd" and "".join(pieces) == "abcab abd"
    # "abd" was held back until flush (it could have become "abd!").
    assert pieces[-1] == "abd"


def test_earliest_of_several_stop_strings_wins(tok):
    d, _ = feed(tok, "one two three four", ["four", "two"])
    assert d.text == "one "


def test_multibyte_characters_are_never_split(tok):
    d, pieces = feed(tok, "naïve café ☕ done", None)
    assert "".join(pieces) == "naïve café ☕ done"
    assert all("\ufffd" not in p for p in pieces)


def test_cache_detects_corruption_and_truncation(tmp_path):
    folder = tmp_path / "m"
    with building(folder) as tmp:
        (tmp / "weights.bin").write_bytes(b"x" * 1000)
        (tmp / "config.json").write_text("{}")
    assert verified(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) == {"weights.bin", "config.json"}
    data = bytearray((folder / "weights.bin").read_bytes())
    data[500] ^= 1  # one flipped bit, same size
    (folder / "weights.bin").write_bytes(bytes(data))
    assert not verified(folder)
    (folder / "weights.bin").write_bytes(b"x" * 999)  # truncated
    assert not verified(folder)
    for shape in ("[]", '{"files": {"config.json": 5}}', '{"files": []}'):  # JSON, but not a manifest
        (folder / "manifest.json").write_text(shape)
        assert not verified(folder)
    (folder / "manifest.json").unlink()
    assert not verified(folder)


def test_an_unwritable_cache_is_one_clear_error(tmp_path):
    from speculate import SpeculateError

    (tmp_path / "file").write_text("a file, not a folder")
    with pytest.raises(SpeculateError, match="SPECULATE_CACHE"):
        with building(tmp_path / "file" / "models" / "m"):
            pass


def test_failed_build_leaves_nothing_and_keeps_the_old_folder(tmp_path):
    folder = tmp_path / "m"
    with building(folder) as tmp:
        (tmp / "a").write_text("old")
    with pytest.raises(RuntimeError):
        with building(folder) as tmp:
            (tmp / "a").write_text("half-written")
            raise RuntimeError("conversion crashed")
    assert (folder / "a").read_text() == "old" and verified(folder)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temporary folder left behind
    with building(folder) as tmp:  # a rebuild replaces the old folder whole
        (tmp / "b").write_text("new")
    assert sorted(p.name for p in folder.iterdir()) == ["b", "manifest.json"] and verified(folder)


def assert_incremental_equals_full(tokenizer, ids):
    """At every step the incremental text is the full decode (up to a held-back partial character)."""
    d = Detokenizer(tokenizer)
    pieces = []
    for i, t in enumerate(ids):
        pieces.append(d.add(t))
        full = tokenizer.decode(ids[: i + 1], skip_special_tokens=True)
        assert d.text == full, (i, d.text[-20:], full[-20:])
    pieces.append(d.flush())
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)


def test_incremental_decoding_equals_decoding_everything(tok):
    text = "naïve café — 東京 😀 spaces   and\ttabs\n" * 3
    assert_incremental_equals_full(tok, tok(text)["input_ids"])
    # Random bytes: incomplete UTF-8 sequences everywhere.
    import random

    rng = random.Random(0)
    assert_incremental_equals_full(tok, [rng.randrange(3, len(tok)) for _ in range(300)])


def test_atomic_writes_get_ordinary_permissions_and_leave_nothing_on_failure(tmp_path):
    """Files and cache folders get what a plain open()/mkdir() would (temporary files are 0600, folders
    0700 while they are written); a failed write leaves neither the file nor its temporary."""
    from speculate.models.cache import _UMASK, atomic_path, atomic_write_text

    atomic_write_text(tmp_path / "a.txt", "x")
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o666 & ~_UMASK
    with pytest.raises(RuntimeError):
        with atomic_path(tmp_path / "b.bin") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("interrupted")
    assert not (tmp_path / "b.bin").exists() and not list(tmp_path.glob(".*"))
    with building(tmp_path / "m") as tmp:
        (tmp / "f").write_text("1")
    assert (tmp_path / "m").stat().st_mode & 0o777 == 0o777 & ~_UMASK


def test_a_build_removes_what_dead_builds_left(tmp_path):
    """A build killed mid-way (or abandoned at exit in a daemon thread) leaves its temporary folders; the next
    build of that folder removes them once nothing was written in them for an hour — but not a live process's,
    a recent one's (a process of another PID namespace looks dead), another host's (a shared cache), nor
    names that are not its own."""
    import os
    import socket
    import subprocess
    import sys
    import time

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    host = socket.gethostname()
    folder = tmp_path / "m"
    left = [tmp_path / f".m.{host}.{dead}.abc", tmp_path / f".m.{host}.{dead}.old.def",
            tmp_path / f".m.{host}.{dead}.gguf.ghi"]
    kept = [tmp_path / f".m.{host}.1.xyz", tmp_path / f".m.another-host.{dead}.xyz", tmp_path / f".mm.{host}.{dead}.x",
            tmp_path / f".m.{host}.{dead}.9.x", tmp_path / f".m.{host}.99999999999.x"]
    recent = tmp_path / f".m.{host}.{dead}.new"
    hours_ago = time.time() - 2 * 3600
    for d in left + kept + [recent]:
        d.mkdir()
        (d / "part").write_bytes(b"x")
        if d is not recent:
            os.utime(d / "part", (hours_ago, hours_ago))
            os.utime(d, (hours_ago, hours_ago))
    with building(folder) as tmp:
        (tmp / "a.txt").write_text("a")
    assert verified(folder) and not any(d.exists() for d in left) and all(d.exists() for d in kept + [recent])


@pytest.mark.parametrize("enabled", [True, False])
def test_a_conversion_shows_one_progress_bar_and_restores_the_setting(tmp_path, monkeypatch, capsys, enabled):
    """The GGUF conversion (gguf._convert_gguf, here on a tiny model standing in for the GGUF reader's) turns
    transformers' progress bars off while it runs ("Loading weights", "Writing model shards": the GGUF reader's own
    bar is the only one), and gives them back as they were, also when it fails."""
    import transformers
    from transformers.utils import logging as hf_logging

    from speculate.models import gguf
    from speculate.models.tiny import tiny_model

    seen = []

    def model_from_gguf(*args, **kwargs):
        seen.append(hf_logging.is_progress_bar_enabled())
        return tiny_model()

    def tokenizer_from_gguf(*args, **kwargs):
        seen.append(hf_logging.is_progress_bar_enabled())
        return tiny_tokenizer()

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from_gguf)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer_from_gguf)
    before = hf_logging.is_progress_bar_enabled()
    try:
        (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
        gguf._convert_gguf(tmp_path / "model.gguf", tmp_path / "out")
        assert (tmp_path / "out" / "config.json").is_file()
        assert seen == [False, False] and "Writing model shards" not in capsys.readouterr().err
        assert hf_logging.is_progress_bar_enabled() is enabled

        def fails(*args, **kwargs):
            raise OSError("a damaged GGUF")

        monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fails)
        with pytest.raises(OSError):
            gguf._convert_gguf(tmp_path / "model.gguf", tmp_path / "out2")
        assert hf_logging.is_progress_bar_enabled() is enabled
    finally:
        (hf_logging.enable_progress_bar if before else hf_logging.disable_progress_bar)()
