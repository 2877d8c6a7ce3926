"""The compiled kernels (kernels/attention.c: the batch-invariant attention and rotary; blocks.c: q4's matmul;
decoder.c: a q4 model's layers in one call), built into one library once per machine and loaded with ctypes.

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
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from .cache import atomic_path, atomic_write_text, cache_root, sha256_file
from .cpu import cpu_flags, cpu_info

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = ("attention.c", "blocks.c", "decoder.c")  # one library: the decoder calls the other two
# No fast-math and no contraction: the source's operations, each rounded as written (fused multiply-adds are
# explicit fmaf). No trapping math / errno: lets conditional selects and fmaf vectorize; values are unchanged.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fno-math-errno",
         "-shared", "-fPIC"]
if platform.machine().lower() in ("x86_64", "amd64"):
    FLAGS.insert(2, "-mprefer-vector-width=512")  # where AVX-512 is there, use it (~20 % at 8 rows); x86-only flag
KEYS = 64  # the kernel's block of keys, and the paged cache's block of positions (models/paged.py)
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def release_openmp_threads() -> bool:
    """Give back this thread's OpenMP workers (OpenMP 5's ``omp_pause_resource_all``, soft: made again if this
    thread runs a parallel region later). Returns whether the runtime took it (False: no GNU OpenMP here).

    Why: GNU OpenMP keeps a team of workers for every thread that has run a parallel region (a torch op, one of
    these kernels), and once the process holds more threads in teams than it has cores, every team stops spinning
    between regions and sleeps: each region then waits for its workers to wake, and a decode step (~150 regions)
    ran 2x slower (docs/benchmarks.md, "One OpenMP team"). A thread that hands the forwards to another calls
    this: the server's starting thread (server/scheduler.py, ``Scheduler.start``)."""
    pause = _omp_pause()
    return pause is not None and pause(1) == 0  # 1: omp_pause_soft


@functools.cache
def _omp_pause():
    """libgomp's omp_pause_resource_all (the library torch loaded: the same soname), looked up once; None without."""
    try:
        return ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):
        return None


@functools.cache
def source_digest() -> str:
    """A short digest of the kernels' sources and of SPECULATE_KERNEL_FLAGS (another build's code paths: AVX2,
    scalar): what a measurement of their speed (a cached cost profile) was taken with, so that a new kernel, or the
    same one built for other instructions, is measured afresh."""
    flags = os.environ.get("SPECULATE_KERNEL_FLAGS", "").encode()
    return hashlib.sha256(b"".join((KERNELS / name).read_bytes() for name in SOURCES) + flags).hexdigest()[:12]


def _cpu() -> str:
    """What the compiled code depends on (-march=native): the CPU's model and flags."""
    info = cpu_info()
    return f"{info.get('model name', platform.processor())} {' '.join(sorted(cpu_flags(info)))}"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# name: (result type, argument types), as the C sources declare them.
SIGNATURES = {
    "speculate_attend": (_I, [_P, _P, _P, _I64, _I64, _P, _I, _I, _I, _I, _I, _F, _P, _I]),
    "speculate_rope_write": (None, [_P, _I, _I, _I, _I, _P, _P, _P, _P, _I64, _I64, _P]),
    "speculate_block_matmul": (_I, [_I, _P, _I64, _I64, _P, _I64, _P, _F, _I, _P, _P, _P, _I64, _I, _I]),
    "speculate_block_argmax": (_I, [_I, _P, _I64, _I64, _P, _I64, _P, _I, _P, _P, _I]),
    "speculate_block_group": (_I, []),
    "speculate_amx_enable": (_I, [_I]),
    "speculate_rms_rows": (None, [_P, _I64, _I64, _P, _F, _P]),
    "speculate_decoder": (_I, [_P, _I, _P, _I, _I, _I, _I, _I, _P, _P, _P, _I, _F, _F, _I]),
    "speculate_attention_many": (_I, [_P, _P, _P, _P, _I, _I, _I, _I, _I, _F, _P, _P, _I]),
}


def function(name: str):
    """A compiled kernel's function (SIGNATURES), or None where the library cannot be built (no compiler, a failed
    build: logged once; SPECULATE_NO_KERNEL set)."""
    if os.environ.get("SPECULATE_NO_KERNEL"):
        return None
    if _loaded:  # built (or failed) already: no lock (the batched forward looks a function up every layer)
        return _loaded.get(name)
    with _lock:
        if not _loaded:
            lib = library(SOURCES, extra=("-fopenmp",))
            found = {"lib": lib}
            for fname, (restype, argtypes) in SIGNATURES.items() if lib is not None else ():
                fn = getattr(lib, fname)
                fn.restype, fn.argtypes = restype, argtypes
                found[fname] = fn
            if lib is not None:  # the tile unit for many rows, where this machine runs it (kernels/blocks.c, AMX)
                found["amx"] = bool(lib.speculate_amx_enable(amx_refused()))
            _loaded.update(found)  # all at once: a lock-free reader never sees half of them
        return _loaded.get(name)


