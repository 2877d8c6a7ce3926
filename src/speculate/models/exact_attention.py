"""Exact attention in PyTorch ops: the fallback of the compiled kernel (models/kernel.py) where no C compiler
works. A row's result does not depend on the other rows of its forward — by construction.

Why: greedy speculative decoding is exact only if a verified row gets the same bits as the same token
decoded alone. A BLAS matmul or softmax gives no such promise: its blocking, and so the order in which it
adds a row's terms, changes with the number of rows (on an AMD EPYC Zen 4 with MKL, fp32 ``bmm`` rows
differed in the last bits for every row count tried; on an Intel Sapphire Rapids they did not). fp32
addition is not associative, so *any* kernel that may reorder a sum can move a row's bits. Integer
addition is associative: if every term and partial sum of a reduction is an integer below 2^53, a
float64 kernel computes it exactly, in whatever order, blocking, vector width or FMA use it chooses, and
whatever the other rows are. So each reduction of attention is made such an integer sum:

* scores  q·k   — q rounded per (row, head) to B_Q-bit integers, k per (position, KV head) to B_K bits
  when written to the cache; |q_int·k_int| summed over the head dimension stays below 2^53.
* softmax Σ e   — the exponentials e = exp(s − max) ∈ (0, 1] (the max is exact in any order) rounded
  to a fixed grid of 2^-B_E; their sum over up to ``max_positions`` keys stays below 2^53.
* values  Σ e·v — v rounded per (position, KV head) to B_V bits; the weights w = e·scale_v rounded per
  row to B_W bits of the row's largest; Σ w_int·v_int stays below 2^53.

The only rounding is in the quantization, which is element- or row-local (a max, a multiply, a round),
and in the final per-row rescale. Masked keys get weight exactly 0, so the layout of the key slots and
the width of a forward do not matter either: a tree node attends over its ancestors wherever they sit,
and no 64-slot blocks or softmax permutations are needed (as the fp32 attention this replaces did).
The remaining per-element work (exp, multiplies) is IEEE arithmetic on each element alone; the load-time
self-check (models/exactness.py) confirms on the running CPU that a whole forward is row-independent.

Precision: the roundings are 2^-23 (q, k) and 2^-20 (v) of a row's largest entry and 2^-(17..19) of a
row's largest attention weight — far below the int8 linear layers' own 2^-7 (see tests/test_int8.py
for the measured agreement with fp32). The cache holds the integers as float64 with their scale in one
extra column (``[KV heads, positions, head_dim + 1]``), so moving positions (rollback, a tree's accepted
path, prefix reuse) moves the scale with them.
"""

from __future__ import annotations

import math

import torch

EXACT = 52  # integer sums stay below 2^52 (< 2^53, the float64 significand): one bit of margin
B_K = 23  # bits of a cached key, of its (position, KV head) largest entry
B_V = 20  # bits of a cached value


def budgets(head_dim: int, max_positions: int) -> tuple[int, int, int]:
    """(B_Q, B_E, B_W) for a model: the bits left to the query, the softmax grid and the value weights
    once the sums' lengths (head_dim terms; up to ``max_positions`` keys) are paid for."""
    log_d, log_l = math.ceil(math.log2(head_dim)), math.ceil(math.log2(max(max_positions, 2)))
    return EXACT - B_K - log_d, EXACT - log_l, EXACT - B_V - log_l


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] → (integers [..., d] as float64, scale [..., 1]) with x ≈ integers · scale, |integers| ≤ 2^bits.

    Row-local: the max over a row is exact in any order, the rest is per element."""
    x = x.double()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-300)
    return (x * ((1 << bits) / amax)).round_(), amax.mul_(1.0 / (1 << bits))


def write(cache: torch.Tensor, start: int, x: torch.Tensor, bits: int) -> None:
    """Quantize new keys or values x [n, KV heads, d] to ``bits`` (B_K, B_V) into cache [KV heads, slots, d + 1]
    at slots start..start+n-1."""
    ints, scale = quantize_rows(x, bits)
    d = x.shape[-1]
    cache[:, start: start + x.shape[0], :d] = ints.transpose(0, 1)
    cache[:, start: start + x.shape[0], d] = scale[..., 0].transpose(0, 1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor | None,
           scaling: float, bits: tuple[int, int, int]) -> torch.Tensor:
    """Attention of q [n, heads, d] over the first L cached slots: keys/values [KV heads, L, d + 1] as
    :func:`write` made them. ``allowed``: [n, L] boolean (None: every row sees every slot). Returns
    [n, heads · d] in fp32. Exact integer sums throughout (module docstring)."""
    b_q, b_e, b_w = bits
    n, heads, d = q.shape
    kv_heads, length = keys.shape[0], keys.shape[1]
    rep = heads // kv_heads
    # Query integers, one scale per (row, head); the attention scaling goes into that scale (per element).
    q_int, q_scale = quantize_rows(q, b_q)
    q_int = q_int.view(n, kv_heads, rep, d).transpose(0, 1).reshape(kv_heads, n * rep, d)
    q_scale = q_scale.view(n, kv_heads, rep, 1).transpose(0, 1).reshape(kv_heads, n * rep, 1).mul_(scaling)
    # Scores: an exact integer dot product per (row, key), then the two scales.
    scores = torch.bmm(q_int, keys[:, :, :d].transpose(1, 2)).mul_(q_scale).mul_(keys[:, None, :, d])
    if allowed is not None:
        scores.masked_fill_(~allowed[:, None, :].expand(n, rep, length).reshape(1, n * rep, length), -math.inf)
    # Softmax numerator e ∈ (0, 1] (exactly 1 at the max, exactly 0 where masked); denominator: an exact sum on
    # a 2^-B_E grid.
    e = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
    denominator = (e * (1 << b_e)).round_().sum(dim=-1, keepdim=True)
    # Weighted values: w = e · scale_v on a grid of 2^-B_W of the row's largest w; an exact integer sum.
    w = e.mul_(values[:, None, :, d])
    w_max = w.amax(dim=-1, keepdim=True)
    w_int = w.mul_((1 << b_w) / w_max).round_()
    out = torch.bmm(w_int, values[:, :, :d])  # [KV heads, n · rep, d]
    out = out.mul_(w_max * ((1 << b_e) / (1 << b_w)) / denominator)
    return out.view(kv_heads, n, rep, d).transpose(0, 1).reshape(n, heads * d).float()
