"""Continuous batching without HTTP: C clients, R requests each back to back, batched with engine.step against one
generation at a time (the same decoders, alternated twice), on the copy prompts, 64 tokens, prefill chunks of 128.

    python benchmarks/probes/continuous_batching.py DTYPE DRAFTER CLIENTS REQUESTS [--prof]
    python benchmarks/probes/continuous_batching.py int8 none 8 3     # docs/benchmarks.md, "Batched serving"
"""
import sys, time, cProfile, pstats
from speculate import load_model, SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.engine import step
from speculate.bench.speed import PROMPT_SETS
from speculate.text import encode_prompt
dtype, drafter, C, R = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
m = load_model(dtype=dtype)
prompts = [encode_prompt(m.tokenizer, p) for p in PROMPT_SETS["copy"]]
decs = [SpeculativeDecoder(m, SpeculativeSpec(drafter), prefix_cache=True) for _ in range(C)]
decs[0].generate(prompts[0], max_new_tokens=4)
def one():
    t0 = time.perf_counter(); n = 0
    for r in range(R):
        for c in range(C):
            n += len(decs[c].generate(prompts[(c * R + r) % len(prompts)], max_new_tokens=64).token_ids)
    return n / (time.perf_counter() - t0)
def batched(prof=None):
    left = {c: R for c in range(C)}
    runs = {}
    t0 = time.perf_counter(); n = 0; rounds = 0; sizes = 0
    if prof: prof.enable()
    while left or runs:
        for c in list(left):
            if c not in runs:
                r = R - left[c]
                runs[c] = decs[c].start(prompts[(c * R + r) % len(prompts)], max_new_tokens=64, prefill_chunk=128)
                left[c] -= 1
                if not left[c]: del left[c]
        live = list(runs.values())
        step(live); rounds += 1; sizes += len(live)
        for c, run in list(runs.items()):
            if run.done:
                n += len(run.generation.token_ids); del runs[c]
    if prof: prof.disable()
    return n / (time.perf_counter() - t0), sizes / rounds
a = one(); b, size = batched(); a2 = one(); b2, _ = batched()
print(f"{dtype} {drafter} C={C}: one {a:.1f}/{a2:.1f}  batched {b:.1f}/{b2:.1f} tok/s  x{(b+b2)/(a+a2):.2f}  mean batch {size:.2f}")
if "--prof" in sys.argv:
    p = cProfile.Profile(); batched(p); pstats.Stats(p).sort_stats("tottime").print_stats(22)
