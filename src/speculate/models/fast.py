"""A lean decoder for Llama-family models (Llama, Qwen2, Mistral): plain functions over the same weights,
with a KV cache written by position (in the manner of gpt-fast; paged where the compiled attention runs:
models/paged.py).

Why: on these CPUs one SmolLM2 decode step spends ~21 ms in its linear layers and ~12 ms around them
(per-module Python, separate q/k/v and gate/up matmuls, rotary and norm ops, cache concatenation).
Here q/k/v and gate/up are fused into one matmul each, norms are one fused op, and the cache is a
preallocated buffer: a forward writes its new keys/values at their positions and rolling back is
moving a length back. The Hugging Face modules are re-pointed at views of the fused weights, so both
paths share one copy and the HF model stays usable (it is the reference in the tests).

The linear layers are callables: for fp32 and bf16, the compiled kernel's float layers over the fused weights
(blocks.FloatLinear: each row's sums in fp32 in a fixed order; ``F.linear`` where the kernel does not build), or,
for a model loaded with ``dtype="int8"`` or ``"q4"``, the fused layers that models/quantize.py or models/blocks.py
built (the HF modules are then views of those). These models also use an attention whose every sum runs in a
fixed order over a row's own keys (the compiled kernel of models/kernel.py, or integer sums in
models/exact_attention.py), so that a row's logits are the same bits whether it is verified with others or decoded
alone; models/exactness.py checks it at load.

:class:`LeanModel` is the model as computed here (fused layers, kernels, the exactness check's outcome), made once per
loaded model and shared by every generation; :class:`FastKVModel` is one generation's cache over it, with the
interface of :class:`speculate.models.kv.HFKVModel`: reset / forward / keep / keep_path.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..tree_shape import depths_and_ancestors
from . import exact_attention, exactness, kernel
from .blocks import BlockLinear, FloatLinear
from .paged import BLOCK, CopiedBlock, PagedCache, pool_for
from .forward import Rows
from .loader import LoadedModel
from .quantize import LinearPart, QuantizedLinear, is_quantized
from .support import SUPPORTED, float_kernel, supports  # noqa: F401 (supports, SUPPORTED: this module's API too)

def _fuse(modules: list[nn.Module]) -> Callable[[torch.Tensor], torch.Tensor]:
    """One callable computing the concatenated outputs of ``modules`` with one matmul.

    fp32: the weights (and biases) are concatenated and each module is pointed at its slice, so both
    paths share one copy. int8 and q4: quantize.py / blocks.py already fused them (the modules are parts of one
    layer)."""
    if all(type(m) is nn.Linear for m in modules):
        return partial(F.linear, **dict(zip(("weight", "bias"), _fused(modules))))
    if len(modules) == 1 and isinstance(modules[0], QuantizedLinear):
        return modules[0].matmul_2d
    if all(isinstance(m, LinearPart) for m in modules):
        whole, bounds = modules[0].whole, [0] + [m.stop for m in modules]
        if all(m.whole is whole and m.start == bounds[j] for j, m in enumerate(modules)) and \
                bounds[-1] == whole.out_features:  # the parts are the whole, in order: one matmul
            return whole.matmul_2d
    return lambda x: torch.cat([m(x) for m in modules], dim=-1)  # any other mix: correct, unfused


def _fused(modules: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of ``modules`` (plain linear layers) concatenated, the modules pointed at their slices (one copy
    for both paths)."""
    if len(modules) == 1:
        return modules[0].weight, modules[0].bias
    # Fused before (the same modules under another loaded model: layerskip's early-exit view shares the target's
    # layers): the weights are already consecutive rows of one tensor, so one view spans them, no copy.
    weight = _joined([m.weight for m in modules])
    bias = None if modules[0].bias is None else _joined([m.bias for m in modules])
    if weight is not None and (bias is not None or modules[0].bias is None):
        return weight, bias
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


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """One view over ``tensors`` where they are consecutive contiguous rows of one storage (what :func:`_fuse` made of
    them before), else None."""
    first = tensors[0]
    storage, at = first.untyped_storage().data_ptr(), first.data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != storage or t.data_ptr() != at:
            return None
        at += t.numel() * t.element_size()
    rows = sum(t.shape[0] for t in tensors)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _whole(module: nn.Module) -> nn.Module:
    """The fused layer a :class:`LinearPart` belongs to, or the module itself."""
    return module.whole if isinstance(module, LinearPart) else module


