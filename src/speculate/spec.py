"""One frozen, hashable settings object for speculative decoding, parsed and validated once.

A :class:`SpeculativeSpec` says which drafter (its canonical name and options), which verifier (a name, or None
for the default at the request's temperature: ``verifiers.default_name``) with its parameters, k (1..64 or
'auto') and, where a settings path carries it, the precision. Every settings path builds one, with the same
checks and so the same error text for the same mistake:

- ``speculate generate`` / ``serve`` flags: :meth:`SpeculativeSpec.from_cli`;
- an HTTP request's ``speculative`` object over the server's defaults: :meth:`SpeculativeSpec.from_request`;
- a bench method string or matrix entry, and a TOML table: :meth:`SpeculativeSpec.from_table`
  (``bench/methods.py`` reads both into it).

:class:`~speculate.engine.SpeculativeDecoder` takes a spec (never a name) and the loaded models, and builds its
drafter with :func:`build_drafter`. Drafter variants are options: a drafter's declared ``variants`` (``eagle`` /
``medusa``: ``tree``, default true, and ``lookup``, default false) are true/false options, and the variants' own
names (``eagle-chain``, ``medusa+lookup``, ``eagle-chain+lookup``, ...) are aliases that give the same spec
(:data:`VARIANTS`); the drafter registry (``drafters.get_drafter``) builds by those names
(:attr:`SpeculativeSpec.registry_name`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .policy.draft_length import MAX_K, parse_k
from . import drafters, verifiers
from .drafters import check_name, draft_model_error, get_drafter, option_value, parse_options, resolve
from .errors import SpeculateError
from .params import pairs
from .models import CHOICES
from .verifiers import check_auto, check_params, default_name


def _variants(drafter: str) -> tuple:
    """The variant options (drafters/base.py, ``Variant``) of drafter ``drafter`` (a canonical name); () for one
    without variants and for ``auto``."""
    return drafters.DRAFTERS[drafter].cls.variants if drafter in drafters.DRAFTERS else ()


def _takes(drafter: str, option: str) -> bool:
    """Whether ``drafter`` (a canonical name) declares ``option``."""
    known = drafters.DRAFTERS
    return drafter in known and any(param.name == option for param in known[drafter].cls.params)


def canonical_drafter(name: str, options=None) -> tuple[str, tuple]:
    """``(drafter, options)`` in canonical form: an alias name becomes its base with ``tree`` / ``lookup``
    options (defaults dropped), the other options typed and checked by ``drafters.parse_options`` against the
    drafter they select, sorted. SpeculateError for an unknown drafter or option."""
    check_name(name)
    given = pairs(options)
    base, variant = drafters.VARIANTS.get(name, (name, {}))
    variant = dict(variant)
    for option in _variants(name):
        if option.name in given:
            value = option_value(name, option, given.pop(option.name))
            if name != base and value != variant[option.name]:
                raise SpeculateError(f"drafter '{name}' is {base} with {option.name}="
                                     f"{str(variant[option.name]).lower()}; it cannot take "
                                     f"{option.name}={str(value).lower()}")
            variant[option.name] = value
    registry = drafters.DRAFTERS[name].cls.variant_name(**variant) if variant else name
    typed = parse_options(registry, given)
    typed.update({option.name: variant[option.name] for option in _variants(name)
                  if variant[option.name] != option.default})
    return base, tuple(sorted(typed.items()))


@dataclass(frozen=True)
class SpeculativeSpec:
    """The speculative settings, validated when made (``__post_init__``); equal settings are equal specs and
    hash alike (the server keeps decoders per spec). ``options`` and ``params`` are sorted (key, value) pairs;
    ``verifier`` None: ``greedy`` at temperature 0, else ``sample``. ``dtype``: the target's precision where the
    settings path carries one (None elsewhere)."""

    drafter: str = "auto"
    options: tuple = ()
    verifier: str | None = None
    params: tuple = ()
    k: int | str = 6
    dtype: str | None = None

    def __post_init__(self):
        drafter, options = canonical_drafter(self.drafter, self.options)
        object.__setattr__(self, "drafter", drafter)
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "k", parse_k(self.k))
        known = verifiers.VERIFIERS
        if self.verifier is not None and self.verifier not in known:
            raise SpeculateError(f"unknown verifier '{self.verifier}'; choose one of: {', '.join(known)}")
        params = {key: value for key, value in pairs(self.params).items() if value is not None}
        if self.verifier is not None:
            try:  # (without a verifier the parameters are checked against the default one, once it is known)
                params = check_params(self.verifier, params)
            except ValueError as e:
                raise SpeculateError(str(e)) from None
        else:
            unknown = sorted(set(params) - set(verifiers.PARAMS))
            if unknown:
                raise SpeculateError(f"no verifier takes {', '.join(unknown)}; the parameters are: "
                                     f"{', '.join(verifiers.PARAMS)}")
            try:  # ('auto' needs a verifier that declares it: none is named)
                check_auto(None, params)
            except ValueError as e:
                raise SpeculateError(str(e)) from None
        object.__setattr__(self, "params", tuple(sorted(params.items())))
        if self.dtype is not None:
            if self.dtype not in CHOICES:
                raise SpeculateError(f"unknown precision '{self.dtype}'; choose one of: {', '.join(CHOICES)}")

    # -- what it says -----------------------------------------------------------------------------------
    @property
    def registry_name(self) -> str:
        """The drafter's name in the registry (``drafters.get_drafter``): ``eagle-chain+lookup`` for ``eagle``
        with tree=false, lookup=true; the canonical name for the others."""
        if self.drafter not in drafters.DRAFTERS:  # (auto)
            return self.drafter
        return drafters.DRAFTERS[self.drafter].cls.variant_name(**dict(self.options))

    @property
    def drafter_options(self) -> dict:
        """The options the registry's drafter takes (the variant options are in :attr:`registry_name`)."""
        variant = {option.name for option in _variants(self.drafter)}
        return {key: value for key, value in self.options if key not in variant}

    @property
    def verifier_params(self) -> dict:
        return dict(self.params)

    @property
    def needs_draft_model(self) -> bool:
        return self.registry_name in drafters.MODEL_DRAFTERS

    def label(self) -> str:
        """``lookup/greedy k=6`` (the verifier as named; None shown as the default's rule)."""
        return f"{self.registry_name}/{self.verifier or 'default'} k={self.k}"

    # -- checks that need what a path knows besides the settings ---------------------------------------------
    def check_draft_model(self, available: bool, given_for_it: bool = False) -> SpeculativeSpec:
        """SpeculateError when the drafter needs a draft model and none is ``available``, or (``given_for_it``:
        a ``--draft-model`` flag given for this drafter) when one was given to a drafter that takes none."""
        if given_for_it and not self.needs_draft_model and self.drafter != "auto":
            raise SpeculateError(drafters.NEEDS_MODEL_DRAFTER)
        error = draft_model_error(self.registry_name, available) if self.needs_draft_model else None
        if error:
            raise SpeculateError(error)
        return self

    def resolved(self, target) -> SpeculativeSpec:
        """``auto`` replaced by the drafter it stands for on ``target`` (a LoadedModel or a model alias/folder);
        the options stay (auto takes the options of either drafter it may stand for)."""
        if self.drafter != "auto":
            return self
        return replace(self, drafter=resolve("auto", target))

    def scoped(self, scope: str) -> SpeculativeSpec:
        """The spec with its drafter's ``scope`` option set to ``scope`` where the drafter declares one (a drafter
        that keeps an index of served answers: ``suffix``), so that it reads and feeds that scope's index only;
        the spec itself for the others and for the empty scope. The server scopes a request by its API key."""
        if not scope or not _takes(self.drafter, "scope"):
            return self
        return replace(self, options={**dict(self.options), "scope": scope})

    def with_verifier(self, greedy: bool) -> SpeculativeSpec:
        """The verifier named: the given one, else the default at this temperature (``greedy`` at 0)."""
        return self if self.verifier is not None else replace(self, verifier=default_name(greedy))

    # -- constructors, one per settings path ---------------------------------------------------------------
    @classmethod
    def from_cli(cls, args) -> SpeculativeSpec:
        """``speculate generate`` / ``serve`` flags: --drafter (resolved for --model), --drafter-opt, --heads,
        --verifier and its parameters, --k, --dtype; --draft-model checked against the drafter."""
        options = pairs(getattr(args, "drafter_opt", None) or [])
        name = resolve(args.drafter, args.model)
        if getattr(args, "heads", None):
            heads = drafters.HEAD_DRAFTERS
            if name not in heads:
                raise SpeculateError(f"--heads is for the drafters with trained heads: {', '.join(heads)}")
            options["heads"] = args.heads
        params = {key: getattr(args, key, None) for key in verifiers.PARAMS}
        spec = cls(name, options, args.verifier, params, args.k, getattr(args, "dtype", None))
        given = bool(getattr(args, "draft_model", None))
        return spec.check_draft_model(given, given)

    @classmethod
    def from_request(cls, request, defaults: SpeculativeSpec, model=None) -> SpeculativeSpec:
        """A request's ``speculative`` object (a ``SpeculativeSettings`` or a dict; None: nothing) over the
        server's ``defaults``. A drafter named by the request gets its own defaults unless it is the server's own
        (the same drafter and variant: ``eagle-chain`` on a server started with ``eagle-chain``, or with ``eagle``
        and tree=false, keeps the server's options); a request that names another verifier than the server's does
        not inherit the server's verifier parameters (they were meant for another rule)."""
        if request is None:
            given: dict = {}
        elif isinstance(request, dict):
            given = {key: value for key, value in request.items() if value is not None}
        else:
            given = {key: value for key, value in request.model_dump().items() if value is not None}
        params = {key: given.pop(key) for key in list(given) if key in verifiers.PARAMS}
        verifier = given.pop("verifier", None)
        drafter = given.pop("drafter", None)
        k = given.pop("k", None)
        share = given.pop("share", None)
        if given:
            raise SpeculateError(f"unknown speculative settings: {', '.join(sorted(given))}")
        if verifier is None or verifier == defaults.verifier:
            params = {**defaults.verifier_params, **params}
        drafter_spec = (defaults.drafter, defaults.options)
        if drafter is not None:
            asked = cls(resolve(drafter, model))  # the named drafter with its own defaults
            if asked.registry_name != defaults.registry_name:
                drafter_spec = (asked.drafter, asked.options)
        if share is not None and _takes(drafter_spec[0], "share"):  # (a drafter that shares nothing ignores it)
            drafter_spec = (drafter_spec[0], {**dict(drafter_spec[1]), "share": share})
        return cls(*drafter_spec, verifier if verifier is not None else defaults.verifier, params,
                   k if k is not None else defaults.k, defaults.dtype)

    @classmethod
    def from_table(cls, table: dict, keys: tuple = (), params: tuple | None = None) -> SpeculativeSpec:
        """A table of settings — a TOML table, or a bench method string split into ``{key: text}``: ``drafter``,
        ``verifier``, ``k``, ``dtype``, the verifier parameters by name, and any other key a drafter option.
        Values may be text or typed. ``keys``: further keys the caller reads itself (left out here); ``params``:
        the verifier parameters this table may set (default all; bench methods: eps, beta, D)."""
        table = {key: value for key, value in table.items() if key not in keys}
        params = verifiers.PARAMS if params is None else params
        params = {key: table.pop(key) for key in list(table) if key in params}
        drafter, verifier = table.pop("drafter", "auto"), table.pop("verifier", None)
        k, dtype = table.pop("k", 6), table.pop("dtype", None)
        return cls(str(drafter).strip(), table, None if verifier is None else str(verifier).strip(), params, k,
                   dtype)


def build_drafter(spec: SpeculativeSpec, target, draft_model=None):
    """The drafter ``spec`` names, built for the loaded ``target``: ``auto`` resolved, the options given, and
    ``draft_model`` for the drafters that take one (not for the others, so that a server's draft model may sit
    beside a request's lookup). SpeculateError where the drafter needs a draft model and none is given."""
    spec = spec.resolved(target).check_draft_model(draft_model is not None)
    return get_drafter(spec.registry_name, draft_model if spec.needs_draft_model else None, target,
                       **spec.drafter_options)


def __getattr__(name: str):
    """``VARIANTS``: the drafters' variant names (``drafters.VARIANTS``), read when first asked for: importing this
    module (as ``import speculate`` does) must not discover the drafters and their plugins yet."""
    if name == "VARIANTS":
        return drafters.VARIANTS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MAX_K", "SpeculativeSpec", "build_drafter", "canonical_drafter", "parse_k"]