def amx_refused() -> int:
    """1 where SPECULATE_NO_AMX keeps the tile path off (speculate_amx_enable's argument), else 0."""
    return int(bool(os.environ.get("SPECULATE_NO_AMX")))


def amx_tiles() -> bool:
    """Whether this process runs Q8_0's many-row integer dots as AMX tiles (kernels/blocks.c, AMX): the CPU has
    AMX-INT8, the OS let this process use it, its self-test passed, and SPECULATE_NO_AMX is not set."""
    function("lib")  # (the library built and loaded once, its verdict with it)
    return bool(_loaded.get("amx"))


def load():
    """The attention kernel's function, or None (the caller then runs attention as integer sums in PyTorch)."""
    return function("speculate_attend")


class Linear(ctypes.Structure):
    """kernels/decoder.c's linear_t: a BlockLinear's parts (blocks.BlockLinear.struct)."""
    _fields_ = [("parts", ctypes.c_int), ("types", ctypes.c_int * 4), ("packed", ctypes.c_void_p * 4),
                ("rows", ctypes.c_int64 * 4), ("bias", ctypes.c_void_p), ("out", ctypes.c_int64),
                ("k", ctypes.c_int64), ("passes", ctypes.c_int)]


class Layer(ctypes.Structure):
    """kernels/decoder.c's layer_t."""
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("qkv", Linear), ("o", Linear),
                ("gate_up", Linear), ("down", Linear)]


class Segment(ctypes.Structure):
    """kernels/attention.c's segment_t: one generation's rows in a batched forward, and its cache's block table."""
    _fields_ = [("rows", ctypes.c_int), ("length", ctypes.c_int), ("start", ctypes.c_int64),
                ("blocks", ctypes.c_int64), ("allowed", ctypes.c_void_p), ("kb", ctypes.POINTER(ctypes.c_void_p)),
                ("vb", ctypes.POINTER(ctypes.c_void_p)), ("layer", ctypes.c_int64)]


def segments(parts) -> tuple[ctypes.Array, list]:
    """The segment_t array of a batched forward from (rows, length, start, allowed [rows, length] or None, the
    blocks' key pointers, their value pointers, floats per layer in a block) per generation (models/paged.py's
    layout); with the masks it points into (keep them alive for the call)."""
    out, masks = (Segment * len(parts))(), []
    for i, (rows, length, start, allowed, kb, vb, layer) in enumerate(parts):
        m = mask(allowed)
        masks.append(m)
        out[i] = Segment(rows, length, start, len(kb), None if m is None else m.data_ptr(), kb, vb, layer)
    return out, masks


def attention_many(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segs: ctypes.Array, layer: int,
                   heads: int, kv_heads: int, d: int, scaling: float) -> torch.Tensor:
    """One layer's rotary, cache writes and attention for every generation of a batched forward in one call
    (kernels/attention.c, speculate_attention_many): qkv [n, (heads + 2 kv) d] → [n, heads · d]."""
    n = qkv.shape[0]
    q, out = torch.empty(n, heads, d, dtype=torch.float32), torch.empty(n, heads * d, dtype=torch.float32)
    rc = function("speculate_attention_many")(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), ctypes.addressof(segs),
                                              len(segs), layer, heads, kv_heads, d, scaling, q.data_ptr(),
                                              out.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"attention kernel failed ({rc})")
    return out


def load_decoder():
    """kernels/decoder.c's speculate_decoder (a q4 model's layers in one call), or None."""
    return function("speculate_decoder")


def load_rope():
    """The rotary, cache-write and attention function of the batched forward, or None."""
    return function("speculate_attention_many")


