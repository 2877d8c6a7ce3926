"""Drafters, one per module, found and built by name here (:func:`get_drafter`).

A drafter is one module of this package, or of a plugin (``SPECULATE_PLUGINS``, speculate/plugins.py): a
:class:`Drafter` subclass with a ``name`` of its own and its declaration (drafters/base.py) — ``params`` (its options,
:class:`~speculate.params.Param`), ``needs`` (a draft model, the target), ``variants`` (true/false options with names
of their own: ``eagle-chain``), ``summary`` and ``rank`` for the help — built through ``Drafter.build``. From those
come every name a user may give (``--drafter``, a request's ``speculative.drafter``, a bench method), the options each
takes (``--drafter-opt``) and the checks of both, with no list of drafters kept anywhere else.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from ..errors import SpeculateError
from ..params import Param, pairs
from ..plugins import declared
from .base import DRAFT_MODEL, TARGET, Draft, Drafter


@dataclass(frozen=True)
class Entry:
    """One name :func:`get_drafter` takes: a drafter class, with the values of its variants that the name stands
    for (``eagle-chain+lookup``: EagleDrafter with tree=False, lookup=True)."""

    name: str
    cls: type[Drafter]
    variant: dict = field(default_factory=dict)

    @property
    def params(self) -> tuple[Param, ...]:
        return self.cls.options(**self.variant)

    def build(self, target, draft_model, options: dict) -> Drafter:
        """The drafter, every declared option at its default unless ``options`` gives it."""
        return self.cls.build(target, draft_model, **self.variant,
                              **{**{p.name: p.default for p in self.params}, **options})


def _entries(classes: list[type[Drafter]]) -> dict[str, Entry]:
    """Each name the drafter classes declare (a class's variants too), in listing order (``rank``, then name)."""
    out: dict[str, Entry] = {}
    for cls in sorted(classes, key=lambda c: (c.rank, c.name)):
        for values in cls.variant_values():
            name = cls.variant_name(**values)
            if name in out:
                raise TypeError(f"two drafters are called {name!r}: {out[name].cls} and {cls}")
            out[name] = Entry(name, cls, values)
    return out


@functools.cache
def registry() -> dict[str, Entry]:
    """Every name get_drafter takes but ``auto`` → its Entry, in listing order. Read at its first use, not at import:
    a plugin module imports speculate's classes while speculate may be importing it, and only a module imported
    whole declares its drafters."""
    return _entries(declared(__name__, __path__, Drafter))


def drafter_classes() -> list[type[Drafter]]:
    """Each drafter class once (its variants share it), in listing order."""
    return list(dict.fromkeys(entry.cls for entry in registry().values()))


def model_drafters() -> tuple[str, ...]:
    """The names of the drafters that need a draft model."""
    return tuple(name for name, entry in registry().items() if DRAFT_MODEL in entry.cls.needs)


# The registry's names, each computed from it when read (module __getattr__), so that none is read before it is built.
_NAMES = {
    "DRAFTERS": registry,
    # ``auto``: the fastest drafter that needs nothing more from the user (:func:`resolve`).
    "ALL_DRAFTERS": lambda: ("auto", *registry()),  # every name get_drafter takes
    "MODEL_DRAFTERS": model_drafters,
    "HEAD_DRAFTERS": lambda: tuple(name for name, entry in registry().items()
                                   if any(p.name == "heads" for p in entry.params)),
    "NEEDS_MODEL_DRAFTER": lambda: "--draft-model needs --drafter " + ", ".join(model_drafters()),  # CLI's, server's
    # A variant's name → (its drafter's own name, the variant's values): ``eagle-chain`` → ("eagle", {"tree": False,
    # "lookup": False}).
    "VARIANTS": lambda: {name: (entry.cls.name, entry.variant) for name, entry in registry().items() if entry.variant},
}


def __getattr__(name: str):
    if name in _NAMES:
        return _NAMES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# What ``auto`` picks (:func:`resolve`), for the help: the two names are auto's measured choice, not a declaration.
AUTO_PICKS = ("retrieval where an answer store ships for the model (prompt lookup, then its own past answers), "
              "else lookup")


def resolve(name: str, target=None) -> str:
    """``auto`` → ``retrieval`` where an answer store ships for the target (a LoadedModel or its alias; the
    default model: 1.25-1.67× plain int8 decoding against lookup's 1.21-1.35×, docs/benchmarks.md, "Retrieval"), else
    ``lookup``; any other name is itself. Resolved before options are parsed, so that ``--drafter-opt``
    reaches the drafter ``auto`` stands for."""
    if name != "auto":
        return name
    from .answer_store import shipped_store

    return "retrieval" if target is not None and shipped_store(target) is not None else "lookup"


def option_value(name: str, param: Param, value):
    """``value`` (or its text) as drafter ``name``'s option ``param`` wants it; SpeculateError saying what it wants."""
    try:
        return param.convert(value)
    except ValueError:
        raise SpeculateError(f"drafter '{name}': option {param.name} wants {param.kind_text}, got {value!r}") from None


def parse_options(name: str, items) -> dict:
    """``KEY=VALUE`` strings (or a {key: value} dict) → the typed options of drafter ``name``; anything it
    does not take, or a value of the wrong type, is a SpeculateError naming what it takes."""
    takes = {p.name: p for p in registry()[name].params} if name in registry() else {}
    out = {}
    for key, value in pairs(items).items():
        if key not in takes:
            accepted = ", ".join(takes) or "no options"
            raise SpeculateError(f"drafter '{name}' has no option '{key}' (it takes: {accepted})")
        out[key] = option_value(name, takes[key], value)
    return out


def check_name(name: str) -> str:
    """``name`` if it is a drafter (or an alias get_drafter takes), else a SpeculateError naming the choices."""
    if name != "auto" and name not in registry():
        raise SpeculateError(f"unknown drafter '{name}'; choose one of: {', '.join(('auto', *registry()))}")
    return name


def draft_model_error(name: str, has_draft_model: bool) -> str | None:
    """Why drafter ``name`` cannot run with (or without) a draft model, or None: the one check of the drafters'
    need for a draft model, whichever settings path asks (``SpeculativeSpec.check_draft_model`` too)."""
    needs = name in model_drafters()
    if needs and not has_draft_model:
        return f"drafter '{name}' needs {DRAFT_MODEL} (--draft-model)"
    if has_draft_model and not needs:
        return f"drafter '{name}' takes no draft model; use --drafter {', '.join(model_drafters())}"
    return None


def get_drafter(name: str, draft_model=None, target=None, **options) -> Drafter:
    """A drafter by name (``auto`` resolved for ``target``), with ``options`` (typed; the declared defaults for the
    others). ``draft_model``: a LoadedModel sharing the target's tokenizer, for the drafters that need one and for
    no other; ``target``: the LoadedModel, which the drafters that need it draft from (a draft model's drafters
    only compare tokenizers with it)."""
    name = check_name(resolve(name, target))
    error = draft_model_error(name, draft_model is not None)
    if error:
        raise SpeculateError(error)
    entry = registry()[name]
    if TARGET in entry.cls.needs and target is None:
        raise SpeculateError(f"drafter '{name}' needs {TARGET}")
    return entry.build(target, draft_model, options)


__all__ = ["ALL_DRAFTERS", "AUTO_PICKS", "DRAFTERS", "HEAD_DRAFTERS", "MODEL_DRAFTERS", "NEEDS_MODEL_DRAFTER",
           "VARIANTS", "Draft", "Drafter", "Entry", "check_name", "draft_model_error", "drafter_classes", "get_drafter",
           "model_drafters", "option_value", "parse_options", "registry", "resolve"]
