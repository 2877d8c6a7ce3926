"""The methods a bench run compares, and the matrix (drafter × verifier × k × ε × β × D × temperature)
that expands into them.

A :class:`Method` is plain data (it is written into every result record). Families, as the Consultant
Decoding paper names them (Table 1): SD = speculative decoding with the lossless rule (``greedy`` at
temperature 0, ``sample`` above), MD = Mentored Decoding, CD = Consultant Decoding, TA = Medusa's
typical acceptance; ``plain`` is our engine with no drafts (the speedup baseline); ``hf_generate``,
``hf_assisted`` (``assistant_model=``) and ``hf_lookup`` (``prompt_lookup_num_tokens=``) are Hugging
Face's own, run on the same target in the same process.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, fields

from ..calc.auto import is_auto, parse_auto
from ..drafters import ALL_DRAFTERS, MODEL_DRAFTERS, parse_options
from ..errors import SpeculateError
from ..verifiers import VERIFIERS, get_verifier

BASELINES = ("plain", "hf_generate", "hf_assisted", "hf_lookup")
METHOD_KEYS = ("drafter", "verifier", "k", "temperature", "eps", "beta", "D")  # the rest: the drafter's options
FAMILY = {"greedy": "SD", "sample": "SD", "mentored": "MD", "consultant": "CD", "typical": "TA"}
MATRIX_PARAMS = ("eps", "beta", "D")  # the verifier parameters a method records and the matrix expands
#: Which of them each verifier takes, from the verifiers' own declarations (the others are not expanded for it);
#: a verifier's other parameters keep their defaults in a bench run.
VERIFIER_PARAMS = {name: tuple(p.name for p in cls.params if p.user and p.name in MATRIX_PARAMS)
                   for name, cls in VERIFIERS.items()}


@dataclass(frozen=True)
class Method:
    kind: str = "engine"  # "engine" or one of BASELINES
    drafter: str = "none"
    verifier: str | None = None
    k: int | str = 1  # an int or "auto"
    eps: float | str | None = None  # a number or "auto" (consultant)
    beta: float | None = None
    D: float | None = None
    temperature: float = 0.0
    options: tuple = ()  # the drafter's options (drafters.OPTIONS) as sorted (key, value) pairs, e.g. base_k=3

    @property
    def name(self) -> str:
        """A short unique label, e.g. ``CD/model k=4 eps=2 beta=0.2`` or ``plain``."""
        if self.kind != "engine":
            return self.kind
        family = FAMILY.get(self.verifier or "", self.verifier or "?")
        parts = [f"{family}/{self.drafter}", f"k={self.k}"]
        parts += [_pair(key, getattr(self, key)) for key in ("eps", "beta", "D") if getattr(self, key) is not None]
        if self.temperature:
            parts.append(f"T={self.temperature:g}")
        parts += [_pair(key, value) for key, value in self.options]
        return " ".join(parts)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def needs_draft_model(self) -> bool:
        return self.drafter in MODEL_DRAFTERS or self.kind == "hf_assisted"

    def to_dict(self) -> dict:
        return {"name": self.name, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict) -> Method:
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in d.items() if k in names}
        values["options"] = tuple(tuple(pair) for pair in values.get("options", ()))  # JSON gives lists
        return cls(**values)


def _pair(key: str, value) -> str:
    return f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"


def baseline(kind: str) -> Method:
    if kind not in BASELINES:
        raise SpeculateError(f"unknown baseline '{kind}'; choose from: {', '.join(BASELINES)}")
    return Method(kind=kind)


def engine_method(drafter: str, verifier: str, k, temperature: float = 0.0, eps=None, beta=None, D=None,
                  options=None) -> Method:
    """One engine method, checked: names exist, k >= 1 or auto, the verifier fits the temperature, the
    drafter takes ``options`` ({key: value or its text})."""
    if drafter not in ALL_DRAFTERS or drafter == "none":
        raise SpeculateError(f"unknown drafter '{drafter}' for a speculative method; choose from: "
                             f"{', '.join(d for d in ALL_DRAFTERS if d != 'none')} (plain decoding is the baseline 'plain')")
    if verifier not in VERIFIERS:
        raise SpeculateError(f"unknown verifier '{verifier}'; choose from: {', '.join(VERIFIERS)}")
    if not is_auto(k) and (not isinstance(k, int) or k < 1):
        raise SpeculateError(f"k must be an integer >= 1 or 'auto', got {k!r}")
    if temperature < 0:
        raise SpeculateError(f"temperature must be >= 0, got {temperature}")
    if verifier == "greedy" and temperature > 0:
        raise SpeculateError("verifier 'greedy' needs temperature 0 (use 'sample' above 0)")
    if verifier == "sample" and temperature == 0:
        raise SpeculateError("verifier 'sample' needs temperature > 0 (at 0 it is 'greedy')")
    if is_auto(eps) and verifier != "consultant":
        raise SpeculateError("eps 'auto' is for the consultant verifier")
    takes = VERIFIER_PARAMS[verifier]
    params = {key: value for key, value in (("eps", eps), ("beta", beta), ("D", D)) if key in takes}
    try:  # the values' ranges now, not after the model has loaded and run.json is written
        get_verifier(verifier, **{key: value for key, value in params.items() if not is_auto(value)})
    except (ValueError, TypeError) as e:
        raise SpeculateError(f"method {drafter}/{verifier}: {e}") from None
    options = tuple(sorted(parse_options(drafter, options or {}).items()))
    return Method("engine", drafter, verifier, "auto" if is_auto(k) else k, temperature=float(temperature),
                  options=options, **params)


def expand_matrix(drafters, verifiers, ks, temperatures, eps=(None,), betas=(None,), Ds=(None,)) -> list[Method]:
    """The cartesian product, keeping only sensible combinations: a verifier gets only the parameters
    it takes (CD: eps × beta; MD: D; TA: eps), ``greedy`` only temperature 0 and ``sample`` only > 0."""
    out: list[Method] = []
    for drafter, verifier, k, t in itertools.product(drafters, verifiers, ks, temperatures):
        if (verifier == "greedy") != (t == 0) and verifier in ("greedy", "sample"):
            continue
        takes = VERIFIER_PARAMS.get(verifier, ())
        for e, b, d in itertools.product(eps if "eps" in takes else (None,), betas if "beta" in takes else (None,),
                                         Ds if "D" in takes else (None,)):
            if verifier == "typical" and is_auto(e):
                continue  # eps auto is an NLL threshold; typical's eps is a probability
            m = engine_method(drafter, verifier, k, t, e, b, d)
            if m not in out:
                out.append(m)
    return out


def parse_method(spec: str) -> Method:
    """``--method 'verifier=mentored,k=4,D=0.3,temperature=0.3'`` (drafter defaults to model), or a
    baseline name. Other keys are the drafter's options: ``drafter=eagle+lookup,k=6,base_k=3``."""
    spec = spec.strip()
    if spec in BASELINES:
        return baseline(spec)
    values: dict = {}
    options: dict = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise SpeculateError(f"--method {spec!r}: expected key=value pairs with keys {', '.join(METHOD_KEYS)} "
                                 f"and the drafter's options; or a baseline ({', '.join(BASELINES)})")
        (values if key in METHOD_KEYS else options)[key] = value.strip()
    try:
        return engine_method(
            values.get("drafter", "model"), values.get("verifier", "greedy"),
            parse_auto(values.get("k", "4"), int, "k"), float(values.get("temperature", 0)),
            parse_auto(values["eps"], float, "eps") if "eps" in values else None,
            float(values["beta"]) if "beta" in values else None,
            float(values["D"]) if "D" in values else None, options)
    except ValueError as e:
        keys = "" if "has no option" not in str(e) else "; the method's own keys are " + ", ".join(METHOD_KEYS)
        raise SpeculateError(f"--method {spec!r}: {e}{keys}") from None
