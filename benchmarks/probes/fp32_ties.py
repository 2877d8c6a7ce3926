"""How often fp32's own greedy answers on the default model pass through a near-tie: the margin between the top two
logits at every answer token, over bench.precision's 138 prompts (64 tokens each).

    python benchmarks/probes/fp32_ties.py

A position whose margin is a few hundredths of a logit is decided by the last bits of the weights: any 8-bit grid may
flip it, and the rest of the answer with it (quoted in docs/results.md, "Quality of each precision").
"""
import warnings

import torch

from speculate.bench.precision import prompts
from speculate.models import DEFAULT_MODEL, load_model, quality
warnings.simplefilter("ignore")
torch.set_num_threads(2)
l = load_model(DEFAULT_MODEL, dtype="fp32", progress=False)
eos = quality.end_tokens(l.model, l.tokenizer)
ms = []
for _, sid, prompt in prompts(80, 50, 8):
    ids = quality.prompt_ids(l.tokenizer, prompt)
    out = quality.greedy(l.model, ids, 64, eos)
    with torch.no_grad():
        lg = l.model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float()
    t = lg.topk(2, -1).values
    ms.append(t[:, 0] - t[:, 1])
m = torch.cat(ms)
print(f"positions {len(m)}; margin < 0.035: {(m < 0.035).sum()} ({(m < 0.035).float().mean():.2%}); < 0.05: {(m < 0.05).sum()}; < 0.1: {(m < 0.1).sum()}; prompts with a margin < 0.05: {sum(bool((x < 0.05).any()) for x in ms)}/138")
