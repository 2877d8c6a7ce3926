"""Probe: the median round of batched greedy decoding, engine-level, at the batch sizes given: what a source tree's
kernels cost at load (docs/benchmarks.md, "AMX for the LM head").

    PYTHONPATH=TREE/src python benchmarks/probes/batch_rounds.py 1 8 16 32

For each B, B generations of the first MT-Bench first turns (again from the first past the last) run together through
``engine.step``, plain greedy decoding of 64 tokens, as the server's scheduler runs them; printed: JSON {B: the median
round in ms}, the prefill rounds and those where a generation ended left out. Run it under two trees in turn, several
times, to compare them (the machine drifts between processes: alternate them).
"""
import statistics, sys, time, torch, json
from speculate import SpeculativeDecoder, SpeculativeSpec, engine, load_model
from speculate.bench.serve_load import prompt_texts
torch.set_num_threads(2)
target = load_model("smollm2-135m-instruct", dtype="q4", progress=False)
dec = SpeculativeDecoder(target, SpeculativeSpec("none"))
dec.generate("Hello", max_new_tokens=8)
prompts = prompt_texts("mt_bench", 80)
out = {}
for b in [int(x) for x in sys.argv[1:]]:
    runs = [dec.start(prompts[i % len(prompts)], max_new_tokens=64, chat=True) for i in range(b)]
    ts = []
    while not all(r.done for r in runs):
        live = [r for r in runs if not r.done]
        steady = not any(r.prefilling for r in live)
        t = time.perf_counter(); engine.step(live, ks=[0] * len(live) if steady else None); dt = time.perf_counter() - t
        if steady and not any(r.done for r in live): ts.append(dt)
    out[b] = statistics.median(ts) * 1e3
print(json.dumps(out))
