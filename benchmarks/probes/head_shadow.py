"""Probe: would a 4-, 5- or 6-bit copy of the LM head screen its argmax? (issue 41: the head is ~30 % of the bytes a
one-row q4 step reads; a smaller copy read first, with a bound on its error, would leave only the candidates for the
Q8_0 head's exact dots.)

    python benchmarks/probes/head_shadow.py

The default model at q4: its head's Q8_0 weights W (de-quantized), and the head's inputs x of 24 MT-Bench answers
(greedy, 64 tokens; every position of prompt and answer, the last 4,000 rows). A copy W' per block of 32 (symmetric,
2^bits levels) and, per output o, the bound |(W − W')_o · x| <= Σ_s ‖(W − W')_o,s‖ ‖x_s‖ (Cauchy-Schwarz over S
segments of the inputs). Printed: how many outputs may still be the argmax (z'_o + B_o >= max (z' − B)) per row, and
the same with the m inputs of largest mean x² kept exact (the hidden rows' few very large values).
"""
import glob
import json
from pathlib import Path

import torch
from speculate.models.loader import load_model
torch.set_num_threads(2)
lm = load_model("smollm2-135m-instruct", "q4", progress=False)
model, tok = lm.model, lm.tokenizer
head = model.lm_head
W = head.dequantized_weight().float() if hasattr(head, "dequantized_weight") else head.weight.float()
print("head", type(head).__name__, W.shape)
V, K = W.shape
xs = []
h = head.register_forward_hook(lambda m, i, o: xs.append(i[0].detach().reshape(-1, K).clone()))
qs = [json.loads(l) for l in open(glob.glob(str(Path(__file__).resolve().parents[2] / "src/speculate/data/mt_bench/*.jsonl"))[0])][:24]
for q in qs:
    text = tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt").input_ids
    out = lm.model.generate(ids, max_new_tokens=64, do_sample=False)
    with torch.no_grad():
        model(out)
h.remove()
X = torch.cat(xs)[-4000:]
print("rows", X.shape)
z = X @ W.T
top2 = z.topk(2, dim=-1).values
print("gap top1-top2 median", (top2[:, 0] - top2[:, 1]).median().item())
Wb = W.reshape(V, K // 32, 32)
for bits, levels in ((4, 16), (5, 32), (6, 64)):
    # symmetric shadow per block of 32: w4 = d * round(w / d), d = amax / (levels/2 - 1)
    amax = Wb.abs().amax(-1, keepdim=True)
    d = amax / (levels // 2 - 1)
    Q = torch.where(d > 0, torch.round(Wb / d.clamp_min(1e-30)), torch.zeros_like(Wb))
    W4 = (Q * d).reshape(V, K)
    E = W - W4
    z4 = X @ W4.T
    cs = E.norm(dim=-1)[None, :] * X.norm(dim=-1)[:, None]  # Cauchy-Schwarz
    for S in (1, 2, 4, 18):
        seg = K // S
        Es = E.reshape(V, S, seg).norm(dim=-1)  # [V, S]
        Xs = X.reshape(-1, S, seg).norm(dim=-1)  # [R, S]
        B = Xs @ Es.T
        B = B * 1.001 + 1e-4
        T = (z4 - B).max(-1, keepdim=True).values
        cand = ((z4 + B) >= T).sum(-1).float()
        print(f"{bits}-bit S={S}: candidates median {cand.median().item():.0f} mean {cand.mean().item():.0f} "
              f"p90 {cand.quantile(0.9).item():.0f} max {cand.max().item():.0f}; bound median {B.median().item():.3f}")

print("--- outlier channels exact")
ms = (X ** 2).mean(0)
order = ms.argsort(descending=True)
print("share of sum x^2 in top channels:", [round((ms[order[:m]].sum() / ms.sum()).item(), 3) for m in (1, 2, 4, 8, 16, 32)])
for bits, levels in ((4, 16), (5, 32)):
    amax = Wb.abs().amax(-1, keepdim=True)
    d = amax / (levels // 2 - 1)
    Q = torch.where(d > 0, torch.round(Wb / d.clamp_min(1e-30)), torch.zeros_like(Wb))
    W4 = (Q * d).reshape(V, K)
    for m in (4, 16, 32, 64):
        ex = order[:m]
        W4m = W4.clone(); W4m[:, ex] = W[:, ex]
        E = W - W4m
        z4 = X @ W4m.T
        for S in (1, 18):
            seg = K // S
            B = X.reshape(-1, S, seg).norm(dim=-1) @ E.reshape(V, S, seg).norm(dim=-1).T * 1.001 + 1e-4
            T = (z4 - B).max(-1, keepdim=True).values
            cand = ((z4 + B) >= T).sum(-1).float()
            print(f"{bits}-bit, {m} exact channels, S={S}: candidates median {cand.median().item():.0f} mean {cand.mean().item():.0f} p90 {cand.quantile(0.9).item():.0f}; bound median {B.median().item():.3f}")
