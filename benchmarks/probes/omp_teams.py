"""Probe: a second thread's OpenMP team slows every forward (why `speculate serve` loads its models on a
generation worker, server/pool.py WorkerPool.call).

    python benchmarks/probes/omp_teams.py [--rounds 3]

Each round runs two fresh processes. In each, a worker thread loads the default model (fp32, 2 torch threads)
and times one-token forwards (FastKVModel, 200 cached tokens; medians of 60) twice; then, in the "team"
process only, the main thread runs one parallel op (it now holds an OpenMP team too), and the worker times
twice more. The "control" process skips that op. Prints the ratio after / before for each. Results in
docs/benchmarks.md, "Server".
"""

import argparse
import subprocess
import sys

CHILD = """
import queue, sys, threading, time, torch
from speculate import load_model
from speculate.models.fast import FastKVModel
torch.set_num_threads(2)
ctx = torch.randint(0, 40000, (200,), generator=torch.Generator().manual_seed(0))
jobs, results = queue.Queue(), queue.Queue()
def worker():
    kv = FastKVModel(load_model("smollm2-135m-instruct", dtype="fp32", progress=False))
    kv.reset(512); kv.forward(ctx)
    while jobs.get() is not None:
        ts = []
        for _ in range(60):
            kv.keep(200); t = time.perf_counter(); kv.forward(ctx[:1]); ts.append(time.perf_counter() - t)
        results.put(sorted(ts)[30] * 1e3)
thread = threading.Thread(target=worker); thread.start()
def step_ms():
    jobs.put(1); return results.get()
before = [step_ms(), step_ms()]
if sys.argv[1] == "team":
    x = torch.randn(8_000_000); (x * 2).sum()  # a parallel op on the main thread: it gets an OpenMP team
after = [step_ms(), step_ms()]
jobs.put(None); thread.join()
print(f"{sys.argv[1]:8s} one-token forward {sum(before) / 2:.1f} ms -> {sum(after) / 2:.1f} ms: x{sum(after) / sum(before):.2f}")
"""


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.rounds):
        for kind in ("team", "control"):
            out = subprocess.run([sys.executable, "-c", CHILD, kind], capture_output=True, text=True, check=True)
            print(out.stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
