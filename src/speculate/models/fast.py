"""A lean decoder for Llama-family models (Llama, Qwen2, Mistral): plain functions over the same weights,
with a static KV cache written by position (in the manner of gpt-fast).

Why: on these CPUs one SmolLM2 decode step spends ~21 ms in its linear layers and ~12 ms around them
(per-module Python, separate q/k/v and gate/up matmuls, rotary and norm ops, cache concatenation).
Here q/k/v and gate/up are fused into one matmul each, norms are one fused op, and the cache is a
preallocated buffer: a forward writes its new keys/values at their positions and rolling back is
moving a length back. The Hugging Face modules are re-pointed at views of the fused weights, so both
paths share one copy and the HF model stays usable (it is the reference in the tests).

Same interface as :class:`speculate.models.kv.HFKVModel`: reset / forward / keep / keep_path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .loader import LoadedModel

SUPPORTED = {"llama", "qwen2", "mistral"}


def supports(model: nn.Module) -> bool:
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        return False
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "mlp_bias", False):
        return False
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return False
    layer = model.model.layers[0]
    # Plain nn.Linear layers only (an int8-quantized model brings its own kernels).
    return all(type(m) is nn.Linear for m in (layer.self_attn.q_proj, layer.mlp.gate_proj, model.lm_head))


def _fuse(modules: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the weights (and biases) of ``modules`` and point each module at its slice."""
    weight = torch.cat([m.weight.detach() for m in modules])
    bias = None
    if modules[0].bias is not None:
        bias = torch.cat([m.bias.detach() for m in modules])
    row = 0
    for m in modules:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row: row + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row: row + rows], requires_grad=False)
        row += rows
    return weight, bias


class FastKVModel:
    def __init__(self, loaded: LoadedModel):
        model = loaded.model
        cfg = model.config
        self.loaded, self.model, self.config = loaded, model, cfg
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm, self.eps = inner.norm.weight, inner.norm.variance_epsilon
        self.rotary = inner.rotary_emb
        attn0 = inner.layers[0].self_attn
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = attn0.head_dim
        self.scaling = attn0.scaling
        self.hidden = cfg.hidden_size
        self.layers = []
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv_w, qkv_b = _fuse([a.q_proj, a.k_proj, a.v_proj])
            gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
            self.layers.append((layer.input_layernorm.weight, qkv_w, qkv_b, a.o_proj.weight,
                                layer.post_attention_layernorm.weight, gate_up, mlp.down_proj.weight))
        self.lm_head = model.lm_head.weight
        self.vocab_size = self.lm_head.shape[0]
        self.dtype = self.embed.dtype
        self.length = 0
        self.k_cache = self.v_cache = None

    # ---------------------------------------------------------------------------------------------
    def reset(self, capacity: int = 256) -> None:
        self.length = 0
        self._ensure(capacity)

    def _ensure(self, needed: int) -> None:
        """Grow the cache buffers (doubling) so that positions < needed fit; keeps what is cached."""
        have = 0 if self.k_cache is None else self.k_cache.shape[2]
        if needed <= have:
            return
        size = max(needed, 2 * have, 256)
        shape = (len(self.layers), self.n_kv, size, self.head_dim)
        k, v = torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)
        if have and self.length:
            k[:, :, : self.length] = self.k_cache[:, :, : self.length]
            v[:, :, : self.length] = self.v_cache[:, :, : self.length]
        self.k_cache, self.v_cache = k, v

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, last: int = 0, tree_parents: list[int] | None = None) -> torch.Tensor:
        """See HFKVModel.forward: logits [rows, V] for ``tokens`` at the next positions."""
        from .kv import tree_depths_and_ancestors

        n, start = tokens.shape[0], self.length
        end = start + n
        self._ensure(end)
        if tree_parents is None:
            positions = torch.arange(start, end)
            # One new token attends to everything cached: no mask. A chain: causal within the new block.
            mask = None if n == 1 else torch.ones(n, end, dtype=torch.bool).tril_(start)
        else:
            depth, allowed = tree_depths_and_ancestors(tree_parents)
            positions = start + depth
            mask = torch.ones(n, end, dtype=torch.bool)
            mask[:, start:] = allowed
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(tokens, self.embed)  # [n, hidden]
        cos, sin = self.rotary(x, positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [n, 1, hd]: broadcast over heads
        half = hd // 2
        for i, (ln1, qkv_w, qkv_b, o_w, ln2, gate_up, down) in enumerate(self.layers):
            # Attention: one fused q/k/v matmul, rotary on q and k, new k/v written at their positions.
            h = F.rms_norm(x, (self.hidden,), ln1, self.eps)
            q, k, v = F.linear(h, qkv_w, qkv_b).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            qk = torch.cat([q.view(n, nh, hd), k.view(n, nkv, hd)], dim=1)
            qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
            self.k_cache[i, :, start:end] = qk[:, nh:].transpose(0, 1)
            self.v_cache[i, :, start:end] = v.view(n, nkv, hd).transpose(0, 1)
            out = F.scaled_dot_product_attention(
                qk[:, :nh].transpose(0, 1)[None], self.k_cache[i, :, :end][None], self.v_cache[i, :, :end][None],
                attn_mask=mask, scale=self.scaling, enable_gqa=nkv != nh)
            x = x + F.linear(out[0].transpose(0, 1).reshape(n, nh * hd), o_w)
            # MLP: one fused gate/up matmul.
            gate, up = F.linear(F.rms_norm(x, (self.hidden,), ln2, self.eps), gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, down)
        self.length = end
        if last:
            x = x[-last:]
        return F.linear(F.rms_norm(x, (self.hidden,), self.final_norm, self.eps), self.lm_head).float()

    def keep(self, n_positions: int) -> None:
        # Positions past the length are simply overwritten by the next forward.
        self.length = min(self.length, n_positions)

    def keep_path(self, start: int, nodes: list[int]) -> None:
        src = start + torch.tensor(nodes, dtype=torch.long)
        m = len(nodes)
        self.k_cache[:, :, start: start + m] = self.k_cache[:, :, src]
        self.v_cache[:, :, start: start + m] = self.v_cache[:, :, src]
        self.length = start + m
