"""Benchmarks: ``speculate bench`` (runner, report, datasets, sandbox, metrics) and focused scripts:
``python -m speculate.bench.speed`` (engine against Hugging Face, precisions, threads, per-round overhead),
``python -m speculate.bench.serve_load`` (server throughput), ``python -m speculate.bench.ab``
(speculation against plain in one server, wave by wave), ``python -m speculate.bench.precision``
(quality across precisions), ``python -m speculate.bench.trees`` (draft-tree shapes for the heads).
Helpers shared by the scripts live here."""

from __future__ import annotations

import json


def machine_header() -> dict:
    """The machine fields of a run file's header: ``machine`` (one line) and ``machine_info`` (every field
    of bench/machine.py's ``describe``). Every script and ``speculate bench`` record them."""
    from .machine import header

    return header()


def emit(result: dict, out: str | None) -> int:
    """Print ``result`` as JSON and, with ``out``, write it there atomically; the scripts' exit code."""
    from ..models.cache import atomic_write_text

    text = json.dumps(result, indent=2)
    print(text)
    if out:
        atomic_write_text(out, text + "\n")
    return 0


def script(main, argv=None) -> int:
    """Run a script's ``main``: bad input (a SpeculateError) is one line on stderr and exit code 2."""
    import sys

    from ..errors import SpeculateError

    try:
        return main(argv)
    except SpeculateError as e:
        print(f"speculate: {e}", file=sys.stderr)
        return 2
