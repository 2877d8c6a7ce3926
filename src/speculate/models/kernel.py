"""The batch-invariant attention kernel (kernels/attention.c), compiled once per machine and loaded with ctypes.

Why a compiled kernel: PyTorch's attention and matmuls promise nothing about the order of their sums, and
that order changes with the number of rows on some CPUs (models/exact_attention.py has the measurements);
written out in C, the order is fixed by the source. Why ctypes and the system C compiler rather than a
PyTorch extension: the file compiles in well under a second with ``cc`` alone (no PyTorch headers, no
ninja), and the call costs a few microseconds. Compiled for the running CPU (``-march=native``) without
floating-point contraction, so that vector and scalar code compute every element the same way.

Where no C compiler works, :func:`load` returns None and the caller uses the integer-sum formulation in
PyTorch ops (exact as well, ~1.4x slower a step).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from .cache import atomic_path, cache_root
from .loader import cpu_flags, cpu_info

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "attention.c"
# No fast-math and no contraction: the source's operations, each rounded as written (fused multiply-adds are
# explicit fmaf). No trapping math / errno: lets conditional selects and fmaf vectorize; values are unchanged.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fno-math-errno",
         "-shared", "-fPIC"]
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS.insert(2, "-mprefer-vector-width=512")  # where AVX-512 is there, use it (~20 % at 8 rows); x86-only flag
KEYS = 64  # the kernel's block of keys: cache capacities are multiples of it
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def _cpu() -> str:
    """What the compiled code depends on (-march=native): the CPU's model and flags."""
    info = cpu_info()
    return f"{info.get('model name', platform.processor())} {' '.join(sorted(cpu_flags(info)))}"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def load():
    """The attention kernel's function, or None where it cannot be built (no compiler, or a failed build; logged)."""
    with _lock:
        if "attend" not in _loaded:
            lib = library("attention.c", extra=("-fopenmp",))
            fn = None if lib is None else lib.speculate_attend
            if fn is not None:
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_float,
                               ctypes.c_void_p, ctypes.c_int]
            _loaded["attend"] = fn
            rope = None if lib is None else lib.speculate_rope_write
            if rope is not None:
                rope.restype = None
                rope.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_void_p]
            _loaded["rope"] = rope
        return _loaded["attend"]


class Linear(ctypes.Structure):
    """kernels/decoder.c's linear_t: a BlockLinear's parts (blocks.BlockLinear.struct)."""
    _fields_ = [("parts", ctypes.c_int), ("types", ctypes.c_int * 4), ("packed", ctypes.c_void_p * 4),
                ("rows", ctypes.c_int64 * 4), ("bias", ctypes.c_void_p), ("out", ctypes.c_int64),
                ("k", ctypes.c_int64)]


class Layer(ctypes.Structure):
    """kernels/decoder.c's layer_t."""
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("qkv", Linear), ("o", Linear),
                ("gate_up", Linear), ("down", Linear), ("kt", ctypes.c_void_p), ("v", ctypes.c_void_p)]


def load_decoder():
    """kernels/decoder.c's speculate_decoder (a q4 model's layers in one call), or None where it cannot be built."""
    with _lock:
        if "decoder" not in _loaded:
            lib = library("decoder.c", extra=("-fopenmp",), also=("blocks.c", "attention.c"))
            fn = None if lib is None else lib.speculate_decoder
            if fn is not None:
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_float,
                               ctypes.c_int]
            _loaded["decoder"] = fn
        return _loaded["decoder"]


def load_rope():
    """The rotary/cache-write function of the attention kernel (None where the kernel is not built)."""
    load()
    return _loaded.get("rope")


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor,
               start: int, heads: int) -> torch.Tensor:
    """Rotary embedding of qkv's q and k heads [n, (heads + 2 kv) d] with cos/sin [n, d], keys and values written at
    slots start.. of one layer's buffers (kernels/attention.c, speculate_rope_write); returns the queries
    [n, heads, d]. Needs :func:`load` to have built the kernel."""
    kv, d, capacity = keys_t.shape
    n = qkv.shape[0]
    q = torch.empty(n, heads, d, dtype=torch.float32)
    _loaded["rope"](qkv.data_ptr(), n, heads, kv, d, cos.data_ptr(), sin.data_ptr(), keys_t.data_ptr(),
                    values.data_ptr(), capacity, start, q.data_ptr())
    return q


