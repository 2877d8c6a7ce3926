"""The converted-model cache: folders written atomically, with a checksum manifest.

A model converted from GGUF (or quantized) is written once into ``$SPECULATE_CACHE/<key>/``
(default ``~/.cache/speculate``). The folder is built under a temporary name beside its final place
and renamed into it only when complete, and it carries ``manifest.json`` with the size and sha256 of
every file. :func:`verified` re-hashes on each load (~1 GB/s here: 0.5 s for the default model), so a
truncated or corrupted cache is detected and rebuilt, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from ..errors import SpeculateError

MANIFEST = "manifest.json"


def cache_root() -> Path:
    return Path(os.environ.get("SPECULATE_CACHE") or Path.home() / ".cache" / "speculate")


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def tensors_digest(tensors: dict) -> str:
    """sha256 of a set of tensors' names and bytes, in name order: what a conversion computed, independent of how
    it was serialized. (A safetensors file's own sha256 is not: its metadata is a hash map that safetensors writes
    in a random order each process, so one conversion saved twice gets one of several file digests.)"""
    import torch  # (this module otherwise needs no torch)

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(memoryview(tensors[name].contiguous().view(torch.uint8).numpy()))
    return h.hexdigest()


def write_manifest(folder: Path, extra: dict | None = None) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST
    }
    atomic_write_text(folder / MANIFEST, json.dumps({"files": files, **(extra or {})}, indent=1))


def verified(folder: Path) -> bool:
    """True when ``folder`` holds a complete manifest and every listed file matches it."""
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
        for name, meta in files.items():
            path = folder / name
            # Size first: a truncated file is caught without reading it.
            if not path.is_file() or path.stat().st_size != meta["size"] or sha256_file(path) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # missing, or not a manifest's shape
        return False
    return bool(files)


def make_folder(folder: Path, flag: str) -> None:
    """Create ``folder`` (and its parents) for the command-line option ``flag``, or one clear error."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpeculateError(f"{flag} {folder}: cannot create the folder ({e.strerror or e})") from None


def scratch_prefix(folder: Path, kind: str = "") -> str:
    """The name prefix of this host's and process's temporary folders beside ``folder`` (``kind``: "old.",
    "gguf." for the other scratch folders a build makes; :func:`_sweep` knows them)."""
    return f".{folder.name}.{socket.gethostname()}.{os.getpid()}.{kind}"


STALE_AFTER = 3600.0  # seconds without a write before a dead process's scratch folder is removed


def _sweep(folder: Path) -> None:
    """Remove the temporary folders that dead processes of this host left beside ``folder``: a build that was
    killed, or abandoned in a daemon thread at exit (Ctrl-C while `serve` loads), cannot clean up after itself.
    Only folders named by :func:`scratch_prefix` for this host, whose process does not exist here and in
    which nothing was written for an hour (a process of another PID namespace with the same host name, e.g. a
    container sharing the cache, looks dead from here); another host's, a live process's, are left alone."""
    name = re.compile(rf"{re.escape(f'.{folder.name}.{socket.gethostname()}.')}(\d{{1,9}})\.(?:old\.|gguf\.)?[^.]+", re.ASCII)
    now = time.time()
    for entry in folder.parent.iterdir():
        match = name.fullmatch(entry.name)
        if match is None or int(match[1]) == os.getpid():
            continue
        try:
            os.kill(int(match[1]), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):  # alive, another user's; or not a pid
            continue
        try:
            newest = max([entry.stat().st_mtime] + [p.stat().st_mtime for p in entry.rglob("*")])
        except OSError:
            continue
        if now - newest > STALE_AFTER:
            shutil.rmtree(entry, ignore_errors=True)


@contextmanager
def building(folder: Path):
    """Yield a temporary folder beside ``folder``; on success it becomes ``folder`` atomically
    (with its manifest), on any error it is removed. A stale or corrupted ``folder`` is replaced, and the
    temporary folders of dead earlier builds are removed (:func:`_sweep`)."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _sweep(folder)
        tmp = Path(tempfile.mkdtemp(prefix=scratch_prefix(folder), dir=folder.parent))
    except OSError as e:  # e.g. $SPECULATE_CACHE names a file or an unwritable place
        raise SpeculateError(f"cannot write the cache in {folder.parent} ({e.strerror or e}); set SPECULATE_CACHE "
                             f"to a writable folder") from None
    try:
        yield tmp
        write_manifest(tmp)
        os.chmod(tmp, 0o777 & ~_UMASK)
        if folder.exists():
            # rename() cannot replace a non-empty folder: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=scratch_prefix(folder, "old."), dir=folder.parent))
            os.replace(folder, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# The process's umask, read once at import (reading it means setting it): atomic writes give their files the
# permissions a plain open() would (mkstemp's own are 0600, mkdtemp's 0700).
_UMASK = os.umask(0o022)
os.umask(_UMASK)


@contextmanager
def atomic_path(path: Path):
    """Yield a temporary path beside ``path`` to write; on success it replaces ``path`` atomically (readers
    see the old file or the new, never a half), on any error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file atomically (:func:`atomic_path`), synced to disk first."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
