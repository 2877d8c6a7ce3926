"""Saving and loading draft heads: ``heads.safetensors`` (weights, and the FR-Spec vocabulary subset
as the tensor ``vocab`` when there is one) + ``config.json`` (kind, target model, sizes, training
metadata). Both are written atomically (a temporary file, then ``os.replace``), the weights first, so
a reader never pairs a new config with half-written weights. The target's LM head and embeddings are
never saved: the heads always use the target's own (frozen) ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeculateError
from ..models.cache import atomic_path, atomic_write_text
from ..models.loader import QUANTIZED
from ..models.quantize import weight_bytes
from ..params import Param
from .eagle import EagleHead
from .medusa import MedusaHeads

WEIGHTS, CONFIG = "heads.safetensors", "config.json"
KINDS = {"medusa": MedusaHeads, "eagle": EagleHead}
FORMAT = 1


def save_heads(folder: str | Path, heads: MedusaHeads | EagleHead, target: str, vocab_size: int | None = None,
               meta: dict | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``heads`` into ``folder`` (created if needed); ``target``: the target model's name,
    ``vocab_size``: its vocabulary size (checked at load), ``meta``: training metadata, ``dtype``:
    how the weights are stored (float16 halves the files; they load back into fp32 heads)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to(dtype).contiguous().clone() for name, t in heads.state_dict().items()
               if name != "vocab"}
    if heads.vocab is not None:
        tensors["vocab"] = heads.vocab.contiguous().clone()
    with atomic_path(folder / WEIGHTS) as tmp:
        save_file(tensors, str(tmp))
    config = {"format": FORMAT, **heads.config(), "target": target, "vocab_size": vocab_size,
              "weights_dtype": str(dtype).replace("torch.", ""), "training": meta or {}}
    atomic_write_text(folder / CONFIG, json.dumps(config, indent=1))
    return folder


def read_config(folder: str | Path) -> dict:
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise SpeculateError(f"no draft heads in {folder} (no {CONFIG})") from None
    except ValueError as e:
        raise SpeculateError(f"{folder / CONFIG} is not valid JSON: {e}") from None
    if config.get("kind") not in KINDS:
        raise SpeculateError(f"{folder / CONFIG}: unknown head kind {config.get('kind')!r}")
    return config


def load_heads(folder: str | Path, kind: str | None = None) -> tuple[MedusaHeads | EagleHead, dict]:
    """(heads in eval mode, config) from ``folder``; ``kind`` checks which kind is expected."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_config(folder)
    if kind is not None and config["kind"] != kind:
        raise SpeculateError(f"{folder} holds {config['kind']} heads, not {kind}")
    try:
        tensors = load_file(folder / WEIGHTS)
    except FileNotFoundError:
        raise SpeculateError(f"no draft heads in {folder} (no {WEIGHTS})") from None
    except Exception as e:  # a truncated or corrupted file
        raise SpeculateError(f"cannot read {folder / WEIGHTS}: {e}") from None
    vocab = tensors.get("vocab")
    heads = KINDS[config["kind"]].from_config(config, vocab)
    try:
        heads.load_state_dict(tensors, strict=True)
    except RuntimeError as e:
        raise SpeculateError(f"{folder / WEIGHTS} does not match its config: {str(e).splitlines()[0]}") from None
    heads.eval().requires_grad_(False)
    return heads, config


def shipped_folder(model_name: str, kind: str, marker: str = CONFIG):
    """The heads (or the answer store: ``kind`` "answers", ``marker`` its file) shipped with the package for
    ``model_name`` (an alias), or None."""
    from importlib.resources import files

    safe = model_name.replace("/", "_")
    path = files("speculate.heads").joinpath("shipped", safe, kind)
    return Path(str(path)) if path.joinpath(marker).is_file() else None


def check_target(config: dict, loaded, folder) -> None:
    """Refuse heads trained for another model size (a mismatched hidden size would only crash later)."""
    hidden = int(loaded.model.config.hidden_size)
    if int(config["hidden_size"]) != hidden:
        raise SpeculateError(f"the draft heads in {folder} were trained for {config.get('target')!r} "
                             f"(hidden size {config['hidden_size']}), not for {loaded.name} (hidden size {hidden})")
    vocab_size = int(loaded.model.get_output_embeddings().out_features)
    meta_v = config.get("vocab_size")
    if meta_v is not None and int(meta_v) != vocab_size:
        raise SpeculateError(f"the draft heads in {folder} were trained for a vocabulary of {meta_v} tokens; "
                             f"{loaded.name} has {vocab_size}")
    check_feature_layers(tuple(config.get("feature_layers", ())), loaded, f"the draft heads in {folder}")


