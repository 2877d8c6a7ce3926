"""Verification rules: given drafts and target rows, how many drafts to keep and which token comes next.

``get_verifier(name, **params)`` builds one by name; ``VERIFIERS`` maps names to classes, lossless
first: ``greedy`` (exact match with the target's argmax), ``sample`` (speculative sampling), then the
lossy ones — ``consultant`` (Consultant Decoding), ``loose`` (FLy's entropy gate), ``mentored``
(Mentored Decoding), ``typical`` (Medusa typical acceptance). Each module's docstring gives its rule.

A verifier is one module here: a :class:`Verifier` subclass with a ``name`` and its ``params``
(:class:`~speculate.verifiers.params.Param`), ``verify`` and, where the rule has one, ``verify_tree``.
The registry is read from the package's modules, so a new module's verifier becomes a ``--verifier``
choice, its parameters ``speculate generate`` flags and request fields (``PARAMS``), with no other edit.
"""

from __future__ import annotations

import importlib
import pkgutil

from .base import Verdict, Verifier
from .consultant import ConsultantVerifier
from .greedy import GreedyVerifier
from .mentored import MentoredVerifier, mentored_output_distribution
from .params import AUTO, Param, is_auto
from .sample import SampleVerifier
from .typical import TypicalVerifier


def _discover() -> dict[str, type[Verifier]]:
    """Every verifier class defined in this package's modules (one with its own ``name``), lossless
    first, then by name."""
    found: dict[str, type[Verifier]] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, Verifier) and obj is not Verifier
                    and obj.__module__ == module.__name__ and "name" in obj.__dict__):
                if found.get(obj.name, obj) is not obj:
                    raise TypeError(f"two verifiers are called {obj.name!r}: {found[obj.name]} and {obj}")
                found[obj.name] = obj
    return {cls.name: cls for cls in sorted(found.values(), key=lambda c: (not c.lossless, c.name))}


VERIFIERS: dict[str, type[Verifier]] = _discover()


def _user_params() -> dict[str, list[tuple[str, Param]]]:
    """Each user-settable parameter name with the verifiers that declare it, ``[(verifier, Param)]``.
    One name is one CLI flag and one request field, so its type must agree across verifiers."""
    out: dict[str, list[tuple[str, Param]]] = {}
    for cls in VERIFIERS.values():
        for param in cls.params:
            if param.user:
                out.setdefault(param.name, []).append((cls.name, param))
    for name, declared in out.items():
        kinds = {param.kind for _, param in declared}
        if len(kinds) > 1:
            raise TypeError(f"verifier parameter {name!r} has different types: "
                            + ", ".join(f"{v}: {p.kind.__name__}" for v, p in declared))
    return out


PARAMS: dict[str, list[tuple[str, Param]]] = _user_params()
"""The parameters a user sets (``speculate generate --NAME``, a request's ``speculative.NAME``)."""


def param_help(name: str) -> str:
    """What parameter ``name`` means for each verifier that takes it (a CLI flag's help, a field's
    description): ``consultant: an NLL threshold (> 0; default 2.0; ...); typical: ...``."""
    return "; ".join(f"{v}: {p.describe()}" for v, p in PARAMS[name])


def default_name(greedy: bool) -> str:
    """The verifier used when none is named: ``greedy`` at temperature 0, else the lossless ``sample``."""
    return "greedy" if greedy else "sample"


def verifier_for(name: str | None, greedy: bool) -> str:
    """The verifier that runs: ``name``, or the default at this temperature (:func:`default_name`). ValueError
    for ``greedy`` at a temperature above 0 (it would not sample)."""
    name = name or default_name(greedy)
    if name == "greedy" and not greedy:
        raise ValueError("verifier 'greedy' decodes deterministically: use temperature 0, or the lossless "
                         "verifier 'sample' to sample at temperature > 0")
    return name


def verifier_class(name: str) -> type[Verifier]:
    """The class registered as ``name``, or ValueError naming the choices."""
    cls = VERIFIERS.get(name)
    if cls is None:
        raise ValueError(f"unknown verifier {name!r}; choose one of: {', '.join(VERIFIERS)}")
    return cls


def check_auto(name: str | None, params: dict) -> None:
    """ValueError when a parameter is 'auto' but verifier ``name`` (None: none named) does not declare
    'auto' for it. The message names the verifiers that do."""
    declared = {p.name: p for p in VERIFIERS[name].params} if name in VERIFIERS else {}
    for key, value in params.items():
        if not is_auto(value) or (key in declared and declared[key].auto):
            continue
        takers = [(v, p) for v, p in PARAMS.get(key, []) if p.auto]
        if takers:  # (else the parameter's own check says it must be a number)
            meaning = "; ".join(f"{v}: {p.auto}" for v, p in takers)
            raise ValueError(f"{key} 'auto' ({meaning}) needs the verifier "
                             + " or ".join(f"'{v}'" for v, _ in takers))


def check_params(name: str, params: dict) -> dict:
    """The parameters of verifier ``name`` checked against its declaration, without building it:
    ``{name: value}`` with None values dropped (not given) and 'auto' kept where declared (the engine
    resolves it). ValueError for an unknown verifier, a parameter it does not take, or a bad value;
    the same text however the value arrived (Python, CLI flag, request field)."""
    cls = verifier_class(name)
    params = {key: value for key, value in params.items() if value is not None}
    check_auto(name, params)
    declared = {p.name: p for p in cls.params}
    unknown = sorted(set(params) - set(declared))
    if unknown:
        shown = [p.name for p in cls.params if p.user]  # (the others are set by the engine)
        takes = f"it takes: {', '.join(shown)}" if shown else "it takes no parameters"
        raise ValueError(f"verifier {name!r} does not take {', '.join(unknown)}; {takes}")
    return {key: declared[key].check(cls.name, value) for key, value in params.items()}


def get_verifier(name: str, **params) -> Verifier:
    """Build the verifier called ``name`` with ``params`` (checked by :func:`check_params`; parameters
    whose value is None are ignored, so a CLI can pass every option through). Raises ValueError."""
    return verifier_class(name)(**check_params(name, params))


def tree_rule_missing(verifier: Verifier) -> str:
    """Why ``verifier`` cannot verify a tree draft, and which verifiers can."""
    able = [name for name, cls in VERIFIERS.items() if cls.has_tree_rule()]
    return (f"verifier '{verifier.name}' has no tree rule: tree drafts (model-tree, medusa, eagle, the +lookup "
            f"merges) can be verified by {', '.join(able)}")


__all__ = [
    "AUTO",
    "PARAMS",
    "VERIFIERS",
    "ConsultantVerifier",
    "GreedyVerifier",
    "MentoredVerifier",
    "Param",
    "SampleVerifier",
    "TypicalVerifier",
    "Verdict",
    "Verifier",
    "check_auto",
    "check_params",
    "default_name",
    "get_verifier",
    "is_auto",
    "mentored_output_distribution",
    "param_help",
    "tree_rule_missing",
    "verifier_class",
    "verifier_for",
]
