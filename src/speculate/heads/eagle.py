"""An EAGLE draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"): autoregression on the target's features rather than on tokens.

Feature f_t = the target's final-normed hidden row at position t (the LM head's input; its LM-head
output predicts token t+1). At position t the head takes the pair [embedding of token t+1, f_t],
mixes it with ``fc`` (2H → H) and one Llama decoder layer (attention over the earlier pairs, then a
SwiGLU MLP; no input norm, as EAGLE's layer 0), and outputs f̂_{t+1}, a prediction of the target's
next feature; the target's frozen LM head turns f̂_{t+1} into the distribution of token t+2. Drafting
continues on its own predicted features: [embedding of the drafted token, f̂_{t+1}] → f̂_{t+2} → ...

The layer is written out (not transformers' module) so that training (a batch of padded sequences,
causal) and drafting (a static KV cache addressed by slot, with a tree mask) share one code path.
Trained with smooth-L1 on the features plus cross-entropy on the tokens (heads/train.py), optionally
also on its own predictions a few steps deep (:meth:`EagleHead.unroll`, EAGLE-3's training-time test).

Fused features (EAGLE-3, Li et al. 2025; ``feature_layers``): at depth 1 the head may also read the
outputs of a few lower decoder layers of the target beside f_t (the last row is shaped to predict one
token; lower layers keep more of what comes after it); ``fuse`` mixes them back to H
(:meth:`EagleHead.real_features`). From depth 2 on the head drafts on its own H-wide outputs, as before.
On the default model's 255k-token training data they did not pay (docs/benchmarks.md, "Fused features and a
token-weighted loss"), so the shipped head reads f_t alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class EagleHead(nn.Module):
    kind = "eagle"

    def __init__(self, hidden_size: int, n_heads: int, n_kv_heads: int, head_dim: int, intermediate_size: int,
                 rope_theta: float = 10000.0, eps: float = 1e-5, vocab: torch.Tensor | None = None,
                 feature_layers: tuple[int, ...] = ()):
        """``feature_layers``: decoder layers (0-based) of the target whose outputs join the final-normed
        row as the head's input at depth 1 (EAGLE-3's fused low/mid/high features), mixed to H by
        ``fuse``; empty: EAGLE-1's input, the final-normed row alone."""
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError("n_heads must be a multiple of n_kv_heads")
        self.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim = hidden_size, n_heads, n_kv_heads, head_dim
        self.intermediate_size, self.rope_theta, self.eps = intermediate_size, float(rope_theta), float(eps)
        h = hidden_size
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.fuse = nn.Linear((1 + len(self.feature_layers)) * h, h) if self.feature_layers else None
        self.fc = nn.Linear(2 * h, h)
        self.q_proj = nn.Linear(h, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(h, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(h, n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * head_dim, h, bias=False)
        self.post_norm = nn.Parameter(torch.ones(h))
        self.gate_proj = nn.Linear(h, intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, h, bias=False)
        self.register_buffer("inv_freq", 1.0 / rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim),
                             persistent=False)
        self.register_buffer("vocab", None if vocab is None else vocab.to(torch.long).clone())

    # ------------------------------------------------------------------------------------ config
    def config(self) -> dict:
        return {"kind": self.kind, "hidden_size": self.hidden_size, "n_heads": self.n_heads,
                "n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "rope_theta": self.rope_theta, "eps": self.eps,
                "vocab_subset": None if self.vocab is None else int(self.vocab.numel()),
                **({"feature_layers": list(self.feature_layers)} if self.feature_layers else {})}

    @classmethod
    def from_config(cls, cfg: dict, vocab: torch.Tensor | None = None) -> "EagleHead":
        return cls(cfg["hidden_size"], cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"], cfg["intermediate_size"],
                   cfg["rope_theta"], cfg["eps"], vocab, tuple(cfg.get("feature_layers", ())))

    @classmethod
    def for_target(cls, model_config, vocab: torch.Tensor | None = None,
                   feature_layers: tuple[int, ...] = ()) -> "EagleHead":
        """Sized like one layer of the target (its heads, head size, MLP width, rotary base)."""
        c = model_config
        theta = getattr(c, "rope_theta", None)
        if theta is None:
            theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.hidden_size, c.num_attention_heads, getattr(c, "num_key_value_heads", None) or
                   c.num_attention_heads, head_dim, c.intermediate_size, theta, getattr(c, "rms_norm_eps", 1e-5),
                   vocab, feature_layers)

    # ----------------------------------------------------------------------------------- forward
    def _rotary(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [..., T, heads, hd] rotated by positions [..., T]."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [..., T, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)[..., None, :]  # broadcast over heads
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def real_features(self, feat: torch.Tensor) -> torch.Tensor:
        """The target's features [..., (1 + len(feature_layers))·H] → the head's input [..., H]: the final-
        normed row, or (fused) that row and each tapped layer's output, each tap RMS-normed without a
        weight (residual-stream rows differ in scale from layer to layer), mixed by ``fuse``. Drafted
        features (the head's own outputs, depth ≥ 2) are already [..., H] and skip this."""
        if self.fuse is None:
            return feat
        h = self.hidden_size
        taps = feat[..., h:].unflatten(-1, (len(self.feature_layers), h))
        taps = F.rms_norm(taps, (h,), eps=self.eps).flatten(-2)
        return self.fuse(torch.cat([feat[..., :h], taps], dim=-1))

    def _qkv(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor):
        x = self.fc(torch.cat([emb, feat], dim=-1))
        shape = x.shape[:-1]
        q = self._rotary(self.q_proj(x).view(*shape, self.n_heads, self.head_dim), positions)
        k = self._rotary(self.k_proj(x).view(*shape, self.n_kv_heads, self.head_dim), positions)
        v = self.v_proj(x).view(*shape, self.n_kv_heads, self.head_dim)
        return x, q, k, v

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + self.o_proj(attn)
        y = F.rms_norm(x, (self.hidden_size,), self.post_norm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def forward(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """Training: emb [B, T, H], feat [B, T, H or (1 + taps)·H (:meth:`real_features`)] (pairs at positions 0..T-1, right-padded) → f̂ [B, T, H], causal."""
        return self.unroll(emb, feat, 1)[0]

    def unroll(self, emb: torch.Tensor, feat: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training as drafting runs: ``steps`` passes, pass m drafting on pass m−1's predicted features
        (EAGLE-3's "training-time test", Li et al. 2025).

        Pass 1 is :meth:`forward`: row r takes [embedding of token r+1, f_r] at position r → f̂_{r+1}.
        Pass m ≥ 2, row r: [embedding of token r+m, pass m−1's f̂_{r+m−1}] at position r+m−1 → f̂_{r+m},
        the feature a depth-m draft starts from. Its query attends to what a drafting step sees: the real
        pairs at positions 0..r (pass 1's keys) and the drafted ones after them (passes 2..m, row r's own
        keys). Without it the head only ever sees real features and does worse at each later depth.
        Returns the m outputs [B, T, H], row r of pass m predicting f_{r+m} (rows past the sequence's end:
        padding; the loss masks them)."""
        b, t, h = emb.shape
        positions = torch.arange(t).expand(b, t)
        feat = self.real_features(feat)
        keys, values, outs, mask = [], [], [], None
        for m in range(1, steps + 1):
            if m > 1:  # the next token's embedding beside the previous pass's prediction
                emb = torch.cat([emb[:, 1:], emb.new_zeros(b, 1, h)], dim=1)
                feat = outs[-1]
                # [T, m·T]: the real pairs up to this row (causal), then this row's own drafted pairs (diagonal).
                mask = torch.cat([torch.ones(t, t, dtype=torch.bool).tril_()] + [torch.eye(t, dtype=torch.bool)] *
                                 (m - 1), dim=1)
            x, q, k, v = self._qkv(emb, feat, positions + (m - 1))
            keys.append(k), values.append(v)
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), torch.cat(keys, dim=1).transpose(1, 2), torch.cat(values, dim=1).transpose(1, 2),
                attn_mask=mask, is_causal=mask is None, enable_gqa=self.n_heads != self.n_kv_heads)
            outs.append(self._finish(x, attn.transpose(1, 2).reshape(b, t, -1)))
        return outs

    # --------------------------------------------------------------------------------- drafting
    def new_cache(self, capacity: int, dtype=torch.float32) -> "EagleCache":
        return EagleCache(self, capacity, dtype)

    def step(self, cache: "EagleCache", emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """Drafting: n pairs (emb, feat [n, H]) at ``positions`` [n], their keys/values written at cache
        ``slots`` [n]; ``allowed`` [n, end] (end = max slot + 1) says which slots each row attends to
        (None: causal over slots 0..end-1, the new rows being slots end-n..end-1). → f̂ [n, H]."""
        n = emb.shape[0]
        end = int(slots.max()) + 1
        cache.ensure(end)
        x, q, k, v = self._qkv(emb, feat, positions)
        cache.k[:, slots] = k.transpose(0, 1)
        cache.v[:, slots] = v.transpose(0, 1)
        if allowed is None:
            mask = None if n == 1 else torch.ones(n, end, dtype=torch.bool).tril_(end - n)
        else:
            mask = allowed
        attn = F.scaled_dot_product_attention(q.transpose(0, 1)[None], cache.k[None, :, :end], cache.v[None, :, :end],
                                              attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads)
        return self._finish(x, attn[0].transpose(0, 1).reshape(n, -1))


class EagleCache:
    """The head's own keys/values by slot: [kv heads, capacity, head dim], grown by doubling."""

    def __init__(self, head: EagleHead, capacity: int, dtype):
        self.head, self.dtype = head, dtype
        self.k = self.v = torch.empty(head.n_kv_heads, 0, head.head_dim, dtype=dtype)
        self.ensure(capacity)

    def ensure(self, needed: int) -> None:
        have = self.k.shape[1]
        if needed <= have:
            return
        size = max(needed, 2 * have, 256)
        k = torch.zeros(self.head.n_kv_heads, size, self.head.head_dim, dtype=self.dtype)
        v = torch.zeros_like(k)
        k[:, :have], v[:, :have] = self.k, self.v
        self.k, self.v = k, v
