"""What loading a model costs in time and memory: seconds, RSS after the load, the peak RSS, and the mappings that
hold the most resident memory (``/proc/self/smaps``: a cache file kept mapped shows up by name). Linux only.

    python benchmarks/probes/load_memory.py [--model qwen2.5-coder-1.5b-instruct] [--dtype q4]

Run it from two checkouts in turn (``PYTHONPATH=OTHER/src python benchmarks/probes/load_memory.py``) to compare.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import resource
import time

from speculate.bench import machine_header
from speculate.models import load_model


def mappings(top: int = 5) -> dict[str, int]:
    """Resident MB per mapping (files by name, else [heap], [anon], ...), the largest first."""
    rss, name = collections.Counter(), "[anon]"
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
                name = os.path.basename(parts[5]) if len(parts) > 5 else "[anon]"
            elif parts[0] == "Rss:":
                rss[name] += int(parts[1])
    return {k: v // 1024 for k, v in rss.most_common(top)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--dtype", default="q4")
    args = p.parse_args()
    print(machine_header()["machine"])
    t0 = time.perf_counter()
    loaded = load_model(args.model, dtype=args.dtype, progress=False)  # (kept: its memory is what is measured)
    seconds = time.perf_counter() - t0
    gc.collect()
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) // 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"{args.model} {args.dtype}: load {seconds:.1f} s, RSS after load {rss} MB, peak {peak} MB")
    print("resident MB by mapping:", mappings())
    del loaded


if __name__ == "__main__":
    main()
