"""The methods a bench run compares, and the matrix (drafter × verifier × k × ε × β × D × temperature)
that expands into them.

A :class:`Method` is plain data (it is written into every result record). Families, as the Consultant
Decoding paper names them (Table 1): SD = speculative decoding with the lossless rule (``greedy`` at
temperature 0, ``sample`` above), MD = Mentored Decoding, CD = Consultant Decoding, TA = Medusa's
typical acceptance; ``plain`` is our engine with no drafts (the speedup baseline); ``hf_generate``,
``hf_assisted`` (``assistant_model=``) and ``hf_lookup`` (``prompt_lookup_num_tokens=``) are Hugging
Face's own, run on the same target in the same process; ``llama_cpp`` is llama.cpp (llama-cpp-python, the
optional extra ``llamacpp``) greedy on the model alias's own GGUF file, fed the same prompt ids
(bench/llama_cpp.py).
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, fields

from ..policy.auto import is_auto
from ..errors import SpeculateError
from ..spec import SpeculativeSpec
from ..verifiers import VERIFIERS, verifier_for

BASELINES = ("plain", "hf_generate", "hf_assisted", "hf_lookup", "llama_cpp")
METHOD_KEYS = ("drafter", "verifier", "k", "temperature", "eps", "beta", "D", "argmax")  # the rest: the drafter's options
FAMILY = {"greedy": "SD", "sample": "SD", "mentored": "MD", "consultant": "CD", "typical": "TA"}
# The verifier parameters a method records (the matrix expands eps, beta and D; argmax is set per method).
MATRIX_PARAMS = ("eps", "beta", "D", "argmax")
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
    argmax: bool | None = None  # consultant's argmax clause (our extension); None: its default, the paper's rule
    temperature: float = 0.0
    options: tuple = ()  # the drafter's options (its declared params) as sorted (key, value) pairs, e.g. base_k=3

    @property
    def name(self) -> str:
        """A short unique label, e.g. ``CD/model k=4 eps=2 beta=0.2`` or ``plain``."""
        if self.kind != "engine":
            return self.kind
        family = FAMILY.get(self.verifier or "", self.verifier or "?")
        parts = [f"{family}/{self.drafter}", f"k={self.k}"]
        parts += [_pair(key, getattr(self, key)) for key in ("eps", "beta", "D") if getattr(self, key) is not None]
        if self.argmax:
            parts.append("+argmax")
        if self.temperature:
            parts.append(f"T={self.temperature:g}")
        parts += [_pair(key, value) for key, value in self.options]
        return " ".join(parts)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def spec(self) -> SpeculativeSpec:
        """An engine method's speculative settings (records keep the method's own fields, as written)."""
        params = {key: getattr(self, key) for key in MATRIX_PARAMS}
        return SpeculativeSpec(self.drafter, self.options, self.verifier, params, self.k)

    @property
    def needs_draft_model(self) -> bool:
        return self.kind == "hf_assisted" or (self.kind == "engine" and self.spec.needs_draft_model)

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
    """One engine method, checked by its :class:`SpeculativeSpec` (drafter and ``options`` — {key: value or its
    text} —, verifier and the parameters it takes of eps, beta, D, k), and the verifier against the temperature."""
    takes = VERIFIER_PARAMS.get(verifier, MATRIX_PARAMS)
    params = {key: value for key, value in (("eps", eps), ("beta", beta), ("D", D)) if key in takes}
    return _method(SpeculativeSpec(drafter, options or {}, verifier, params, k), drafter, options, temperature)


def _method(spec: SpeculativeSpec, drafter: str, options, temperature: float) -> Method:
    """The method of ``spec`` at ``temperature``, its drafter and options as written (so that its name, and
    the records' method, stay those of the name given: ``eagle-chain`` is not relabelled ``eagle tree=False``)."""
    if drafter == "none":
        raise SpeculateError("drafter 'none' is no speculative method: plain decoding is the baseline 'plain'")
    if temperature < 0:
        raise SpeculateError(f"temperature must be >= 0, got {temperature}")
    try:
        verifier_for(spec.verifier, temperature == 0)
    except ValueError as e:
        raise SpeculateError(str(e)) from None
    if spec.verifier == "sample" and temperature == 0:
        raise SpeculateError("verifier 'sample' needs temperature > 0 (at 0 it is 'greedy')")
    given = set(options or {})
    kept = {**spec.drafter_options, **{key: value for key, value in spec.options if key in given}}
    return Method("engine", drafter, spec.verifier, spec.k, temperature=float(temperature),
                  options=tuple(sorted(kept.items())), **dict(spec.params))


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


def parse_method(spec: str | dict) -> Method:
    """``--method 'verifier=mentored,k=4,D=0.3,temperature=0.3'`` (drafter defaults to model), a TOML table
    with the same keys (``{drafter = "eagle", tree = false, k = 2}``), or a baseline name. Other keys are the
    drafter's options: ``drafter=eagle+lookup,k=6,base_k=3``."""
    if isinstance(spec, dict):
        values = {str(key).strip(): value for key, value in spec.items()}
        shown = "{" + ", ".join(f"{key} = {value!r}" for key, value in values.items()) + "}"
    else:
        spec = spec.strip()
        if spec in BASELINES:
            return baseline(spec)
        values = {}
        shown = repr(spec)
        for item in filter(None, (s.strip() for s in spec.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise SpeculateError(f"--method {spec!r}: expected key=value pairs with keys "
                                     f"{', '.join(METHOD_KEYS)} and the drafter's options; or a baseline "
                                     f"({', '.join(BASELINES)})")
            values[key.strip()] = value.strip()
    try:
        values = {"drafter": "model", "verifier": "greedy", "k": 4, **values}
        takes = VERIFIER_PARAMS.get(str(values["verifier"]).strip(), ())  # (the matrix's rule: others dropped)
        values = {key: value for key, value in values.items() if key not in MATRIX_PARAMS or key in takes}
        spec = SpeculativeSpec.from_table(values, keys=("temperature",), params=MATRIX_PARAMS)
        options = {key: value for key, value in values.items() if key not in METHOD_KEYS}
        return _method(spec, str(values["drafter"]).strip(), options, float(values.get("temperature", 0)))
    except ValueError as e:
        keys = "" if "has no option" not in str(e) else "; the method's own keys are " + ", ".join(METHOD_KEYS)
        raise SpeculateError(f"--method {shown}: {e}{keys}") from None
