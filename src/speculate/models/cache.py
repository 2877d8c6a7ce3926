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
from contextlib import ExitStack, contextmanager
from pathlib import Path

from ..errors import STORAGE_ERRNOS, SpeculateError, StorageError

try:
    import fcntl
except ImportError:  # (Windows: no flock; scratch folders are then swept by their process and age)
    fcntl = None

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


STALE_AFTER = 3600.0  # seconds without a write before a dead process's unlocked scratch folder is removed
LOCK = ".lock"  # in a scratch folder: locked (flock) by the process writing it, for as long as it writes


def sweep(root: Path, name: str | None = None) -> None:
    """Remove the scratch folders that dead processes of this host left in ``root`` (``name``: only those beside
    ``root / name``): a build that was killed, or abandoned in a daemon thread at exit (Ctrl-C while `serve`
    loads), cannot clean up after itself, and a killed first conversion leaves ~0.5 GB. Only folders named by
    :func:`scratch_prefix` for this host. One with a :data:`LOCK` goes as soon as the lock is free (its writer is
    gone, whichever PID namespace it ran in); one without (a filesystem without flock, or the instant before the
    lock is taken) once its process does not exist here and nothing was written in it for an hour. Another host's
    (a shared cache), a live writer's, and names that are not scratch names are left alone."""
    who = re.escape(name) if name is not None else ".+"
    pattern = re.compile(rf"\.{who}\.{re.escape(socket.gethostname())}\.(\d{{1,9}})\.(?:old\.|gguf\.)?[^.]+", re.ASCII)
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return
    now = time.time()
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or int(match[1]) == os.getpid() or not entry.is_dir():
            continue
        free = _lock_is_free(entry / LOCK)
        if free is None:  # no lock to ask: the process, then the age
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
            free = now - newest > STALE_AFTER
        if free:
            shutil.rmtree(entry, ignore_errors=True)


def _lock_is_free(path: Path) -> bool | None:
    """True when nobody holds the lock file ``path``, False when a process does, None when there is none to ask."""
    if fcntl is None:
        return None
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (closing releases a lock taken here)


@contextmanager
def scratch(folder: Path, kind: str = ""):
    """A temporary folder beside ``folder`` (named by :func:`scratch_prefix`), locked (:data:`LOCK`) while this
    process writes it, so that :func:`sweep` can tell a dead writer's folder at once; removed on any error (a full
    disk: StorageError). On success it is the caller's, its lock file removed. Raises OSError where the folder
    cannot be made."""
    tmp = Path(tempfile.mkdtemp(prefix=scratch_prefix(folder, kind), dir=folder.parent))
    fd = None
    try:
        if fcntl is not None:
            fd = os.open(tmp / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        why = storage_fault(e)
        if why is None:
            raise
        # a full disk mid-build (a conversion, an assembled GGUF): one line, the scratch folder already gone
        raise StorageError(f"cannot write the cache in {folder.parent}: {why} (what was written is removed; free "
                           f"some space or set SPECULATE_CACHE)") from None
    finally:
        if fd is not None:
            (tmp / LOCK).unlink(missing_ok=True)
            os.close(fd)


@contextmanager
def building(folder: Path):
    """Yield a temporary folder beside ``folder``; on success it becomes ``folder`` atomically
    (with its manifest), on any error it is removed. A stale or corrupted ``folder`` is replaced, and the
    temporary folders of dead earlier builds are removed (:func:`sweep`)."""
    stack = ExitStack()  # (the scratch folder's own exit: removed on an error, unlocked either way)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        sweep(folder.parent, folder.name)
        tmp = stack.enter_context(scratch(folder))
    except OSError as e:  # e.g. $SPECULATE_CACHE names a file or an unwritable place
        raise StorageError(f"cannot write the cache in {folder.parent} ({e.strerror or e}); set SPECULATE_CACHE "
                           f"to a writable folder") from None
    with stack:
        yield tmp
        (tmp / LOCK).unlink(missing_ok=True)  # (not part of the folder: the manifest lists what is)
        write_manifest(tmp)
        os.chmod(tmp, 0o777 & ~_UMASK)
        if folder.exists():
            # rename() cannot replace a non-empty folder: move the old one aside first.
            old = Path(tempfile.mkdtemp(prefix=scratch_prefix(folder, "old."), dir=folder.parent))
            os.replace(folder, old / "x")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, folder)


def storage_fault(error: BaseException) -> str | None:
    """The storage's own fault behind ``error`` (a full disk, a read-only or over-quota filesystem), or None. Also
    where a library reports it in another type (safetensors' writer: its error's text carries the OS's message)."""
    if isinstance(error, OSError) and error.errno in STORAGE_ERRNOS:
        return error.strerror or os.strerror(error.errno)
    return next((os.strerror(n) for n in STORAGE_ERRNOS if os.strerror(n) in str(error)), None)


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
