"""k, the draft length per round, as every settings path takes it (CLI flags, a request, a bench method, a TOML
table, the Python API): :func:`parse_k`, one check and one error text."""

from __future__ import annotations

from ..errors import SpeculateError
from ..params import is_auto

MAX_K = 64  # the longest draft a round may ask for (the server's request limit, and so everyone's)
AUTO = "auto"


def parse_k(value) -> int | str:
    """An integer in 1..64, or 'auto' (the engine sizes each round), from text or a value; SpeculateError
    otherwise, with one text whichever path it came by."""
    if is_auto(value):
        return AUTO
    number = value
    if isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= MAX_K:
        raise SpeculateError(f"k must be an integer in 1..{MAX_K} or 'auto', got {value!r}")
    return number


__all__ = ["MAX_K", "parse_k"]
