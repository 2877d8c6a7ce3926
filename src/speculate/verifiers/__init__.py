"""Verification rules: given drafts and target rows, how many drafts to keep and which token comes next.

``get_verifier(name, **params)`` builds one by name; ``VERIFIERS`` maps names to classes.

- ``greedy``     exact match with the target's argmax (lossless for greedy decoding)
- ``sample``     speculative sampling (lossless for sampling; paper eqs. 1-3)
- ``consultant`` Consultant Decoding, NLL threshold with EMA (lossy; eqs. 6-8, Algorithm 1)
- ``mentored``   Mentored Decoding, KL-bounded lossy sampling (eqs. 4-5)
- ``typical``    Medusa typical acceptance (lossy)
"""

from __future__ import annotations

import inspect

from .base import Verdict, Verifier
from .consultant import ConsultantVerifier
from .greedy import GreedyVerifier
from .mentored import MentoredVerifier, mentored_output_distribution
from .sample import SampleVerifier
from .typical import TypicalVerifier

VERIFIERS: dict[str, type[Verifier]] = {
    "greedy": GreedyVerifier,
    "sample": SampleVerifier,
    "consultant": ConsultantVerifier,
    "mentored": MentoredVerifier,
    "typical": TypicalVerifier,
}


def _accepted_params(cls: type[Verifier]) -> list[str]:
    if cls.__init__ is object.__init__:
        return []
    sig = inspect.signature(cls.__init__)
    return [n for n, p in sig.parameters.items() if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def get_verifier(name: str, **params) -> Verifier:
    """Build the verifier called ``name`` with ``params``.

    Parameters whose value is None are ignored (so a CLI can pass every option through). Raises
    ValueError for an unknown name, for a parameter the verifier does not take, and (from the
    verifier itself) for out-of-range values."""
    cls = VERIFIERS.get(name)
    if cls is None:
        raise ValueError(f"unknown verifier {name!r}; choose one of: {', '.join(VERIFIERS)}")
    params = {k: v for k, v in params.items() if v is not None}
    allowed = _accepted_params(cls)
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        shown = [n for n in allowed if n != "greedy"]  # (set by the engine from the temperature, not by users)
        takes = f"it takes: {', '.join(shown)}" if shown else "it takes no parameters"
        raise ValueError(f"verifier {name!r} does not take {', '.join(unknown)}; {takes}")
    return cls(**params)


__all__ = [
    "VERIFIERS",
    "ConsultantVerifier",
    "GreedyVerifier",
    "MentoredVerifier",
    "SampleVerifier",
    "TypicalVerifier",
    "Verdict",
    "Verifier",
    "get_verifier",
    "mentored_output_distribution",
]