def library(source: str, extra: tuple[str, ...] = (), also: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """kernels/``source`` compiled for this CPU (cached by source, flags and CPU) and loaded; None where it cannot
    be (no compiler, a failed build: logged). ``extra``: more flags, each tried and dropped when the compiler
    refuses it (``-fopenmp`` where the compiler has no OpenMP: the code then runs on one thread). ``also``: more
    sources compiled into the same library (the decoder calls the matmul and attention kernels)."""
    if os.environ.get("SPECULATE_NO_KERNEL"):
        return None
    cc = _compiler()
    if cc is None:
        log.info("no C compiler: %s is not built", source)
        return None
    path = SOURCE.with_name(source)
    sources = [path, *(SOURCE.with_name(name) for name in also)]
    text = b"".join(p.read_bytes() for p in sources)
    stem = path.stem
    # SPECULATE_KERNEL_FLAGS: more flags after ours, e.g. -march=x86-64-v3 to build another CPU's code paths (AVX2,
    # or scalar with x86-64-v2) on this one: the tests run the kernels' exactness checks under them too.
    base = [*FLAGS, *os.environ.get("SPECULATE_KERNEL_FLAGS", "").split()]
    for flags in ([*base, *extra], base) if extra else (base,):
        key = hashlib.sha256(text + " ".join([cc, *flags, _cpu()]).encode()).hexdigest()[:16]
        built = cache_root() / "kernels" / f"{stem}-{key}.so"
        if not built.is_file():
            try:
                with atomic_path(built) as tmp:
                    subprocess.run([cc, *flags, "-o", str(tmp), *map(str, sources), "-lm"], check=True,
                                   capture_output=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as error:
                detail = (getattr(error, "stderr", b"") or b"").decode(errors="replace")[:300]
                log.warning("could not compile %s with %s (%s %s)", source, " ".join(flags), error, detail)
                continue
            # Builds of an older source (or another CPU on a shared home: rebuilt there in a second) are dropped,
            # so they do not pile up; a process that has one loaded keeps its mapping.
            for old in built.parent.glob(f"{stem}-*.so"):
                if old != built:
                    old.unlink(missing_ok=True)
        try:
            return ctypes.CDLL(str(built))
        except OSError as error:
            log.warning("could not load %s (%s)", built, error)
    return None


def mask(allowed: torch.Tensor | None) -> torch.Tensor | None:
    """The kernel's form of an [n, length] boolean mask: bytes, padded with zeros to its key blocks (made once
    per forward, used by every layer)."""
    if allowed is None:
        return None
    n, length = allowed.shape
    out = torch.zeros(n, -(-length // KEYS) * KEYS, dtype=torch.uint8)
    out[:, :length] = allowed
    return out


def attend(fn, q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           length: int, scaling: float) -> torch.Tensor:
    """q [n, heads, d] over slots 0..length-1 of keys_t [kv heads, d, capacity] / values [kv heads, capacity, d]
    (one layer's buffers, contiguous); ``mask``: :func:`mask`'s, or None (all slots). Returns [n, heads · d] fp32."""
    n, heads, d = q.shape
    q = q.contiguous()
    out = torch.empty(n, heads, d, dtype=torch.float32)
    rc = fn(q.data_ptr(), keys_t.data_ptr(), values.data_ptr(), keys_t.shape[2],
            None if mask is None else mask.data_ptr(), n, heads, keys_t.shape[0], d, length, scaling, out.data_ptr(),
            torch.get_num_threads())
    if rc:
        raise RuntimeError(f"attention kernel failed ({rc}): capacity {keys_t.shape[2]}, length {length}")
    return out.view(n, heads * d)
