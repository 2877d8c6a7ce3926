"""A lean decoder for Llama-family models (Llama, Qwen2, Mistral): plain functions over the same weights,
with a static KV cache written by position (in the manner of gpt-fast).

Why: on these CPUs one SmolLM2 decode step spends ~21 ms in its linear layers and ~12 ms around them
(per-module Python, separate q/k/v and gate/up matmuls, rotary and norm ops, cache concatenation).
Here q/k/v and gate/up are fused into one matmul each, norms are one fused op, and the cache is a
preallocated buffer: a forward writes its new keys/values at their positions and rolling back is
moving a length back. The Hugging Face modules are re-pointed at views of the fused weights, so both
paths share one copy and the HF model stays usable (it is the reference in the tests).

The linear layers are callables: ``F.linear`` on the fused fp32 weights, or, for a model loaded with
``dtype="int8"``, the fused int8 layers that models/quantize.py built (the HF modules are then views of
those). int8 models also use a batch-invariant attention (:meth:`FastKVModel._forward_invariant`).

Same interface as :class:`speculate.models.kv.HFKVModel`: reset / forward / keep / keep_path.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .loader import LoadedModel
from .quantize import Int8Linear, Int8Part, is_int8

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
    # Plain nn.Linear layers, or the int8 layers of models/quantize.py (fused, as that module builds them).
    mods = (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj, model.lm_head)
    return all(type(m) is nn.Linear or is_int8(m) for m in mods)


def _fuse(modules: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One callable computing the concatenated outputs of ``modules`` with one matmul.

    fp32: the weights (and biases) are concatenated and each module is pointed at its slice, so both
    paths share one copy. int8: quantize.py already fused them (the modules are parts of one layer)."""
    if all(type(m) is nn.Linear for m in modules):
        if len(modules) == 1:
            m = modules[0]
            return partial(F.linear, weight=m.weight, bias=m.bias)
        # Fused before (another KVModel over the same model, e.g. one per decoder in a bench run): reuse
        # that copy, or each decoder would hold its own — 3 GB of gate/up weights per copy on a 1.5B.
        fused = getattr(modules[0], "_speculate_fused", None)
        if fused is not None and fused[0] == [id(m) for m in modules] and \
                all(m.weight.data_ptr() == p for m, p in zip(modules, fused[3])):
            return partial(F.linear, weight=fused[1], bias=fused[2])
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
        modules[0]._speculate_fused = ([id(m) for m in modules], weight, bias, [m.weight.data_ptr() for m in modules])
        return partial(F.linear, weight=weight, bias=bias)
    if len(modules) == 1 and isinstance(modules[0], Int8Linear):
        return modules[0].matmul_2d
    if all(isinstance(m, Int8Part) for m in modules):
        whole, bounds = modules[0].whole, [0] + [m.stop for m in modules]
        if all(m.whole is whole and m.start == bounds[j] for j, m in enumerate(modules)) and \
                bounds[-1] == whole.out_features:  # the parts are the whole, in order: one matmul
            return whole.matmul_2d
    return lambda x: torch.cat([m(x) for m in modules], dim=-1)  # any other mix: correct, unfused


