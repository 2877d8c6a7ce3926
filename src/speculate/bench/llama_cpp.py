"""The ``llama_cpp`` baseline of ``speculate bench``: llama.cpp (through llama-cpp-python, an optional extra:
``pip install -e '.[llamacpp]'``) running the model alias's own GGUF file, greedy, on our prompt token ids.

Both read the same vocabulary, so llama.cpp is handed the ids our tokenizer made (the chat template included):
the two decode identical prompts. Each call starts from an empty KV cache (our ``plain`` keeps none across calls
either) and is timed whole, prompt processing included, like every other method.

On CPUs with AMX (Sapphire Rapids and later), llama.cpp's AMX matmul kernels (``ggml_backend_amx_mul_mat``,
used through the CPU backend's "extra buffer types") crashed the process with a segfault on the machine this was
written on; there the model is loaded with ``use_extra_bufts = False``, which also leaves out the CPU backend's
weight repacking, and every record of the method says so (:attr:`LlamaCpp.info`).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch

from ..errors import SpeculateError
from ..models.cache import atomic_path, cache_root
from ..models.cpu import cpu_flags
from ..models.gguf import assemble_gguf
from ..models.registry import ALIASES
from ..text import Detokenizer

INSTALL = ("pip install -e '.[llamacpp]' (llama-cpp-python compiles llama.cpp from source: "
           "~10-15 minutes on 2 cores)")
NOT_AN_ALIAS = "the baseline llama_cpp needs a model alias (it runs the alias's GGUF file)"
N_CTX = 4096  # the longest prompt of a bench run (GSM8K's 8 shots: ~1k tokens) and its new tokens


def gguf_path(alias: str, progress: bool = False) -> Path:
    """The alias's GGUF file as llama.cpp reads it: the installed file itself when it is one part; else its parts
    concatenated once into ``cache_root() / f"{alias}.gguf"`` (atomically, checked against the alias's sha256),
    reused while it has the right size."""
    if alias not in ALIASES:
        raise SpeculateError(NOT_AN_ALIAS)
    src = ALIASES[alias]
    parts = src.part_paths()
    if len(parts) == 1:
        return parts[0]
    path = cache_root() / f"{alias}.gguf"
    if path.is_file() and path.stat().st_size == src.size:
        return path
    with atomic_path(path) as tmp:
        assemble_gguf(src, parts, tmp, progress)
    return path


def require():
    """The ``llama_cpp`` package (llama-cpp-python), or a one-line error saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise SpeculateError(f"the baseline llama_cpp needs llama-cpp-python: {INSTALL}") from None
    return llama_cpp


def check_usable(model: str) -> None:
    """Refuse, before any model loads, a model that is no alias or a missing llama-cpp-python."""
    if model not in ALIASES:
        raise SpeculateError(NOT_AN_ALIAS)
    require()


def has_amx(flags: set[str] | None = None) -> bool:
    return "amx_int8" in (cpu_flags() if flags is None else flags)


@contextlib.contextmanager
def _no_extra_buffer_types(llama_cpp):
    """While constructing a ``Llama``: model parameters with ``use_extra_bufts = False``.

    ``Llama.__init__`` (llama-cpp-python 0.3.36) takes no argument for it: it builds its parameters from
    ``llama_model_default_params()`` (the ``llama_cpp.llama_cpp`` module's, which ``llama_cpp.llama`` calls
    through its module attribute, re-exported by the package) and hands them to the model loader within the same
    call, so the function is replaced for the duration of the call and restored afterwards."""
    modules = [m for m in (llama_cpp, getattr(llama_cpp, "llama_cpp", None),
                           getattr(getattr(llama_cpp, "llama", None), "llama_cpp", None)) if m is not None]
    originals = [(m, m.llama_model_default_params) for m in dict.fromkeys(modules)]
    default = originals[0][1]

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    try:
        for m, _ in originals:
            m.llama_model_default_params = params
        yield
    finally:
        for m, original in originals:
            m.llama_model_default_params = original


class LlamaCpp:
    """llama.cpp on ``target``'s alias: one ``Llama`` per run, greedy generation from prompt ids."""

    def __init__(self, target, n_ctx: int = N_CTX):
        check_usable(target.name)
        llama_cpp = require()
        path = gguf_path(target.name)
        threads = torch.get_num_threads()
        amx = has_amx()
        kw = dict(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                  verbose=False, seed=0)
        with _no_extra_buffer_types(llama_cpp) if amx else contextlib.nullcontext():
            self.llm = llama_cpp.Llama(**kw)
        self.tokenizer = target.tokenizer
        #: written into every record of the method (bench/runner.py, run_sample)
        self.info = {"version": getattr(llama_cpp, "__version__", "?"), "gguf": path.name, "threads": threads,
                     "n_ctx": n_ctx, "extra_buffer_types": not amx,
                     **({"note": "extra buffer types off: llama.cpp's AMX kernels crash on this CPU"} if amx else {})}

    def generate(self, ids: list[int], max_new_tokens: int, stops, eos) -> tuple[list[int], float, str]:
        """Greedy tokens after ``ids`` up to an EOS (included), a stop string or ``max_new_tokens``, the
        seconds of the whole call, and why it ended ("stop" or "length")."""
        if len(ids) + max_new_tokens > self.llm.n_ctx():
            raise SpeculateError(f"llama_cpp: {len(ids)} prompt tokens + {max_new_tokens} new exceed its context "
                                 f"of {self.llm.n_ctx()}")
        detok = Detokenizer(self.tokenizer, list(stops)) if stops else None
        out: list[int] = []
        finish = "length"
        start = time.perf_counter()
        self.llm.reset()  # no KV reuse across calls: the whole prompt is processed every time
        gen = self.llm.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        try:
            for token in gen:
                out.append(int(token))
                if token in eos:
                    finish = "stop"
                    break
                if detok is not None:
                    detok.add(int(token))
                    if detok.stopped:
                        finish = "stop"
                        break
                if len(out) >= max_new_tokens:
                    break
        finally:
            gen.close()
        return out, time.perf_counter() - start, finish
