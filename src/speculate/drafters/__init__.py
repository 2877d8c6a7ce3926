"""Drafters, one per module, behind :func:`get_drafter`."""

from __future__ import annotations

from ..errors import SpeculateError
from .base import Draft, Drafter
from .lookup import LookupDrafter
from .model import ModelDrafter
from .model_tree import ModelTreeDrafter
from .none import NoDrafter

DRAFTERS = {"none": NoDrafter, "lookup": LookupDrafter, "model": ModelDrafter, "model-tree": ModelTreeDrafter}
MODEL_DRAFTERS = {"model": ModelDrafter, "model-tree": ModelTreeDrafter}  # the drafters with a draft model


def get_drafter(name: str, draft_model=None, target=None, **params) -> Drafter:
    """A drafter by name. ``model`` and ``model-tree`` need ``draft_model`` (a LoadedModel sharing the
    target's tokenizer); ``model-tree`` takes ``branch`` and ``spread`` (drafters/model_tree.py)."""
    if name not in DRAFTERS:
        raise SpeculateError(f"unknown drafter '{name}'; choose one of: {', '.join(DRAFTERS)}")
    if name in MODEL_DRAFTERS:
        if draft_model is None:
            raise SpeculateError(f"drafter '{name}' needs a draft model (--draft-model)")
        return MODEL_DRAFTERS[name](draft_model, target, **params)
    if draft_model is not None:
        raise SpeculateError(f"drafter '{name}' takes no draft model; use --drafter model or model-tree")
    return DRAFTERS[name](**params)


__all__ = ["DRAFTERS", "MODEL_DRAFTERS", "Draft", "Drafter", "get_drafter"]
