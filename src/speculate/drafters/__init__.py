"""Drafters, one per module, behind :func:`get_drafter`."""

from __future__ import annotations

from functools import partial

from ..errors import SpeculateError
from .base import Draft, Drafter
from .lookup import LookupDrafter
from .model import ModelDrafter
from .model_lookup import ModelWithLookup
from .model_tree import ModelTreeDrafter
from .none import NoDrafter
from .retrieval import RetrievalDrafter

# The drafters with a draft model; ``model+lookup`` lets lookup draft the rounds it can copy (model_lookup.py).
MODEL_DRAFTERS = {"model": ModelDrafter, "model-tree": ModelTreeDrafter, "model+lookup": ModelWithLookup}
# ``retrieval`` also takes the target: it drafts from an n-gram table of the target's own answers (retrieval.py).
DRAFTERS = {"none": NoDrafter, "lookup": LookupDrafter, "retrieval": RetrievalDrafter, **MODEL_DRAFTERS}
NEEDS_MODEL_DRAFTER = "--draft-model needs --drafter " + ", ".join(MODEL_DRAFTERS)  # the CLI's and server's error


def _self_drafters():
    """Drafters that draft from the target's own hidden states with trained heads (imported lazily)."""
    from .eagle import EagleDrafter
    from .layerskip import LayerSkipDrafter
    from .medusa import MedusaDrafter

    # EAGLE chains stop where the head's top probability is below 0.35 (EagleDrafter.min_confidence): chosen
    # on the tuning prompts of `python -m speculate.bench.trees`, then faster on all six comparisons of the
    # benchmark's samples too (docs/benchmarks.md, "Confidence-gated chains"); min_confidence=0
    # turns it off.
    heads = {"medusa": partial(MedusaDrafter, tree=True), "medusa-chain": partial(MedusaDrafter, tree=False),
             "eagle": partial(EagleDrafter, tree=True), "eagle-chain": partial(EagleDrafter, tree=False,
                                                                              min_confidence=0.35)}
    # With lookup merged in (drafters/with_lookup.py), the heads draft no deeper than their fastest depth beside
    # lookup (docs/benchmarks.md, "The heads with prompt lookup merged in", `python -m speculate.bench.trees`: 2
    # for the EAGLE tree and chain; Medusa's tree is at most its 4 heads deep) and lookup's copies reach k.
    base_k = {"eagle": 2, "eagle-chain": 2, "medusa": None, "medusa-chain": 2}
    merged = {f"{name}+lookup": partial(_with_lookup, f"{name}+lookup", make, base_k[name])
              for name, make in heads.items()}
    return {**heads, **merged, "layerskip": LayerSkipDrafter}


_DEFAULT = object()  # base_k not given: the registry's depth (None is a value: no cap)


def _with_lookup(name, make_base, default_base_k, target, base_k=_DEFAULT, **params):
    from .with_lookup import WithLookup

    return WithLookup(make_base(target, **params), default_base_k if base_k is _DEFAULT else base_k, name=name)


SELF_DRAFTERS = ("medusa", "medusa-chain", "eagle", "eagle-chain", "layerskip",
                 "eagle+lookup", "eagle-chain+lookup", "medusa+lookup", "medusa-chain+lookup")
HEAD_DRAFTERS = tuple(name for name in SELF_DRAFTERS if name != "layerskip")  # the ones that take ``heads``
# ``auto``: the fastest drafter that needs nothing more from the user (:func:`resolve`).
ALL_DRAFTERS = ("auto", *DRAFTERS, *SELF_DRAFTERS)  # every name get_drafter takes


def resolve(name: str, target=None) -> str:
    """``auto`` → ``retrieval`` where an answer store ships for the target (a LoadedModel or its alias; the
    default model: 1.25-1.67× plain int8 decoding against lookup's 1.21-1.35×, docs/benchmarks.md, "Retrieval"), else
    ``lookup``; any other name is itself. Resolved before options are parsed, so that ``--drafter-opt``
    reaches the drafter ``auto`` stands for."""
    if name != "auto":
        return name
    from .answer_store import shipped_store

    return "retrieval" if target is not None and shipped_store(target) is not None else "lookup"


