"""A setting declared once, on the class that takes it: a verifier's parameters (``Verifier.params``) and a
drafter's options (``Drafter.params``).

Each :class:`Param` says its name, default, meaning and range. From that one declaration come the verifier's
constructor (``Verifier.__init__`` checks and sets them), ``get_verifier``'s validation, the ``speculate generate``
flags and the server request's ``speculative`` fields (``verifiers.PARAMS``), so one bad value gets one error text
whichever way it arrives (Python, CLI, HTTP); for a drafter, its ``--drafter-opt`` keys, their types and defaults
(``drafters.parse_options``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

AUTO = "auto"


def is_auto(value) -> bool:
    """The value 'auto' (any case, surrounding spaces): the one reading of it (``policy.auto`` re-exports it)."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def as_bool(value) -> bool | None:
    """True or False for a bool, 0 or 1, or the text true/1/yes, false/0/no (any case, surrounding spaces): the one
    reading of a switch written as text (a flag, a bench method string, a TOML value); None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        return True if text in ("true", "1", "yes") else False if text in ("false", "0", "no") else None
    return bool(value) if isinstance(value, (int, float)) and value in (0, 1) else None


def pairs(items) -> dict:
    """Settings as a dict, from a dict, (key, value) pairs or ``KEY=VALUE`` strings (a ``--drafter-opt`` flag's);
    keys stripped. The one reading of a list of options, whichever way it arrives."""
    if items is None:
        return {}
    if isinstance(items, dict):
        return {str(key).strip(): value for key, value in items.items()}
    out = {}
    for item in items:
        key, value = item.partition("=")[::2] if isinstance(item, str) else item
        out[str(key).strip()] = value
    return out


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Param:
    """One parameter of a verifier, or option of a drafter.

    ``default``'s type is the parameter's type (a verifier's: float or bool; a drafter's also int or str), or
    ``value_type`` where the default is None (a drafter option unset unless given). A float must be finite and
    within ``low``/``high`` (None: unbounded; ``low_open``/``high_open``: strict). ``auto``: what the value
    'auto' means, where the engine resolves it before building the verifier (None: not accepted).
    ``user``: False for a parameter the engine sets itself (e.g. ``greedy`` from the temperature): no
    CLI flag, no request field."""

    name: str
    default: float | bool | int | str | None
    meaning: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = True
    auto: str | None = None
    user: bool = True
    value_type: type | None = None

    @property
    def kind(self) -> type:
        return self.value_type or type(self.default)

    def convert(self, value):
        """``value``, or its text, as this parameter's type, unchecked (a drafter checks its options' ranges in its
        constructor); ValueError where it is none (:attr:`kind_text` says what it wants)."""
        if self.kind is bool:
            if as_bool(value) is None:
                raise ValueError(value)
            return as_bool(value)
        return self.kind(str(value).strip())

    @property
    def kind_text(self) -> str:
        """What a value must be, for error texts: ``an integer``, ``a number``, ``true or false``."""
        return {int: "an integer", float: "a number", bool: "true or false"}.get(self.kind, self.kind.__name__)

    def range_text(self) -> str:
        """``> 0``, ``0 <= beta < 1``, ... ('' for a bool or an unbounded number)."""
        if self.kind is bool:
            return ""
        lo = None if self.low is None else ("<" if self.low_open else "<=")
        hi = None if self.high is None else ("<" if self.high_open else "<=")
        if lo and hi:
            return f"{_num(self.low)} {lo} {self.name} {hi} {_num(self.high)}"
        if lo:
            return f"{'>' if self.low_open else '>='} {_num(self.low)}"
        if hi:
            return f"{hi} {_num(self.high)}"
        return ""

    def requirement(self) -> str:
        """What an error says the value must do: ``be a finite number > 0``, ``satisfy 0 <= beta < 1``."""
        text = self.range_text()
        if self.low is not None and self.high is not None:
            return f"satisfy {text}"
        return f"be a finite number {text}".rstrip()

    def describe(self) -> str:
        """One line for help texts: meaning, range, default, what 'auto' means."""
        parts = [self.range_text(), f"default {self.default}"]
        if self.auto:
            parts.append(f"'auto': {self.auto}")
        return f"{self.meaning} ({'; '.join(p for p in parts if p)})"

    def check(self, who: str, value):
        """``value`` as this parameter's type, or ValueError ('auto' passes through where declared)."""
        if self.kind is bool:  # (text from a TOML table or a bench method string: true/false, not bool("false"))
            if as_bool(value) is not None:
                return as_bool(value)
            raise ValueError(f"{who}: {self.name} must be true or false ({self.meaning}), got {value!r}")
        if self.auto and is_auto(value):
            return AUTO
        number = None
        if not isinstance(value, bool):
            try:
                number = float(value)
            except (TypeError, ValueError):
                pass
        if number is None:
            raise ValueError(f"{who}: {self.name} must be a number ({self.meaning}), got {value!r}")
        ok = math.isfinite(number)
        if ok and self.low is not None:
            ok = number > self.low if self.low_open else number >= self.low
        if ok and self.high is not None:
            ok = number < self.high if self.high_open else number <= self.high
        if not ok:
            raise ValueError(f"{who}: {self.name} must {self.requirement()} ({self.meaning}), got {number}")
        return number


__all__ = ["AUTO", "Param", "as_bool", "is_auto"]
