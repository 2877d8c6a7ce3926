"""Does another SmoothQuant migration strength α remove int8's one broken answer on the default model?

    python benchmarks/probes/int8_alpha.py [--alphas kept,0.3,qkv0.8-0.3,0.5,none] [--prompts all | ID,ID,...]

For each α: the default model converted to int8 with it (in memory, nothing cached), greedy plain decoding of 64 tokens
for each prompt of bench.precision's set (80 MT-Bench, 50 GSM8K, 8 copy), and the prompts whose answer degenerates
(models/quality.degenerate) compared with fp32's answers in docs/runs/precision-answers/smollm2-135m.json.
"""

import argparse
import json
import warnings

from speculate.bench.precision import prompts
from speculate.engine import SpeculativeDecoder
from speculate.models import DEFAULT_MODEL, load_model, quality, quantize

CANDIDATES = {"kept": quantize.ALPHA, "0.5": 0.5, "0.3": 0.3, "0.4": 0.4, "none": None,
              "qkv0.8-0.3": {"qkv_proj": 0.8, "o_proj": 0.3, "gate_up_proj": 0.3, "down_proj": 0.3, "lm_head": 0.3}}
RECORD = "docs/runs/precision-answers/smollm2-135m.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--alphas", default="kept,0.3,qkv0.8-0.3")
    p.add_argument("--prompts", default="all", help="all, or prompt ids (mt_bench-145,...)")
    a = p.parse_args()
    warnings.simplefilter("ignore")
    reference = {r["id"]: r for r in json.load(open(RECORD))["rows"]["int8"]}
    items = prompts(80, 50, 8)
    if a.prompts != "all":
        items = [i for i in items if i[1] in a.prompts.split(",")]
    for name in a.alphas.split(","):
        alpha = CANDIDATES[name]
        loaded = load_model(DEFAULT_MODEL, dtype="fp32", progress=False)
        tensors = quantize.quantize(loaded.model, loaded.tokenizer, alpha=0.5 if alpha is None else alpha,
                                    smooth_layers=alpha is not None)
        quantize.apply(loaded.model, tensors)
        decoder = SpeculativeDecoder(loaded, "none")
        broken, loops_with_fp32, equal = [], [], 0
        for _, sid, prompt in items:
            out = decoder.generate(quality.prompt_ids(loaded.tokenizer, prompt), max_new_tokens=64).token_ids
            ref = reference[sid]
            equal += loaded.tokenizer.decode(out) == ref["reference"]
            if quality.degenerate(out):
                (loops_with_fp32 if ref["reference_degenerate"] else broken).append(sid)
        print(f"alpha {name}: degenerate where fp32 is not: {broken or 'none'}; where fp32 is too: "
              f"{loops_with_fp32 or 'none'}; answers equal to fp32's: {equal}/{len(items)}", flush=True)


if __name__ == "__main__":
    main()
