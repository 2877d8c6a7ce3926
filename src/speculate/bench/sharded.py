"""``speculate bench --ray [ADDR]``: one run's samples sharded over Ray workers, each a whole bench of its own.

Worker i of n runs every n-th sample from the i-th (``BenchConfig.shard``) through ``run_bench``, into
``OUT/shards/i-of-n/``: it loads the models, times every method of each of its samples interleaved, and names its
own start in each record, as one process does today, so every speedup still divides seconds that one process timed
for both methods. Then the driver pools the shards' records into ``OUT/samples.jsonl`` and writes the report:
quality pooled over every sample, speed from pairs timed together (bench/records.py, ``timed_together``), and a
speed line per worker. A shard resumes from its own folder: rerun with the same ``--out`` and ``--ray-workers``.

Ray schedules the workers (``--ray-threads`` CPUs each) over the cluster's nodes; with ``--ray`` alone a local Ray
instance starts, sized for the workers, and stops at the end. On several machines ``--out`` must be a folder every
node sees at the same path (a shared file system), since each worker writes its shard there.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from ..errors import SpeculateError
from ..models.cache import atomic_write_text
from .records import RUN_FILE, SAMPLES_FILE, read_records, read_run_file
from .runner import BenchConfig, check_config, run_bench


def shard_folder(out: Path, i: int, n: int) -> Path:
    return Path(out) / "shards" / f"{i + 1}-of-{n}"


def _run_shard(cfg: BenchConfig, i: int, n: int, threads: int) -> str:
    """On a Ray worker: shard i of n, at ``threads`` torch threads; returns the worker's machine line."""
    import torch

    from . import machine_header

    torch.set_num_threads(threads)
    run_bench(dataclasses.replace(cfg, out=shard_folder(cfg.out, i, n), shard=(i, n)), progress=False)
    return machine_header()["machine"]


def run_sharded(cfg: BenchConfig, address: str | None, workers: int, threads: int = 1) -> Path:
    """Run ``cfg`` as ``workers`` shards on Ray (``address``: a cluster to join; None: a local instance), then
    pool them into ``cfg.out``; returns ``cfg.out``."""
    if workers < 1 or threads < 1:
        raise SpeculateError(f"--ray-workers and --ray-threads must be >= 1, got {workers} and {threads}")
    try:
        import ray
    except ImportError as e:
        raise SpeculateError(f"--ray needs Ray ({e}): pip install -e '.[ray]'") from None
    check_config(cfg)  # here, once, not as n workers' tracebacks
    out = Path(cfg.out)
    from ..server.ray_serve import RayOptions, start_ray

    start_ray(RayOptions(replicas=workers, replica_threads=threads, address=address))  # (serve --ray's one start)
    try:
        task = ray.remote(_run_shard).options(num_cpus=threads, max_retries=0,
                                              runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})
        print(f"speculate bench: {workers} workers x {threads} threads on Ray → {out}/shards/", file=sys.stderr)
        try:
            machines = ray.get([task.remote(cfg, i, workers, threads) for i in range(workers)])
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else e
            raise SpeculateError(f"a bench worker failed: {cause}") from None
    finally:
        ray.shutdown()
    return pool_shards(out, workers, machines)


def pool_shards(out: Path, workers: int, machines: list[str]) -> Path:
    """``out``'s samples.jsonl and run.json from its ``workers`` shards (atomically), then the report, with each
    worker's speed line."""
    from .report import write_report

    records, shards = [], []
    for i in range(workers):
        folder = shard_folder(out, i, workers)
        run = read_run_file(folder) or {}
        own = read_records(folder / SAMPLES_FILE)
        records += own
        shards.append({"folder": str(folder.relative_to(out)), "machine": machines[i], "started": run.get("started"),
                       "samples": len({(r["dataset"], r["id"]) for r in own}), "speed": _speed_lines(folder)})
    run = {**(read_run_file(shard_folder(out, 0, workers)) or {}), "shards": shards}
    atomic_write_text(out / SAMPLES_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    atomic_write_text(out / RUN_FILE, json.dumps(run, indent=2) + "\n")
    write_report(out)
    lines = ["", "## Speed per worker", "",
             "Each worker timed its own samples, every method interleaved (its own report: the folder named).", "",
             "| worker | samples | machine | method: speedup over plain |", "| --- | --- | --- | --- |"]
    lines += [f"| {s['folder']} | {s['samples']} | {s['machine']} | {'; '.join(s['speed']) or '—'} |" for s in shards]
    summary = out / "summary.md"
    atomic_write_text(summary, summary.read_text() + "\n".join(lines) + "\n")
    return out


def _speed_lines(folder: Path) -> list[str]:
    """'method: 1.23x' per method of a shard's own report (summary.json), plain decoding left out."""
    try:
        rows = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return []
    pooled = {}
    for row in rows:
        if row.get("method") != "plain" and row.get("speedup") is not None:
            pooled.setdefault(row["method"], []).append(f"{row['dataset']} {row['speedup']:.2f}x")
    return [f"{m}: {', '.join(v)}" for m, v in pooled.items()]