def check_feature_layers(layers: tuple[int, ...], loaded, what: str) -> None:
    """Fused EAGLE heads read decoder layers 0..L−2 (the last layer's output is what the final norm
    reads, and Hugging Face reports it normed)."""
    n = int(loaded.model.config.num_hidden_layers)
    if any(not 0 <= i < n - 1 for i in layers):
        raise SpeculateError(f"{what}: feature layers {list(layers)} are not all among {loaded.name}'s decoder "
                             f"layers 0..{n - 2} (the last one is not tapped)")


def find_heads(loaded, kind: str, folder: str | Path | None = None):
    """(heads, config, folder) for the target ``loaded``: from ``folder``, or the ones shipped for it."""
    if folder is None:
        folder = shipped_folder(loaded.name, kind)
        if folder is None:
            raise SpeculateError(f"no {kind} heads ship for model '{loaded.name}'; train them with "
                                 f"`speculate train-heads --kind {kind} --model {loaded.name} --out DIR` and pass "
                                 f"the folder (--heads DIR)")
    heads, config = load_heads(folder, kind)
    check_target(config, loaded, folder)
    return heads, config, Path(folder)


@dataclass
class DraftingParts:
    """What a head drafter computes with, shared by every drafter of one target: the heads, the LM head
    over the drafting vocabulary as a module (on the fp32 model's feature scale), the feature scale
    (None for fp32/bf16: an int8 target's hidden rows are divided per channel by SmoothQuant's s at its
    final norm, models/quantize.py) and the bytes a target step reads (for the drafters' relative cost)."""

    heads: torch.nn.Module
    config: dict
    folder: Path
    lm: torch.nn.Module
    feature_scale: torch.Tensor | None
    target_bytes: int

    @property
    def vocab(self) -> torch.Tensor | None:
        return self.heads.vocab

    def features(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's final-normed hidden rows as the features the heads were trained on (fp32); tapped
        layer outputs after them (fused EAGLE heads) are residual-stream rows, which smoothing leaves as
        they are."""
        if self.feature_scale is None:
            return hidden.float()
        out = hidden.to(torch.float32, copy=True)  # one copy; the taps after the first H columns stay as they are
        out[..., : self.feature_scale.numel()] *= self.feature_scale
        return out

    def cost(self, *modules: torch.nn.Module) -> float:
        """What running ``modules`` once costs relative to a target step: the weights each reads."""
        return sum(weight_bytes(m) for m in modules) / self.target_bytes


# The head drafters' option (drafters/medusa.py, eagle.py) naming the folder drafting_parts reads.
HEADS = Param("heads", None, "a folder of trained heads (default: the ones shipped for the target; the CLI's --heads)",
              value_type=str)


def drafting_parts(loaded, kind: str, folder: str | Path | None = None) -> DraftingParts:
    """The heads of ``kind`` for ``loaded`` (from ``folder`` or the shipped ones), ready to draft: loaded,
    checked, and beside an int8 target quantized to int8 with their LM head (so that drafting a level
    costs a fraction of the fp32 weights' memory traffic). Built once per target model and folder, then
    shared: the heads hold no per-generation state, and the server builds a drafter per request."""
    from torch import nn

    from ..models.quantize import feature_scale, lm_head_weight, quantize_linears
    from .medusa import subset_weight

    built = loaded.__dict__.setdefault("_speculate_heads", {})
    where = Path(folder).resolve() if folder is not None else shipped_folder(loaded.name, kind)
    try:  # the weights file's identity too: heads saved again into the same folder are new heads
        stat = (where / WEIGHTS).stat()
        key = (kind, str(where), stat.st_mtime_ns, stat.st_size)
    except (OSError, TypeError):  # missing: find_heads says why
        key = None
    if key is None or key not in built:
        heads, config, where = find_heads(loaded, kind, folder)
        weight = subset_weight(lm_head_weight(loaded.model), heads.vocab)
        lm = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        lm.weight = nn.Parameter(weight, requires_grad=False)
        if getattr(loaded, "dtype", "fp32") in QUANTIZED:
            heads, lm = quantize_linears(heads), quantize_linears(lm)
        parts = DraftingParts(heads, config, where, lm, feature_scale(loaded.model), weight_bytes(loaded.model))
        if key is None:
            return parts
        built[key] = parts
    return built[key]
