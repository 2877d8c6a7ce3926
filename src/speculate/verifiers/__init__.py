"""Verification rules: given drafts and target rows, how many drafts to keep and which token comes next.

``get_verifier(name, **params)`` builds one by name; ``VERIFIERS`` maps names to classes, lossless
first: ``greedy`` (exact match with the target's argmax), ``sample`` (speculative sampling), then the
lossy ones — ``consultant`` (Consultant Decoding), ``loose`` (FLy's entropy gate), ``mentored``
(Mentored Decoding), ``typical`` (Medusa typical acceptance). Each module's docstring gives its rule.

A verifier is one module here: a :class:`Verifier` subclass with a ``name`` and its ``params``
(:class:`~speculate.params.Param`), ``verify`` and, where the rule has one, ``verify_tree``.
The registry is read from the package's modules and the plugins' (``SPECULATE_PLUGINS``, speculate/plugins.py), so
a new module's verifier becomes a ``--verifier`` choice, its parameters ``speculate generate`` flags and request
fields (``PARAMS``), with no other edit.
"""

from __future__ import annotations

import functools

from ..params import AUTO, Param, is_auto
from ..plugins import declared
from .base import Verdict, Verifier
from .consultant import ConsultantVerifier
from .greedy import GreedyVerifier
from .mentored import MentoredVerifier, mentored_output_distribution
from .sample import SampleVerifier
from .typical import TypicalVerifier


@functools.cache
def registry() -> dict[str, type[Verifier]]:
    """Every verifier class defined in this package's modules and the plugins' (speculate/plugins.py: one with its
    own ``name``), lossless first, then by name. Read at its first use, not at import: a plugin module imports
    speculate's classes while speculate may be importing it, and only a module imported whole declares its verifiers."""
    found: dict[str, type[Verifier]] = {}
    for cls in declared(__name__, __path__, Verifier):
        if found.get(cls.name, cls) is not cls:
            raise TypeError(f"two verifiers are called {cls.name!r}: {found[cls.name]} and {cls}")
        found[cls.name] = cls
    return {cls.name: cls for cls in sorted(found.values(), key=lambda c: (not c.lossless, c.name))}


@functools.cache
def user_params() -> dict[str, list[tuple[str, Param]]]:
    """Each user-settable parameter name with the verifiers that declare it, ``[(verifier, Param)]``: the parameters
    a user sets (``speculate generate --NAME``, a request's ``speculative.NAME``). One name is one CLI flag and one
    request field, so its type must agree across verifiers."""
    out: dict[str, list[tuple[str, Param]]] = {}
    for cls in registry().values():
        for param in cls.params:
            if param.user:
                out.setdefault(param.name, []).append((cls.name, param))
    for name, takers in out.items():
        kinds = {param.kind for _, param in takers}
        if len(kinds) > 1:
            raise TypeError(f"verifier parameter {name!r} has different types: "
                            + ", ".join(f"{v}: {p.kind.__name__}" for v, p in takers))
    return out


def __getattr__(name: str):
    """``VERIFIERS`` (:func:`registry`) and ``PARAMS`` (:func:`user_params`), read when first asked for."""
    if name in ("VERIFIERS", "PARAMS"):
        return registry() if name == "VERIFIERS" else user_params()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def param_help(name: str) -> str:
    """What parameter ``name`` means for each verifier that takes it (a CLI flag's help, a field's
    description): ``consultant: an NLL threshold (> 0; default 2.0; ...); typical: ...``."""
    return "; ".join(f"{v}: {p.describe()}" for v, p in user_params()[name])


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
    cls = registry().get(name)
    if cls is None:
        raise ValueError(f"unknown verifier {name!r}; choose one of: {', '.join(registry())}")
    return cls


def check_auto(name: str | None, params: dict) -> None:
    """ValueError when a parameter is 'auto' but verifier ``name`` (None: none named) does not declare
    'auto' for it. The message names the verifiers that do."""
    declared = {p.name: p for p in registry()[name].params} if name in registry() else {}
    for key, value in params.items():
        if not is_auto(value) or (key in declared and declared[key].auto):
            continue
        takers = [(v, p) for v, p in user_params().get(key, []) if p.auto]
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


def tree_rule_missing(verifier: Verifier, drafter: str) -> str:
    """Why ``verifier`` cannot verify the tree drafts of drafter ``drafter``, and which verifiers can."""
    able = [name for name, cls in registry().items() if cls.has_tree_rule()]
    return (f"verifier '{verifier.name}' has no tree rule: drafter '{drafter}' drafts trees, which can be verified "
            f"by {', '.join(able)}")


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
    "registry",
    "tree_rule_missing",
    "user_params",
    "verifier_class",
    "verifier_for",
]
