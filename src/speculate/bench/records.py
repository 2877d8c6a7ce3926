"""A results folder's files: ``samples.jsonl`` (one record per sample and method, appended as they finish) and
``run.json`` (the run's settings and machine). One module for reading and writing them, below both the runner
that writes them and the report and ``speculate calc --from-results`` that read them."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import SpeculateError
from ..models.cache import atomic_write_text

SAMPLES_FILE = "samples.jsonl"
RUN_FILE = "run.json"


def read_records(path: Path, repair: bool = True) -> list[dict]:
    """The records of ``samples.jsonl``. A torn last line (a run killed mid-write) is dropped, and with
    ``repair`` (a run about to append) the file rewritten without it so that appends continue on a clean
    line; readers that only analyse (``speculate calc --from-results``) leave the file as it is."""
    path = Path(path)
    if not path.is_file():
        return []
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except (OSError, UnicodeDecodeError) as e:
        raise SpeculateError(f"{path}: cannot read it ({e.__class__.__name__})") from None
    records, good = [], []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise SpeculateError(f"{path}: line {i + 1} is not JSON; the file is damaged") from None
            continue
        if not (isinstance(record, dict) and all(isinstance(record.get(k), str) for k in ("method", "dataset", "id"))
                and isinstance(record.get("turns"), list) and isinstance(record.get("quality"), dict)):
            raise SpeculateError(f"{path}: line {i + 1} is not a result record; the file is damaged")
        records.append(record)
        good.append(line if line.endswith("\n") else line + "\n")
    if repair and (len(good) != len(lines) or (lines and not lines[-1].endswith("\n"))):
        atomic_write_text(path, "".join(good))
    return records


def timed_together(record: dict, other: dict) -> bool:
    """Whether two records' seconds may be divided: both timed by the same start of ``speculate bench`` (its
    ``started`` time, in each record since 2026-12-03), so interleaved on one machine under one load. A resumed
    run whose new start adds a method to samples timed earlier would otherwise divide this start's seconds by
    plain decoding's from another day (a 1.46× "speedup" for a method as fast as its neighbour, at fp32:
    docs/benchmarks.md, "At fp32"). Records written before they named their start pair as they always did."""
    return record.get("started") == other.get("started")


def append_record(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_run_file(folder: Path) -> dict | None:
    """``run.json`` of a results folder as a dict; None when it is unreadable or not a JSON object."""
    try:
        run = json.loads((Path(folder) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return run if isinstance(run, dict) else None
