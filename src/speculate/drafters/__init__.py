"""Drafters, one per module, behind :func:`get_drafter`."""

from __future__ import annotations

from ..errors import SpeculateError
from .base import Draft, Drafter
from .lookup import LookupDrafter
from .model import ModelDrafter
from .none import NoDrafter

DRAFTERS = {"none": NoDrafter, "lookup": LookupDrafter, "model": ModelDrafter}


def get_drafter(name: str, draft_model=None, target=None, **params) -> Drafter:
    """A drafter by name. ``model`` needs ``draft_model`` (a LoadedModel sharing the target's tokenizer)."""
    if name not in DRAFTERS:
        raise SpeculateError(f"unknown drafter '{name}'; choose one of: {', '.join(DRAFTERS)}")
    if name == "model":
        if draft_model is None:
            raise SpeculateError("drafter 'model' needs a draft model (--draft-model)")
        return ModelDrafter(draft_model, target, **params)
    if draft_model is not None:
        raise SpeculateError(f"drafter '{name}' takes no draft model; use --drafter model")
    return DRAFTERS[name](**params)


__all__ = ["DRAFTERS", "Draft", "Drafter", "get_drafter"]