def library(sources: tuple[str, ...], extra: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """kernels/``sources`` compiled into one library for this CPU (cached by sources, flags and CPU) and loaded;
    None where it cannot be (no compiler, a failed build: logged). ``extra``: more flags, dropped when the compiler
    refuses them (``-fopenmp`` where the compiler has no OpenMP: the code then runs on one thread)."""
    cc = _compiler()
    if cc is None:
        log.info("no C compiler: the kernels are not built")
        return None
    paths = [KERNELS / name for name in sources]
    text = b"".join(p.read_bytes() for p in paths)
    # SPECULATE_KERNEL_FLAGS: more flags after ours, e.g. -march=x86-64-v3 to build another CPU's code paths (AVX2,
    # or scalar with x86-64-v2) on this one: the tests run the kernels' exactness checks under them too.
    base = [*FLAGS, *os.environ.get("SPECULATE_KERNEL_FLAGS", "").split()]
    for flags in ([*base, *extra], base) if extra else (base,):
        key = hashlib.sha256(text + " ".join([cc, *flags, _cpu()]).encode()).hexdigest()[:16]
        built = cache_root() / "kernels" / f"kernels-{key}.so"
        digest = built.with_suffix(".sha256")  # the library's own sha256, written once it is in place
        if not _intact(built, digest):
            try:
                with atomic_path(built) as tmp:
                    subprocess.run([cc, *flags, "-o", str(tmp), *map(str, paths), "-lm"], check=True,
                                   capture_output=True, timeout=120)
                atomic_write_text(digest, sha256_file(built))
            except (OSError, subprocess.SubprocessError) as error:
                detail = (getattr(error, "stderr", b"") or b"").decode(errors="replace")[:300]
                log.warning("could not compile the kernels with %s (%s %s)", " ".join(flags), error, detail)
                continue
            # Builds of older sources (or another CPU on a shared home: rebuilt there in a second) are dropped, so
            # they do not pile up; a process that has one loaded keeps its mapping.
            for old in [*built.parent.glob("*.so"), *built.parent.glob("*.sha256")]:
                if old not in (built, digest):
                    old.unlink(missing_ok=True)
        try:
            return ctypes.CDLL(str(built))
        except OSError as error:
            log.warning("could not load %s (%s)", built, error)
    return None


def _intact(built: Path, digest: Path) -> bool:
    """Whether the cached library is the one that was built: its sha256 as recorded after the build. A truncated
    or zeroed file (a full disk, a copy cut short) would otherwise be mapped and crash the process with a bus
    error or a segmentation fault, with no message, at every start; a missing record (a build killed between
    the two writes) is a rebuild too."""
    try:
        recorded = digest.read_text().strip()
        if recorded == sha256_file(built):
            return True
    except OSError:  # no library or no record: built (again), quietly
        return False
    log.warning("the compiled kernels in %s do not match their recorded checksum: rebuilding them", built)
    return False


def mask(allowed: torch.Tensor | None) -> torch.Tensor | None:
    """The kernel's form of an [n, length] boolean mask: bytes, padded with zeros to its key blocks (made once
    per forward, used by every layer)."""
    if allowed is None:
        return None
    n, length = allowed.shape
    out = torch.zeros(n, -(-length // KEYS) * KEYS, dtype=torch.uint8)
    out[:, :length] = allowed
    return out


def pages(keys_t: torch.Tensor, values: torch.Tensor, order: list[int] | None = None):
    """One layer's contiguous keys_t [kv heads, d, capacity] and values [kv heads, capacity, d] (capacity a
    multiple of KEYS) as the kernel's blocks: (key blocks, value blocks, their key pointers, value pointers).
    ``order``: where each block goes in memory (a permutation; None: in order), to check that placement changes
    nothing."""
    kv, d, capacity = keys_t.shape
    nb = capacity // KEYS
    kb = keys_t.reshape(kv, d, nb, KEYS).permute(2, 0, 1, 3)  # [block, kv, d, KEYS]
    vb = values.reshape(kv, nb, KEYS, d).permute(1, 0, 2, 3)  # [block, kv, KEYS, d]
    order = list(range(nb)) if order is None else order
    k_mem, v_mem = torch.empty(nb, kv, d, KEYS), torch.empty(nb, kv, KEYS, d)
    k_mem[order], v_mem[order] = kb, vb  # block j lives at order[j]
    kp = (ctypes.c_void_p * nb)(*[k_mem[order[j]].data_ptr() for j in range(nb)])
    vp = (ctypes.c_void_p * nb)(*[v_mem[order[j]].data_ptr() for j in range(nb)])
    return k_mem, v_mem, kp, vp


def attend(fn, q: torch.Tensor, keys_t: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
           length: int, scaling: float, order: list[int] | None = None) -> torch.Tensor:
    """q [n, heads, d] over slots 0..length-1 of keys_t [kv heads, d, capacity] / values [kv heads, capacity, d]
    (one layer's keys and values, laid out in blocks as :func:`pages` does, in ``order``); ``mask``: :func:`mask`'s,
    or None (all slots). Returns [n, heads · d] fp32."""
    n, heads, d = q.shape
    q = q.contiguous()
    out = torch.empty(n, heads, d, dtype=torch.float32)
    k_mem, v_mem, kp, vp = pages(keys_t, values, order)
    rc = fn(q.data_ptr(), kp, vp, 0, len(kp), None if mask is None else mask.data_ptr(), n, heads, keys_t.shape[0],
            d, length, scaling, out.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"attention kernel failed ({rc}): capacity {keys_t.shape[2]}, length {length}")
    return out.view(n, heads * d)