def _residual(module: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``f(residual, x) = residual + module(x)`` with the sum fused into the matmul (o_proj, down_proj)."""
    if type(module) is nn.Linear:
        w_t, b = module.weight.t(), module.bias
        if b is None:
            return lambda residual, x: torch.addmm(residual, x, w_t)
        return lambda residual, x: torch.addmm(residual, x, w_t).add_(b)
    if isinstance(module, QuantizedLinear):
        return module.add_matmul_2d
    return lambda residual, x: residual + module(x)


def cache_layout(model: nn.Module, exact: bool | None = None) -> tuple[bool, object, str, torch.dtype]:
    """(invariant, the attention kernel or None, the attention: "kernel" / "integer" / "fused", the cache's dtype) of
    a lean model (FastKVModel.__init__ explains each); the cache of "integer" attention is float64 with one more
    column a head (a scale)."""
    dtype = model.model.embed_tokens.weight.dtype
    invariant = any(is_quantized(m) for m in model.modules()) or float_kernel(model) if exact is None else exact
    kern = kernel.load() if invariant or (exact is None and dtype == torch.float32) else None
    attention = "kernel" if kern else "integer" if invariant else "fused"
    # (the kernel's caches are fp32, whatever the weights: a bf16 model through the kernel computes in fp32)
    cache = torch.float64 if attention == "integer" else torch.float32 if attention == "kernel" else dtype
    return invariant, kern, attention, cache


class LeanModel:
    """A loaded Llama-family model as the lean path computes with it: the fused linear layers, the q4 kernels'
    blocks, the attention and cache layout, the exactness check's outcome. Built once per loaded model (and attention
    choice: :func:`lean_model`) and not changed after; every generation's cache (:class:`FastKVModel`) computes
    through it."""

    def __init__(self, loaded: LoadedModel, exact: bool | None = None):
        """``exact``: batch-invariant attention (default: for int8 and q4 models, whose other ops are row-independent
        too; fp32 models get the kernel too, bf16 PyTorch's); False gives them PyTorch's fused attention
        (benchmarks/probes/attention_cost.py compares)."""
        model = loaded.model
        cfg = model.config
        self.loaded, self.model, self.config = loaded, model, cfg
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm, self.eps = inner.norm.weight, inner.norm.variance_epsilon
        self.rotary = inner.rotary_emb
        # Rotary types whose frequencies follow the sequence's length (dynamic NTK, longrope) are computed per forward;
        # the others' rows come from a table (``_rope``).
        rope_type = getattr(self.rotary, "rope_type", "default")
        self._rope_static = "dynamic" not in rope_type and rope_type != "longrope"
        self._rope_table = None  # (cos, sin) [m, hd] for positions 0..m-1
        attn0 = inner.layers[0].self_attn
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = attn0.head_dim
        self.scaling = attn0.scaling
        self.hidden_size = cfg.hidden_size
        # fp32 and bf16 through the kernel (FloatLinear over the fused weights, no copy) where it builds, unless
        # PyTorch's attention is asked for (exact=False: the comparisons of benchmarks/probes/attention_cost.py).
        # A bf16 model then computes in fp32 from its bf16 weights (each widened exactly): activations, norms,
        # rotary and caches in fp32, as fp32's.
        floats = exact is not False and float_kernel(model)
        if floats:
            self.final_norm = self.final_norm.float()
        self.layers, float_layers = [], []
        for layer in inner.layers:
            a, mlp = layer.self_attn, layer.mlp
            if floats:
                qkv, o, gate_up, down = (FloatLinear(*_fused(ms)) for ms in (
                    [a.q_proj, a.k_proj, a.v_proj], [a.o_proj], [mlp.gate_proj, mlp.up_proj], [mlp.down_proj]))
                float_layers.append((qkv, o, gate_up, down))
                self.layers.append((layer.input_layernorm.weight.float(), qkv.matmul_2d, o.add_matmul_2d,
                                    layer.post_attention_layernorm.weight.float(), gate_up.matmul_2d,
                                    down.add_matmul_2d))
                continue
            # Callables: F.linear on fused fp32 weights, or the fused quantized layers (models/quantize.py, blocks.py).
            # o_proj and down_proj also add their input's residual (one op).
            self.layers.append((layer.input_layernorm.weight, _fuse([a.q_proj, a.k_proj, a.v_proj]),
                                _residual(a.o_proj), layer.post_attention_layernorm.weight,
                                _fuse([mlp.gate_proj, mlp.up_proj]), _residual(mlp.down_proj)))
        # (a tied LM head is the embedding's own tensor: FloatLinear reads it in place)
        self.lm_head = FloatLinear(*_fused([model.lm_head])).matmul_2d if floats else _fuse([model.lm_head])
        # Greedy rows' head: the logits that may be a row's greatest, the others -inf (BlockLinear.argmax_matmul_2d),
        # where the head's blocks have no offset terms (the default model's Q8_0, the Qwen's Q6_K) and it runs two
        # passes (``argmax_runs``, asked at each call: a probe may set the passes after this).
        head = _whole(model.lm_head)
        self.argmax_head = head if isinstance(head, BlockLinear) else None
        if self.argmax_head is not None and head.argmax_runs():
            head.l1()  # (its bound's table, made now rather than in a request's first round: 0.3 s, the Qwen 1.5B's 3 s)
        self.vocab_size = model.lm_head.out_features
        self.dtype = torch.float32 if floats else self.embed.dtype  # (what the layers compute in)
        # int8, q4, and fp32 and bf16 through the kernel: an attention whose rows do not depend on the other rows of
        # a forward, so that a row's logits are the same bits verified with others or decoded alone: the compiled
        # kernel (models/kernel.py, exact fp32 arithmetic in a fixed order), else integer sums in PyTorch ops
        # (models/exact_attention.py). bf16 without a C compiler (or any model): PyTorch's fused attention. fp32 with
        # PyTorch's matmuls (exact=False) uses the kernel too where it builds, not for exactness (those matmuls are
        # not row-independent) but because it takes every generation of a batched forward in one call a layer.
        self.invariant, self.kernel, self.attention, self.cache_dtype = cache_layout(model, exact)
        self.exact_bits = exact_attention.budgets(self.head_dim, loaded.context_window)
        # The kernel's caches are paged (models/paged.py): block tables over the model's pool, whose blocks the
        # prefix store and other generations may share. The PyTorch attentions keep one contiguous buffer each.
        self.pool = pool_for(model, len(self.layers), self.n_kv, self.head_dim) if self.attention == "kernel" else None
        # q4 and fp32: each layer in five kernel calls (norms, rotary, cache writes and SiLU inside them;
        # _block_layers).
        self.blocks = None
        if self.attention == "kernel" and kernel.load_rope():
            wholes = float_layers or [[_whole(m) for m in (a.q_proj, a.o_proj, mlp.gate_proj, mlp.down_proj)]
                                    for a, mlp in ((layer.self_attn, layer.mlp) for layer in inner.layers)]
            if all(isinstance(w, BlockLinear) for ws in wholes for w in ws):
                self.blocks = [(layer.input_layernorm.weight.float().contiguous(), qkv, o,
                                layer.post_attention_layernorm.weight.float().contiguous(), gate_up, down)
                               for layer, (qkv, o, gate_up, down) in zip(inner.layers, wholes)]
                self._final_norm_weight = self.final_norm.float().contiguous()  # (_final_norm's)
        # ...and, where it builds, all layers in one call (kernels/decoder.c: the same calls, without the Python).
        self.decoder = kernel.load_decoder() if self.blocks is not None else None
        self.structs = self._layer_structs() if self.decoder is not None else None  # (its layer_t array)
        # Whether a batched forward gives each row the bits it gets alone is checked once per loaded model on
        # this machine (models/exactness.py, by :func:`lean_model`); where not, rows run one at a time (exact).
        self.row_by_row = False

    @torch.inference_mode()
    def forward_many(self, items: list[Rows]) -> list[torch.Tensor | None]:
        """One forward over the rows of several generations, each with its own cache (``item.kv``: FastKVModels
        over this model): the linear layers and the LM head run once over all rows, attention runs per
        generation over its own cache. Returns each item's logits (its last ``want`` rows; None: all; 0: no
        logits, a prefill chunk) and sets each item's ``kv.hidden``.

        Exact where the model is batch-invariant (int8, q4: every op computes a row from that row alone,
        checked at load): a row's bits are the same whichever other generations share the forward."""
        segments = [_segment(item) for item in items]
        if not self.row_by_row or all(len(s.tokens) == 1 for s in segments):
            x = self._layers(segments)
        else:
            # The exact fallback (the load-time self-check found batched rows differing on this machine): each
            # row alone, through the same one-row calls as plain decoding, over the slots it may see.
            x = torch.cat([self._layers([_Segment(s.kv, s.tokens[j: j + 1], s.positions[j: j + 1], s.start + j,
                                                  None if s.allowed is None else s.allowed[j: j + 1, : s.start + j + 1])])
                           for s in segments for j in range(len(s.tokens))])
        heads, lo = [], 0
        for s, item in zip(segments, items):
            n = len(s.tokens)
            s.kv.hidden = _hidden(x[lo: lo + n], s.kv.taps, self.hidden_size, self.taps_of(segments))
            rows = n if item.want is None else min(item.want, n)
            heads.append(x[lo + n - rows: lo + n, : self.hidden_size])
            lo += n
        # The final-normed rows (the LM head's input) stay in ``kv.hidden`` for self-drafting heads (Medusa, EAGLE):
        # references, no copy; the norm is row-wise, so slicing after it is the same.
        wanted = torch.cat(heads) if len(heads) > 1 else heads[0]
        logits = self._head(wanted, [item.argmax for item, h in zip(items, heads) for _ in range(h.shape[0])])
        out, lo = [], 0
        for item, h in zip(items, heads):
            out.append(logits[lo: lo + h.shape[0]] if item.want != 0 else None)
            lo += h.shape[0]
        return out

    def _head(self, x: torch.Tensor, argmax: list[bool]) -> torch.Tensor:
        """The LM head's logits for the rows ``x``. A row of which only the argmax is read (``argmax[row]``,
        ``Rows.argmax``) goes through :attr:`argmax_head` where the model has one: the same argmax by construction,
        the second activation pass only where a logit may be the greatest. Each row on its own, so splitting the
        rows between the two heads changes no row's values."""
        if not x.shape[0]:
            return x.new_zeros(0, self.vocab_size).float()
        head = self.argmax_head
        if head is None or not any(argmax) or not head.argmax_runs():
            return self.lm_head(x).float()
        if all(argmax):
            return head.argmax_matmul_2d(x)[0]
        pick = torch.tensor(argmax)
        out = torch.empty(x.shape[0], self.vocab_size)
        out[pick] = head.argmax_matmul_2d(x[pick])[0]
        out[~pick] = self.lm_head(x[~pick]).float()
        return out

    @staticmethod
    def taps_of(segments) -> tuple[int, ...]:
        """The layers whose outputs any generation of a forward reads (EAGLE-3), in order."""
        return tuple(sorted({t for s in segments for t in s.kv.taps}))

    def _layers(self, segments: list[_Segment]) -> torch.Tensor:
        """The decoder over the new rows of every segment (each at its cache's slots start..), then each cache's
        ``length`` moves past them. Returns the final-normed rows, followed (EAGLE-3) by the outputs of the layers
        any segment taps (:meth:`taps_of`)."""
        if self.blocks is not None:
            return self._block_layers(segments)
        tokens, positions = _concat(segments)
        taps = self.taps_of(segments)
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        n = tokens.shape[0]
        x = F.embedding(tokens, self.embed).to(self.dtype)  # [n, hidden]
        cos, sin = self._rope(x, positions)  # [n, hd]
        if self.attention == "kernel":  # rotary, cache writes and attention of every segment: one call a layer
            cos, sin = cos.float().contiguous(), sin.float().contiguous()
            segs, masks = _kernel_segments(segments)  # (masks: kept alive for the calls that point into them)
        else:
            attends = [s.kv._attention(s.start, s.allowed) for s in segments]
            cos, sin = cos[:, None, :], sin[:, None, :]  # [n, 1, hd]: broadcast over heads
            # Rotary: x·cos + rotate_half(x)·sin, where rotate_half(x) = (−x₂, x₁) = roll(x, half)·(−1, +1).
            half = hd // 2
            sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        tapped = []
        for i, (ln1, qkv, o_proj, ln2, gate_up, down) in enumerate(self.layers):
            # Attention: one fused q/k/v matmul over all rows...
            out = qkv(F.rms_norm(x, (self.hidden_size,), ln1, self.eps))
            if self.attention == "kernel":
                attention = kernel.attention_many(out, cos, sin, segs, i, nh, nkv, hd, self.scaling)
            else:
                # ...rotary on q and k (adjacent: rotated together), then each generation writes its new k/v at its
                # positions and attends over its own cache.
                qk = out[:, : (nh + nkv) * hd].view(n, nh + nkv, hd)
                qk = torch.addcmul(qk * cos, qk.roll(half, dims=-1), sin)
                v = out[:, (nh + nkv) * hd:].view(n, nkv, hd)
                parts, lo = [], 0
                for s, attend in zip(segments, attends):
                    hi = lo + len(s.tokens)
                    s.kv._write(i, s.start, qk[lo:hi, nh:], v[lo:hi])
                    parts.append(attend(i, qk[lo:hi, :nh]))
                    lo = hi
                attention = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = o_proj(x, attention)  # x + o_proj(attention)
            # MLP: one fused gate/up matmul.
            gate, up = gate_up(F.rms_norm(x, (self.hidden_size,), ln2, self.eps)).chunk(2, dim=-1)
            x = down(x, F.silu(gate).mul_(up))  # x + down_proj(...)
            if i in taps:  # a fused EAGLE head also reads this layer's output (a new tensor: no copy)
                tapped.append(x)
        for s in segments:
            s.kv.length = s.start + len(s.tokens)
        x = F.rms_norm(x, (self.hidden_size,), self.final_norm, self.eps)
        return torch.cat([x, *tapped], dim=-1) if tapped else x

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [n, hd] (``x``'s dtype) at ``positions``: rows of a table that the model's own rotary module
        computed, each position once, and never again (the table grows by new positions only). So a position's values
        are the same in any forward, whatever other rows it holds: by construction, not by the vector cos and sin
        treating every call's shape alike. It also spares each forward the module's call (docs/benchmarks.md, "Around
        the forward"). Rotary types whose frequencies follow the length: the module, per forward."""
        if not self._rope_static:
            cos, sin = self.rotary(x, positions[None])
            return cos[0], sin[0]
        have = 0 if self._rope_table is None else self._rope_table[0].shape[0]
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > have:  # the new positions only, up to a power of two (at least 1024): a few growths a generation
            new = torch.arange(have, max(1024, 1 << (need - 1).bit_length()))
            cos, sin = self.rotary(x[:1], new[None])
            old = self._rope_table or (cos[0, :0], sin[0, :0])
            self._rope_table = torch.cat([old[0], cos[0]]), torch.cat([old[1], sin[0]])
        cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def _block_layers(self, segments: list[_Segment]) -> torch.Tensor:
        """:meth:`_layers` for q4 models: per layer, four compiled calls (kernels/blocks.c; attention.c for every
        generation's rotary, cache writes and attention at once) and no PyTorch op between them; every one computes
        a row from that row alone. Without taps, all layers run in one call to kernels/decoder.c, which makes the
        same calls in C."""
        tokens, positions = _concat(segments)
        eps, nh = self.eps, self.n_heads
        x = F.embedding(tokens, self.embed).to(self.dtype)  # [n, hidden] (a bf16 model's rows widened: exact)
        cos, sin = self._rope(x, positions)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()  # [n, hd]
        taps = self.taps_of(segments)
        segs, masks = _kernel_segments(segments)  # (masks: kept alive for the calls that point into them)
        if self.decoder is not None and not taps:
            x = x.float().contiguous()
            rc = self.decoder(ctypes.addressof(self.structs), len(self.blocks), x.data_ptr(), x.shape[0],
                              self.hidden_size, nh, self.n_kv, self.head_dim, cos.data_ptr(), sin.data_ptr(),
                              ctypes.addressof(segs), len(segs), self.scaling, eps, torch.get_num_threads())
            if rc:
                raise RuntimeError(f"decoder kernel failed ({rc})")
        else:
            tapped = []
            for i, (ln1, qkv, o_proj, ln2, gate_up, down) in enumerate(self.blocks):
                out = qkv.norm_matmul_2d(x, ln1, eps)  # RMSNorm + fused q/k/v, all rows
                attention = kernel.attention_many(out, cos, sin, segs, i, nh, self.n_kv, self.head_dim, self.scaling)
                x = o_proj.add_matmul_2d(x, attention)  # x + o_proj(attention)
                x = down.add_silu_matmul_2d(x, gate_up.norm_matmul_2d(x, ln2, eps))  # x + down(silu(gate) · up)
                if i in taps:
                    tapped.append(x)
        for s in segments:
            s.kv.length = s.start + len(s.tokens)
        x = self._final_norm(x)
        return torch.cat([x, *tapped], dim=-1) if taps else x

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The model's final RMSNorm over the rows ``x`` [n, hidden] (float32) on the block path, by the kernels'
        (kernels/blocks.c, ``speculate_rms_rows``: the layers' own norm arithmetic, each row on its own by
        construction). PyTorch's ``rms_norm`` took ~0.2 ms of a decode step here (docs/benchmarks.md, "Around the
        forward, cold")."""
        x = x.float().contiguous()
        out = torch.empty_like(x)
        kernel.function("speculate_rms_rows")(x.data_ptr(), x.shape[0], x.shape[1], self._final_norm_weight.data_ptr(),
                                              self.eps, out.data_ptr())
        return out

    def _layer_structs(self):
        """kernels/decoder.c's layer_t array (the weights' pointers)."""
        layers = (kernel.Layer * len(self.blocks))()
        for i, (ln1, qkv, o_proj, ln2, gate_up, down) in enumerate(self.blocks):
            layers[i] = kernel.Layer(ln1=ln1.data_ptr(), ln2=ln2.data_ptr(), qkv=qkv.struct(), o=o_proj.struct(),
                                     gate_up=gate_up.struct(), down=down.struct())
        return layers


_leans_lock = threading.Lock()


def lean_model(loaded: LoadedModel, exact: bool | None = None) -> LeanModel:
    """``loaded``'s lean model for the attention ``exact`` chooses: made once per loaded model, then shared. Its
    exactness is checked here, once, on this machine (models/exactness.py)."""
    with _leans_lock:
        leans = loaded.shared.setdefault("lean", {})
        lean = leans.get(exact)
        if lean is None:  # (shared only once checked: a check that raises leaves nothing half-made behind)
            lean = LeanModel(loaded, exact)
            if lean.invariant:
                lean.row_by_row = not exactness.check(FastKVModel(loaded, exact, lean))
            leans[exact] = lean
        return lean


class FastKVModel:
    """One generation's KV cache on a :class:`LeanModel`: its positions (blocks of the model's pool, or one contiguous
    buffer), its length and the hidden rows of its last forward. Cheap to make: one per request."""

    def __init__(self, loaded: LoadedModel, exact: bool | None = None, lean: LeanModel | None = None):
        """``exact``: :class:`LeanModel`'s; ``lean``: the lean model itself (default: ``loaded``'s, shared)."""
        self.lean = lean = lean or lean_model(loaded, exact)
        self.loaded, self.model, self.config, self.vocab_size = loaded, lean.model, lean.config, lean.vocab_size
        self.hidden = None  # after each forward: final-normed hidden rows [n_new, H] (the LM head's input)
        self.taps: tuple[int, ...] = ()  # decoder layers whose outputs follow them in ``hidden`` (EAGLE-3)
        self.length = 0
        self.k_cache = self.v_cache = None
        self.paged = PagedCache(lean.pool) if lean.pool is not None else None

    @property
    def invariant(self) -> bool:
        return self.lean.invariant

    @property
    def attention(self) -> str:
        return self.lean.attention

    @property
    def row_by_row(self) -> bool:
        """The lean model's: rows run one at a time (the exactness check failed on this machine)."""
        return self.lean.row_by_row

    @row_by_row.setter
    def row_by_row(self, value: bool) -> None:  # (models/exactness.py sets it while it checks the batched path)
        self.lean.row_by_row = value

    # ---------------------------------------------------------------------------------------------
    def reset(self, capacity: int = 256) -> None:
        """Start a new generation, the cache empty (the prefix store may then fill some of it)."""
        self.length = 0
        self._ensure(capacity, exact=True)  # (what the generation may need: its growth, if any, doubles)

    @property
    def nbytes(self) -> int:
        """Bytes of the cache held (a block shared with others counts for each holder; :attr:`own_bytes` does not)."""
        if self.paged is not None:
            return self.paged.nbytes
        return 0 if self.k_cache is None else self.k_cache.nbytes + self.v_cache.nbytes

    @property
    def own_bytes(self) -> int:
        """Bytes of the cache that it alone holds: not the blocks it maps from the prefix store (counted by the
        store's budget; the server's --kv-memory counts a running request by this)."""
        return self.paged.own_bytes if self.paged is not None else self.nbytes

    @property
    def capacity(self) -> int:
        """Positions the cache holds room for."""
        if self.paged is not None:
            return self.paged.capacity
        return 0 if self.k_cache is None else self.k_cache.shape[2]

    def ensure(self, positions: int) -> None:
        """Allocate the cache for ``positions`` positions now, no more (rounded to the kernel's key blocks): the
        server's admission by memory reserves a stretch at a time (server/scheduler.py)."""
        self._ensure(positions, exact=True)

    def _ensure(self, needed: int, exact: bool = False) -> None:
        """Room for positions < needed; keeps what is cached. Paged: blocks appended. Contiguous: the buffers grown
        (doubling, unless ``exact``) and copied."""
        if self.paged is not None:
            self.paged.ensure(needed)
            return
        have = self.capacity
        if needed <= have:
            return
        lean = self.lean
        size = -(-(needed if exact else max(needed, 2 * have, 256)) // BLOCK) * BLOCK
        width = lean.head_dim + (lean.attention == "integer")  # integer sums: + a scale column
        shape = (len(lean.layers), lean.n_kv, size, width)
        k, v = torch.zeros(shape, dtype=lean.cache_dtype), torch.zeros(shape, dtype=lean.cache_dtype)
        if have and self.length:
            k[:, :, : self.length] = self.k_cache[:, :, : self.length]
            v[:, :, : self.length] = self.v_cache[:, :, : self.length]
        self.k_cache, self.v_cache = k, v
        # Per-layer views, made once per buffer: indexing the 4-D buffer by layer costs an op per access.
        self.k_layers, self.v_layers = list(k.unbind(0)), list(v.unbind(0))

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, last: int = 0, tree_parents: list[int] | None = None) -> torch.Tensor:
        """See HFKVModel.forward: logits [rows, V] for ``tokens`` at the next positions."""
        return self.forward_many([Rows(self, tokens, tree_parents, last or None)])[0]

    def forward_many(self, items: list[Rows]) -> list[torch.Tensor | None]:
        """:meth:`LeanModel.forward_many` (``items``: caches over this one's model)."""
        return self.lean.forward_many(items)

    def _write(self, i: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """New keys and values [n, KV heads, hd] of layer i into this cache at slots start.. (the PyTorch paths)."""
        if self.attention == "integer":  # integers and their scale (models/exact_attention.py)
            exact_attention.write(self.k_layers[i], start, k, exact_attention.B_K)
            exact_attention.write(self.v_layers[i], start, v, exact_attention.B_V)
        else:
            end = start + k.shape[0]
            self.k_layers[i][:, start:end] = k.transpose(0, 1)
            self.v_layers[i][:, start:end] = v.transpose(0, 1)

    def _attention(self, start: int, allowed: torch.Tensor | None):
        """attend(layer, q [n, heads, hd]) → [n, heads·hd] over slots 0..end-1, row r seeing the slots where
        ``allowed[r]`` (None: all). quantized models: exact integer sums (models/exact_attention.py), so a row's
        result does not depend on the other rows or on where its keys sit; fp32: PyTorch's fused attention."""
        lean = self.lean
        end = allowed.shape[1] if allowed is not None else start + 1
        if lean.attention == "integer":
            bits, scaling = lean.exact_bits, lean.scaling
            return lambda i, q: exact_attention.attend(q, self.k_layers[i][:, :end], self.v_layers[i][:, :end],
                                                       allowed, scaling, bits)
        # Additive, built once: attention would convert a boolean mask in every layer.
        mask = None if allowed is None else \
            torch.zeros(allowed.shape, dtype=lean.dtype).masked_fill_(~allowed, float("-inf"))

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], self.k_layers[i][:, :end][None], self.v_layers[i][:, :end][None],
                attn_mask=mask, scale=lean.scaling, enable_gqa=lean.n_kv != lean.n_heads)
            return out[0].transpose(0, 1).reshape(q.shape[0], -1)

        return attend

    def keep(self, n_positions: int) -> None:
        # Positions past the length are simply overwritten by the next forward.
        self.length = min(self.length, n_positions)

    @torch.inference_mode()  # the buffers may have been made (grown) inside a forward
    def keep_path(self, start: int, nodes: list[int]) -> None:
        if self.paged is not None:
            self.paged.move_rows([start + j for j in nodes], start)
        else:
            src = start + torch.tensor(nodes, dtype=torch.long)
            m = len(nodes)
            self.k_cache[:, :, start: start + m] = self.k_cache[:, :, src]
            self.v_cache[:, :, start: start + m] = self.v_cache[:, :, src]
        self.length = start + len(nodes)

    # Prompt blocks shared across generations (models/prefix_store.py): a paged cache hands out and maps its very
    # blocks; a contiguous one copies rows out and in.
    shares_prefixes = True

    @torch.inference_mode()
    def rows(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of positions start..start+n-1: keys and values [layers, kv heads, n, width] (tests compare caches
        by it, whatever their layout)."""
        if self.paged is not None:
            keys, values = self.paged.rows(start, n)
            return keys.transpose(2, 3).contiguous(), values
        return self.k_cache[:, :, start: start + n].clone(), self.v_cache[:, :, start: start + n].clone()

    @torch.inference_mode()
    def export_block(self, start: int, n: int):
        """Positions start..start+n-1 (one block of the store) for the prefix store to hold: the cache's own block,
        shared (paged, where the store's blocks are the cache's), or a copy."""
        if self.paged is not None:
            if start % BLOCK == 0 and n == BLOCK:
                return self.paged.block(start // BLOCK)
            return CopiedBlock(*self.paged.rows(start, n))
        return CopiedBlock(*self.rows(start, n))

    @torch.inference_mode()
    def import_block(self, start: int, block, n: int | None = None) -> None:
        """Hold :meth:`export_block`'s block at positions start.. (mapped where paged, copied otherwise); ``n``: its
        first n positions only (copied: the rest of the block is another prompt's)."""
        whole = block.values.shape[2]
        n = whole if n is None else n
        if self.paged is not None and not isinstance(block, CopiedBlock) and n == whole:
            self.paged.map(start // BLOCK, block)
        elif self.paged is not None:  # (keys transposed, as the kernel reads them: positions last)
            self.paged.write(start, block.keys[..., :n], block.values[:, :, :n])
        else:
            self._ensure(start + n)
            self.k_cache[:, :, start: start + n] = block.keys[:, :, :n]
            self.v_cache[:, :, start: start + n] = block.values[:, :, :n]
        self.length = max(self.length, start + n)


@dataclass
class _Segment:
    """One generation's rows inside a forward: its cache, tokens, their positions and mask."""
    kv: FastKVModel
    tokens: torch.Tensor
    positions: torch.Tensor
    start: int  # the cache slot of the first new row
    allowed: torch.Tensor | None  # [n, start + n] which slots each row sees; None: one row, all of them


def _segment(item: Rows) -> _Segment:
    """Grow the item's cache for its rows, and lay them out: a chain causal within the new block, a tree by its
    ancestor mask at tree positions."""
    kv, tokens = item.kv, item.tokens
    n, start = tokens.shape[0], kv.length
    end = start + n
    kv._ensure(end)
    if kv.paged is not None:
        kv.paged.writable(start, end)  # (a block shared with the prefix store or another request is copied first)
    if item.tree_parents is None:
        positions = torch.arange(start, end)
        # One new token attends to everything cached: no mask. A chain: causal within the new block.
        allowed = None if n == 1 else torch.ones(n, end, dtype=torch.bool).tril_(start)
    else:
        depth, ancestors = depths_and_ancestors(item.tree_parents)
        positions = start + depth - 1  # (depth 1: a child of the cached prefix)
        allowed = torch.ones(n, end, dtype=torch.bool)
        allowed[:, start:] = ancestors
    return _Segment(kv, tokens, positions, start, allowed)


def _kernel_segments(segments: list[_Segment]):
    """The kernel's segment_t array for a forward's segments (their block tables; and the masks it points into)."""
    return kernel.segments([(len(s.tokens), s.allowed.shape[1] if s.allowed is not None else s.start + len(s.tokens),
                             s.start, s.allowed, *s.kv.paged.pointers(), s.kv.paged.pool.layer_floats)
                            for s in segments])


def _concat(segments: list[_Segment]) -> tuple[torch.Tensor, torch.Tensor]:
    if len(segments) == 1:
        return segments[0].tokens, segments[0].positions
    return torch.cat([s.tokens for s in segments]), torch.cat([s.positions for s in segments])


def _hidden(x: torch.Tensor, taps: tuple[int, ...], width: int, computed: tuple[int, ...]) -> torch.Tensor:
    """A generation's ``hidden``: its final-normed rows, then the outputs of the layers it taps (of those the
    forward ``computed``, which may be more)."""
    if taps == computed:
        return x
    return torch.cat([x[:, :width], *(x[:, width * (1 + computed.index(t)): width * (2 + computed.index(t))]
                                      for t in taps)], dim=-1)
