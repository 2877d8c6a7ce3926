"""Drafters, one per module, behind :func:`get_drafter`."""

from __future__ import annotations

from functools import partial

from ..errors import SpeculateError
from .base import Draft, Drafter
from .lookup import LookupDrafter
from .model import ModelDrafter
from .model_tree import ModelTreeDrafter
from .none import NoDrafter

DRAFTERS = {"none": NoDrafter, "lookup": LookupDrafter, "model": ModelDrafter, "model-tree": ModelTreeDrafter}
MODEL_DRAFTERS = {"model": ModelDrafter, "model-tree": ModelTreeDrafter}  # the drafters with a draft model


def _self_drafters():
    """Drafters that draft from the target's own hidden states with trained heads (imported lazily)."""
    from .eagle import EagleDrafter
    from .layerskip import LayerSkipDrafter
    from .medusa import MedusaDrafter

    return {"medusa": partial(MedusaDrafter, tree=True), "medusa-chain": partial(MedusaDrafter, tree=False),
            "eagle": partial(EagleDrafter, tree=True), "eagle-chain": partial(EagleDrafter, tree=False),
            "layerskip": LayerSkipDrafter}


SELF_DRAFTERS = ("medusa", "medusa-chain", "eagle", "eagle-chain", "layerskip")
ALL_DRAFTERS = (*DRAFTERS, *SELF_DRAFTERS)  # every name get_drafter takes


def get_drafter(name: str, draft_model=None, target=None, **params) -> Drafter:
    """A drafter by name. ``model`` and ``model-tree`` need ``draft_model`` (a LoadedModel sharing the
    target's tokenizer); ``model-tree`` takes ``branch`` and ``spread`` (drafters/model_tree.py)."""
    if name in SELF_DRAFTERS:
        if draft_model is not None:
            raise SpeculateError(f"drafter '{name}' drafts with heads on the target itself; it takes no draft model")
        if target is None:
            raise SpeculateError(f"drafter '{name}' needs the target model")
        # drafts from the target itself: heads trained on its hidden states, or its own first layers
        return _self_drafters()[name](target, **params)
    if name not in DRAFTERS:
        raise SpeculateError(f"unknown drafter '{name}'; choose one of: {', '.join(ALL_DRAFTERS)}")
    if name in MODEL_DRAFTERS:
        if draft_model is None:
            raise SpeculateError(f"drafter '{name}' needs a draft model (--draft-model)")
        return MODEL_DRAFTERS[name](draft_model, target, **params)
    if draft_model is not None:
        raise SpeculateError(f"drafter '{name}' takes no draft model; use --drafter model or model-tree")
    return DRAFTERS[name](**params)


__all__ = ["ALL_DRAFTERS", "DRAFTERS", "MODEL_DRAFTERS", "SELF_DRAFTERS", "Draft", "Drafter", "get_drafter"]
