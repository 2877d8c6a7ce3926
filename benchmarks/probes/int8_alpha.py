"""Does another SmoothQuant migration strength α (or another 8-bit weight grid) remove int8's one broken answer on
the default model, and how near a tie is fp32's own answer where int8 leaves it?

    python benchmarks/probes/int8_alpha.py [--alphas kept,0.3,qkv0.8-0.3,0.5,none,q8_0] [--prompts all | ID,ID,...]

For each candidate: the default model converted to 8-bit weights with it (in memory, nothing cached), greedy plain
decoding of 64 tokens for each prompt of bench.precision's set (80 MT-Bench, 50 GSM8K, 8 copy), and the prompts whose
answer degenerates (models/quality.degenerate) compared with fp32's answers in
docs/runs/precision-answers/smollm2-135m.json. For each such prompt: fp32's margin between its top two logits at the
token where the candidate's answer first leaves fp32's (a margin of a few hundredths is a tie that any 8-bit weight
grid may break either way). Candidates: an α (``kept`` is quantize.ALPHA), ``none`` (no smoothing), or ``q8_0``
(GGUF's Q8_0 blocks: one scale per 32 weights, no smoothing, run by the q4 kernel).
"""

import argparse
import json
import warnings

import torch

from speculate.bench.precision import prompts
from speculate.engine import SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.models import DEFAULT_MODEL, blocks, load_model, quality, quantize

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
        loaded = load_model(DEFAULT_MODEL, dtype="fp32", progress=False)
        fp32 = load_model(DEFAULT_MODEL, dtype="fp32", progress=False).model  # for the margins
        if name == "q8_0":
            blocks.apply(loaded.model, {f"part.{fused}.0.Q8_0": blocks.quantize(torch.cat(
                [loaded.model.get_submodule(m).weight for m in members]), "Q8_0")
                for fused, members in quantize.plan(loaded.model)})
        else:
            alpha = CANDIDATES[name]
            tensors = quantize.quantize(loaded.model, loaded.tokenizer, alpha=0.5 if alpha is None else alpha,
                                        smooth_layers=alpha is not None)
            quantize.apply(loaded.model, tensors)
        decoder = SpeculativeDecoder(loaded, SpeculativeSpec("none"))
        broken, loops_with_fp32, equal = [], [], 0
        for _, sid, prompt in items:
            ids = quality.prompt_ids(loaded.tokenizer, prompt)
            out = decoder.generate(ids, max_new_tokens=64).token_ids
            ref = reference[sid]
            equal += loaded.tokenizer.decode(out) == ref["reference"]
            if quality.degenerate(out):
                if ref["reference_degenerate"]:
                    loops_with_fp32.append(sid)
                    continue
                # fp32's top-two margin where this answer leaves fp32's (fp32's greedy path up to there)
                at = quality.first_difference(out, quality.greedy(fp32, ids, 64, quality.end_tokens(fp32, loaded.tokenizer)))
                with torch.no_grad():
                    top = fp32(torch.tensor([ids + out[:at]])).logits[0, -1].float().topk(2).values
                broken.append(f"{sid} (from token {at}; fp32's margin there {float(top[0] - top[1]):.3f})")
        print(f"{name}: degenerate where fp32 is not: {broken or 'none'}; where fp32 is too: "
              f"{loops_with_fp32 or 'none'}; answers equal to fp32's: {equal}/{len(items)}", flush=True)


if __name__ == "__main__":
    main()
