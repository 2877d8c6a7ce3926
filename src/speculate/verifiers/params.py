"""A verifier's parameters, declared once, on its class (``Verifier.params``).

Each :class:`Param` says its name, default, meaning and range. From that one declaration come the
verifier's constructor (``Verifier.__init__`` checks and sets them), ``get_verifier``'s validation, the
``speculate generate`` flags and the server request's ``speculative`` fields (``verifiers.user_params``),
so one bad value gets one error text whichever way it arrives (Python, CLI, HTTP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

AUTO = "auto"


def is_auto(value) -> bool:
    """The value 'auto' (any case, surrounding spaces): the one reading of it (``speculate.auto`` re-exports it)."""
    return isinstance(value, str) and value.strip().lower() == AUTO


def _num(x: float) -> str:
    return f"{x:g}"


@dataclass(frozen=True)
class Param:
    """One parameter of a verifier.

    ``default``'s type is the parameter's type (float or bool). A float must be finite and within
    ``low``/``high`` (None: unbounded; ``low_open``/``high_open``: strict). ``auto``: what the value
    'auto' means, where the engine resolves it before building the verifier (None: not accepted).
    ``user``: False for a parameter the engine sets itself (e.g. ``greedy`` from the temperature): no
    CLI flag, no request field."""

    name: str
    default: float | bool
    meaning: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = True
    auto: str | None = None
    user: bool = True

    @property
    def kind(self) -> type:
        return type(self.default)

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
            if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.strip().lower() in ("true", "1", "yes")
            if isinstance(value, bool) or value in (0, 1):
                return bool(value)
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


__all__ = ["AUTO", "Param", "is_auto"]
