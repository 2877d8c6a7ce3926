"""Self-speculative decoding by early exit (the lesson's "self-speculative" variant; LayerSkip, Elhoushi
et al. 2024, without its training): the draft is the target's own first L layers, then its final norm and
LM head. No second model is loaded — the truncated model shares every weight with the target — and it
drafts like an independent draft model (drafters/model.py), with its own KV cache for those L layers.

Measured on the default model (docs/benchmarks.md, "The heads benchmark", "Layer skip"): without early-exit training
the first 15 of 30 SmolLM2 layers agree with the full model on 11-17 % of first drafts, a 2.3-3.0×
slowdown; untrained early exit is usually a slowdown. It is here to be measured, not recommended.
"""

from __future__ import annotations

import copy

import torch.nn as nn

from ..errors import SpeculateError
from ..models.loader import LoadedModel
from ..params import Param
from .base import TARGET
from .model import ModelDrafter


def early_exit_model(target: LoadedModel, layers: int) -> LoadedModel:
    """A view of ``target`` that runs only its first ``layers`` decoder layers (then the final norm and
    the LM head). Every parameter is the target's own tensor: no copy of any weight."""
    inner = target.model.model
    total = len(inner.layers)
    if not 1 <= layers < total:
        raise SpeculateError(f"layerskip: the draft must use 1..{total - 1} of the target's {total} layers, got {layers}")
    config = copy.deepcopy(target.model.config)
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    # Shallow copies with their own module tables: replacing the layer list must not touch the target.
    short_inner = copy.copy(inner)
    short_inner._modules = dict(inner._modules)
    short_inner.layers = nn.ModuleList(list(inner.layers[:layers]))
    short_inner.config = config
    short = copy.copy(target.model)
    short._modules = dict(target.model._modules)
    short.model = short_inner
    short.config = config
    return LoadedModel(short, target.tokenizer, f"{target.name}[:{layers}]", target.path, target.dtype)


class LayerSkipDrafter(ModelDrafter):
    """``layerskip``: draft with the target's first ``layers`` layers (default: half of them)."""

    name = "layerskip"
    summary = "the target's own first layers (early exit, untrained: usually a slowdown)"
    rank = 8
    needs = (TARGET,)
    params = (Param("layers", None, "the target's first layers the draft runs (default: half)", value_type=int),)

    def __init__(self, target: LoadedModel, layers: int | None = None):
        total = len(target.model.model.layers)
        super().__init__(early_exit_model(target, total // 2 if layers is None else layers))