# The options each drafter takes by name from the command line (``--drafter-opt KEY=VALUE``) and in bench
# methods (``drafter=eagle+lookup,k=6,base_k=3``), with their types; the constructors document them.
# ``heads``: a folder of trained heads (the CLI's --heads), so that a bench run can compare two sets.
_EAGLE_OPTIONS = {"heads": str, "topk": int, "budget": int, "depth": int, "min_confidence": float}
OPTIONS: dict[str, dict[str, type]] = {
    "none": {}, "lookup": {"max_ngram": int, "min_ngram": int, "max_copy": int}, "model": {},
    "retrieval": {"store": str, "min_context": int, "min_share": float, "max_ngram": int, "min_ngram": int,
                  "max_copy": int},  # lookup's options too: auto may stand for either
    "model+lookup": {"min_match": int, "lookup_k": int, "max_copy": int},
    "model-tree": {"branch": int, "spread": int}, "medusa": {"heads": str}, "medusa-chain": {"heads": str},
    "eagle": _EAGLE_OPTIONS, "eagle-chain": {"heads": str, "min_confidence": float}, "layerskip": {"layers": int},
}
OPTIONS.update({f"{name}+lookup": {**OPTIONS[name], "base_k": int}
                for name in ("eagle", "eagle-chain", "medusa", "medusa-chain")})


def parse_options(name: str, items) -> dict:
    """``KEY=VALUE`` strings (or a {key: value} dict) → the typed options of drafter ``name``; anything it
    does not take, or a value of the wrong type, is a SpeculateError naming what it takes."""
    takes = OPTIONS.get(name, {})
    pairs = items.items() if isinstance(items, dict) else [item.partition("=")[::2] for item in items]
    out = {}
    for key, value in pairs:
        key = str(key).strip()
        if key not in takes:
            accepted = ", ".join(takes) or "no options"
            raise SpeculateError(f"drafter '{name}' has no option '{key}' (it takes: {accepted})")
        try:
            out[key] = takes[key](str(value).strip())
        except ValueError:
            kind = {int: "an integer", float: "a number"}.get(takes[key], takes[key].__name__)
            raise SpeculateError(f"drafter '{name}': option {key} wants {kind}, got {value!r}") from None
    return out


def check_name(name: str) -> str:
    """``name`` if it is a drafter (or an alias get_drafter takes), else a SpeculateError naming the choices."""
    if name not in ALL_DRAFTERS:
        raise SpeculateError(f"unknown drafter '{name}'; choose one of: {', '.join(ALL_DRAFTERS)}")
    return name


def draft_model_error(name: str, has_draft_model: bool) -> str | None:
    """Why drafter ``name`` cannot run with (or without) a draft model, or None: the one check of the drafters'
    need for a draft model, whichever settings path asks (``SpeculativeSpec.check_draft_model`` too)."""
    if name in MODEL_DRAFTERS and not has_draft_model:
        return f"drafter '{name}' needs a draft model (--draft-model)"
    if name not in MODEL_DRAFTERS and has_draft_model:
        if name in SELF_DRAFTERS:
            return f"drafter '{name}' drafts with heads on the target itself; it takes no draft model"
        return f"drafter '{name}' takes no draft model; use --drafter {', '.join(MODEL_DRAFTERS)}"
    return None


def get_drafter(name: str, draft_model=None, target=None, **params) -> Drafter:
    """A drafter by name. ``model``, ``model-tree`` and ``model+lookup`` need ``draft_model`` (a
    LoadedModel sharing the target's tokenizer); ``model-tree`` takes ``branch`` and ``spread``
    (drafters/model_tree.py), ``model+lookup`` ``min_match`` and ``lookup_k`` (drafters/model_lookup.py)."""
    name = resolve(name, target)
    check_name(name)
    error = draft_model_error(name, draft_model is not None)
    if error:
        raise SpeculateError(error)
    if name in SELF_DRAFTERS:
        if target is None:
            raise SpeculateError(f"drafter '{name}' needs the target model")
        # drafts from the target itself: heads trained on its hidden states, or its own first layers
        return _self_drafters()[name](target, **params)
    if name in MODEL_DRAFTERS:
        return MODEL_DRAFTERS[name](draft_model, target, **params)
    if name == "retrieval":
        return RetrievalDrafter(target, **params)
    return DRAFTERS[name](**params)


__all__ = ["ALL_DRAFTERS", "DRAFTERS", "HEAD_DRAFTERS", "MODEL_DRAFTERS", "NEEDS_MODEL_DRAFTER", "OPTIONS", "SELF_DRAFTERS", "Draft", "Drafter",
           "check_name", "draft_model_error", "get_drafter", "parse_options", "resolve"]