def _residual(module: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``f(residual, x) = residual + module(x)`` with the sum fused into the matmul (o_proj, down_proj)."""
    if type(module) is nn.Linear:
        w_t, b = module.weight.t(), module.bias
        if b is None:
            return lambda residual, x: torch.addmm(residual, x, w_t)
        return lambda residual, x: torch.addmm(residual, x, w_t).add_(b)
    if isinstance(module, Int8Linear):
        return module.add_matmul_2d
    return lambda residual, x: residual + module(x)


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
        self.hidden_size = cfg.hidden_size
        self.hidden = None  # after each forward: final-normed hidden rows [n_new, H] (the LM head's input)
        self.taps: tuple[int, ...] = ()  # decoder layers whose outputs follow them in ``hidden`` (EAGLE-3)
        self.layers = []
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            # Callables: F.linear on fused fp32 weights, or the fused int8 layers (models/quantize.py).
            # o_proj and down_proj also add their input's residual (one op).
            self.layers.append((layer.input_layernorm.weight, _fuse([a.q_proj, a.k_proj, a.v_proj]),
                                _residual(a.o_proj), layer.post_attention_layernorm.weight,
                                _fuse([mlp.gate_proj, mlp.up_proj]), _residual(mlp.down_proj)))
        self.lm_head = _fuse([model.lm_head])
        self.vocab_size = model.lm_head.out_features
        self.dtype = self.embed.dtype
        self.length = 0
        self.k_cache = self.v_cache = None
        # int8: batch-invariant attention (_invariant_attention), so that a row's logits do not depend
        # on how many rows share its forward.
        self.invariant = any(is_int8(m) for m in model.modules())

    # ---------------------------------------------------------------------------------------------
    def reset(self, capacity: int = 256, keep: int = 0) -> None:
        """Start a new generation; ``keep``: the cached positions to keep (a shared prompt prefix)."""
        self.length = min(self.length, keep)
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
        # Per-layer views, made once per buffer: indexing the 4-D buffer by layer costs an op per access.
        self.k_layers, self.v_layers = list(k.unbind(0)), list(v.unbind(0))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, last: int = 0, tree_parents: list[int] | None = None) -> torch.Tensor:
        """See HFKVModel.forward: logits [rows, V] for ``tokens`` at the next positions."""
        from .kv import tree_depths_and_ancestors

        n, start = tokens.shape[0], self.length
        end = start + n
        if tree_parents is None:
            positions, ancestors = torch.arange(start, end), None
        else:
            depth, ancestors = tree_depths_and_ancestors(tree_parents)
            positions = start + depth
        attend = (self._invariant_attention if self.invariant else self._attention)(start, positions, ancestors)
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        x = F.embedding(tokens, self.embed)  # [n, hidden]
        cos, sin = self.rotary(x, positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [n, 1, hd]: broadcast over heads
        # Rotary: x·cos + rotate_half(x)·sin, where rotate_half(x) = (−x₂, x₁) = roll(x, half)·(−1, +1).
        half = hd // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        tapped = []
        for i, (ln1, qkv, o_proj, ln2, gate_up, down) in enumerate(self.layers):
            # Attention: one fused q/k/v matmul, rotary on q and k, new k/v written at their positions.
            out = qkv(F.rms_norm(x, (self.hidden_size,), ln1, self.eps))
            qk = out[:, : (nh + nkv) * hd].view(n, nh + nkv, hd)  # q and k are adjacent: rotate them together
            qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)
            self.k_layers[i][:, start:end] = qk[:, nh:].transpose(0, 1)
            self.v_layers[i][:, start:end] = out[:, (nh + nkv) * hd:].view(n, nkv, hd).transpose(0, 1)
            x = o_proj(x, attend(i, qk[:, :nh]))  # x + o_proj(attention)
            # MLP: one fused gate/up matmul.
            gate, up = gate_up(F.rms_norm(x, (self.hidden_size,), ln2, self.eps)).chunk(2, dim=-1)
            x = down(x, F.silu(gate).mul_(up))  # x + down_proj(...)
            if i in self.taps:  # a fused EAGLE head also reads this layer's output (a new tensor: no copy)
                tapped.append(x)
        self.length = end
        # The final-normed rows of every new token (the LM head's input), kept for self-drafting heads
        # (Medusa, EAGLE): a reference, no copy; the norm is row-wise, so slicing after it is the same.
        self.hidden = x = F.rms_norm(x, (self.hidden_size,), self.final_norm, self.eps)
        if tapped:
            self.hidden = torch.cat([x, *tapped], dim=-1)
        if last:
            x = x[-last:]
        return self.lm_head(x).float()

    def _attention(self, start: int, positions: torch.Tensor, ancestors: torch.Tensor | None):
        """attend(layer, q [n, heads, hd]) → [n, heads·hd]: PyTorch's fused attention over the cache."""
        n = positions.shape[0]
        end = start + n
        self._ensure(end)
        if ancestors is None:
            # One new token attends to everything cached: no mask. A chain: causal within the new block.
            mask = None if n == 1 else torch.ones(n, end, dtype=torch.bool).tril_(start)
        else:
            mask = torch.ones(n, end, dtype=torch.bool)
            mask[:, start:] = ancestors
        if mask is not None:  # additive, built once: attention would convert a boolean mask in every layer
            mask = torch.zeros(n, end, dtype=self.dtype).masked_fill_(~mask, float("-inf"))

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], self.k_layers[i][:, :end][None], self.v_layers[i][:, :end][None],
                attn_mask=mask, scale=self.scaling, enable_gqa=self.n_kv != self.n_heads)
            return out[0].transpose(0, 1).reshape(n, -1)

        return attend

    def _invariant_attention(self, start: int, positions: torch.Tensor, ancestors: torch.Tensor | None):
        """Like :meth:`_attention`, with every row computed exactly as it would be alone (int8 models).

        int8 activations are rounded per row, so the 1e-7 differences that fp32 attention shows
        between a batched row and the same row alone (its kernels block the work by the number of rows
        and keys) flip roundings, which grow through the layers into logit differences as large as the
        quantization error itself (measured on SmolLM2: the argmax differed at 7 % of positions). The
        int8 matmuls are row-independent bit for bit; here attention is made so too: a row at position
        p attends over the first ceil((p+1)/64)·64 key slots (masked past p) with plain batched
        matmuls, whose per-row results do not depend on the number of rows; rows of one forward with
        different key lengths (a chain crossing a multiple of 64) go in two groups. Greedy speculative
        decoding then gives exactly the tokens of plain decoding. Costs about what fused attention does.

        Trees (:meth:`_invariant_tree_attention`): a node's ancestors sit in other cache slots than the
        same tokens decoded one by one would (siblings in between), and a reduction's rounding depends on
        where its terms sit; with the tree's own layout, the shipped EAGLE heads' greedy tokens left plain
        int8 decoding's within 15 tokens (seen in tests/test_heads.py before the fix).
        """
        if ancestors is not None:
            return self._invariant_tree_attention(start, positions, ancestors)
        n = positions.shape[0]
        end = start + n
        block = 64
        self._ensure(-(-end // block) * block)
        lengths = ((positions + block) // block * block).tolist()  # ceil((p + 1) / block) · block
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        rep = nh // nkv
        groups = []  # (first row, last row + 1, key length, additive mask [1, rows · rep, key length])
        a = 0
        for b in range(1, n + 1):
            if b == n or lengths[b] != lengths[a]:
                length = lengths[a]
                ok = torch.arange(length)[None, :] <= positions[a:b, None]
                mask = torch.zeros(b - a, length, dtype=self.dtype).masked_fill_(~ok, float("-inf"))
                groups.append((a, b, length, mask[:, None, :].expand(b - a, rep, length).reshape(1, -1, length)))
                a = b

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            outs = []
            for a, b, length, mask in groups:
                # [rows, nh, hd] → [nkv, rows · rep, hd]: the query rows of each KV head, one matmul per head.
                qg = (q if b - a == n else q[a:b]).reshape(b - a, nkv, rep, hd).transpose(0, 1).reshape(nkv, -1, hd)
                scores = torch.baddbmm(mask, qg, self.k_layers[i][:, :length].transpose(1, 2), alpha=self.scaling)
                out = torch.bmm(scores.softmax(dim=-1), self.v_layers[i][:, :length])
                outs.append(out.view(nkv, b - a, rep, hd).transpose(0, 1).reshape(b - a, nh * hd))
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        return attend

    def _invariant_tree_attention(self, start: int, positions: torch.Tensor, ancestors: torch.Tensor):
        """:meth:`_invariant_attention` for a tree (rows = [root] + nodes, ``ancestors`` [n, n]).

        The scores and the weighted sum of values run over the tree's own slots (each score is one dot
        product, wherever its key sits; the sum over slots adds the path's terms in the same order as
        plain decoding, the masked siblings' exact zeros in between). The softmax is the order-sensitive
        step: its row sums are vectorized across slots. So before it each row's tree slots are permuted
        into the layout plain decoding has at its position p — slots 0..start-1 (shared, left in place),
        its root-to-node path, then masked slots — and the weights are permuted back after it: a gather
        and a scatter over the n tree columns only. Rows run at the tree's width, which can be a 64-slot
        block wider than plain decoding's ceil((p+1)/64)·64 for a shallow node when a deeper one crosses
        a block: the extra masked slots add exact zeros to the same vector lanes. That neither the
        products nor these sums depend on more than the layout is a property of the CPU kernels, not a
        PyTorch guarantee: tests/test_int8.py checks random trees bit for bit, crossing a block too."""
        block = 64
        n = positions.shape[0]
        end = start + n
        width = -(-end // block) * block
        self._ensure(width)
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        rep = nh // nkv

        def per_score_row(t: torch.Tensor) -> torch.Tensor:  # [n, ...] → [1, n · rep, ...]: a row per query head
            return t[:, None].expand(n, rep, *t.shape[1:]).reshape(1, n * rep, *t.shape[1:])

        allowed = torch.zeros(n, width, dtype=torch.bool)
        allowed[:, :start] = True
        allowed[:, start:end] = ancestors
        tree_mask = per_score_row(torch.zeros(n, width, dtype=self.dtype).masked_fill_(~allowed, float("-inf")))
        # Row r's tree columns in plain decoding's order: its ancestors (itself included) in slot order —
        # parents precede children, so that is the root-to-node path — then the rest (masked).
        order = per_score_row(torch.sort((~ancestors).to(torch.uint8), dim=-1, stable=True).indices)
        order = order.expand(nkv, -1, -1)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            qg = q.reshape(n, nkv, rep, hd).transpose(0, 1).reshape(nkv, n * rep, hd)
            scores = torch.baddbmm(tree_mask, qg, self.k_layers[i][:, :width].transpose(1, 2), alpha=self.scaling)
            scores[..., start:end] = scores[..., start:end].gather(-1, order)  # into plain decoding's layout
            weights = scores.softmax(dim=-1)
            # Back to the tree's slots (the masked columns' weights are exact zeros wherever they go).
            weights[..., start:end] = torch.empty_like(weights[..., start:end]).scatter_(
                -1, order, weights[..., start:end])
            out = torch.bmm(weights, self.v_layers[i][:, :width])  # [nkv, n · rep, hd]
            return out.view(nkv, n, rep, hd).transpose(0, 1).reshape(n, nh * hd)

        return attend

    def keep(self, n_positions: int) -> None:
        # Positions past the length are simply overwritten by the next forward.
        self.length = min(self.length, n_positions)

    def keep_path(self, start: int, nodes: list[int]) -> None:
        src = start + torch.tensor(nodes, dtype=torch.long)
        m = len(nodes)
        self.k_cache[:, :, start: start + m] = self.k_cache[:, :, src]
        self.v_cache[:, :, start: start + m] = self.v_cache[:, :, src]
        self.length = start + m
