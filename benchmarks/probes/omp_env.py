"""Probe: does pinning or the OpenMP wait policy change int8 decoding on these CPUs?

    python benchmarks/probes/omp_env.py

Each setting runs in a fresh process (OpenMP reads its environment at start), the settings alternating
over 3 rounds; each process measures one SmolLM2 int8 step (FastKVModel, 200 cached tokens) at 1 and 8
new tokens, and plain decoding of two chat prompts (96 new tokens each), 2 torch threads. Medians over the
rounds. Results in docs/benchmarks.md, "Pinning and the OpenMP wait policy".
"""

import json
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "default": {},
    "OMP_PROC_BIND=close OMP_PLACES=cores": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
    "OMP_WAIT_POLICY=ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
}

CHILD = """
import json, time, warnings, torch
warnings.simplefilter("ignore")
torch.set_num_threads(2)
from speculate import SpeculativeDecoder
from speculate.models import load_model
from speculate.models.fast import FastKVModel
m = load_model("smollm2-135m-instruct", dtype="int8")
kv, ctx = FastKVModel(m), torch.randint(0, 30000, (200,))
def step_ms(n):
    kv.reset(512); kv.forward(ctx, last=1); toks, ts = torch.randint(0, 30000, (n,)), []
    for _ in range(30):
        kv.keep(200); t = time.perf_counter(); kv.forward(toks); ts.append(time.perf_counter() - t)
    return 1e3 * sorted(ts)[15]
t1, t8 = step_ms(1), step_ms(8)
d = SpeculativeDecoder(m, "none"); d.generate("Hi", max_new_tokens=4)
t, n = time.perf_counter(), 0
for p in ["Explain photosynthesis in three sentences.", "Write a short poem about the sea."]:
    n += len(d.generate(p, max_new_tokens=96).token_ids)
print(json.dumps({"t1": t1, "t8": t8, "tokens_per_second": n / (time.perf_counter() - t)}))
"""

if __name__ == "__main__":
    runs = {name: [] for name in SETTINGS}
    for rep in range(3):
        for name in (list(SETTINGS) if rep % 2 == 0 else list(SETTINGS)[::-1]):
            out = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **SETTINGS[name]},
                                 capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    for name, rs in runs.items():
        med = {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        print(f"{name}: T(1) {med['t1']:.2f} ms, T(8)/T(1) {med['t8'] / med['t1']:.2f}, "
              f"plain decoding {med['tokens_per_second']:.1f} tokens/s")
