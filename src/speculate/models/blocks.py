"""``dtype="q4"``: the GGUF file's own quantized blocks, run as they are (Q4_0, Q4_1, Q8_0, the k-quants Q4_K and
Q6_K; Q5_0 read into Q8_0 exactly).

Why: the default model ships as a Q4_1 GGUF (its LM head, the tied embedding, as Q8_0); our fp32 weights are
those blocks de-quantized. Reading the blocks themselves loses nothing against the file and reads ~0.7x the bytes
of int8 per step (the layers at 5 bits a weight, the head at 8.5), and a decode step is bound by reading weights.
The matmul is a compiled kernel (kernels/blocks.c) that quantizes each row of activations to int8 per block of
32, as llama.cpp does for these formats, and sums every (row, output) pair in one fixed order: a row's logits
are the same bits whatever the other rows of the forward are, so greedy speculative decoding is exact here too
(with the batch-invariant attention of kernel.py; models/exactness.py checks the whole model at load).

The kernel reads each type as :func:`fields` unpacks it (scales, and the quants in units of 4 bytes), interleaved for
groups of outputs (:func:`interleave`); a fused layer whose members have different types (the Qwen 1.5B's q and k
in Q4_K, its v in Q6_K) is a layer of parts. Where the blocks come from: for a model alias, the GGUF tensors
themselves, each matched row for row against the
weights the converter de-quantized from the same file (they must be equal bit for bit: this checks the reading,
and finds the row order — the llama converter permutes q and k rows); for any other model folder, its fp32
weights quantized with llama.cpp's rules (Q4_1 per 32 weights: d = (max - min) / 15, m = min; the LM head Q8_0).
The blocks are cached once (atomic, checksummed) like the int8 tensors.

The same kernel also runs dtype fp32's and bf16's layers (:class:`FloatLinear`: the model's own float weights,
nothing quantized, each output's sums in one fixed order), for the same reason: rows that do not depend on each
other.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import SpeculateError
from . import kernel
from .quantize import LinearPart, QuantizedLinear, plan

FORMAT = 2  # bump when the meaning of the cached tensors changes
QK = 32  # weights a block
# ggml type number, weights a block, bytes a block (the K types: super-blocks of 256)
TYPES = {"Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q8_0": (8, 32, 34), "Q4_K": (12, 256, 144), "Q6_K": (14, 256, 210)}
CONVERTED = {"Q5_0": "Q8_0"}  # read exactly into another type: 5-bit values fit int8, with the same fp16 scale


def require_kernel():
    """The compiled matmul (kernels/blocks.c), or a clear error where it cannot be built."""
    fn = kernel.function("speculate_block_matmul")
    if fn is None:
        raise SpeculateError("dtype q4 needs a C compiler (cc) to build its kernel; use int8 or fp32")
    return fn


def available() -> bool:
    """Whether the kernel builds here (a C compiler, and SPECULATE_NO_KERNEL unset)."""
    try:
        require_kernel()
    except SpeculateError:
        return False
    return True


def group() -> int:
    """Outputs a vector of the compiled kernel holds (16 with AVX-512, else 8): the interleaving of its layout."""
    require_kernel()
    return kernel.function("speculate_block_group")()


def fields(raw: torch.Tensor, kind: str) -> list[torch.Tensor]:
    """GGUF blocks [out, blocks · bytes] → the fields the kernel reads, each [out, blocks, ..., unit bytes], in its
    order (kernels/blocks.c: "Formats", "K types"). Q4_0/Q4_1/Q8_0: d, (m), the quants in units of 4 bytes. Q4_K: d,
    dmin, the 8 six-bit scales and mins unpacked, the nibbles of each block of 32 in Q4_1's order. Q6_K: d, the 16
    int8 scales, the low 4 bits of each block of 32 in Q4_1's order, their high 2 bits in two words per block."""
    _, elems, size = TYPES[kind]
    out = raw.shape[0]
    b = raw.reshape(out, -1, size)
    n = b.shape[1]
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        ns = 2 if kind == "Q4_1" else 1
        return [b[..., 2 * i: 2 * i + 2] for i in range(ns)] + [b[..., 2 * ns:].reshape(out, n, -1, 4)]
    if kind == "Q4_K":
        sc12 = b[..., 4:16].reshape(out, n, 3, 4)
        dd, mm, md = sc12[..., 0, :], sc12[..., 1, :], sc12[..., 2, :]  # ggml's get_scale_min_k4
        sc = torch.cat([dd & 63, (md & 15) | ((dd >> 2) & 48)], -1)
        m = torch.cat([mm & 63, (md >> 4) | ((mm >> 2) & 48)], -1)
        qs = b[..., 16:].reshape(out, n, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)
        q = (qs & 15).reshape(out, n, 8, 32)  # block j: chunk j // 2, low (even j) or high nibbles
        nibbles = q[..., :16] | (q[..., 16:] << 4)
        return [b[..., 0:2], b[..., 2:4], sc[..., None], m[..., None], nibbles.reshape(out, n, 8, 4, 4)]
    if kind == "Q6_K":
        ql = b[..., :128].reshape(out, n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)
        qh = b[..., 128:192].reshape(out, n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)
        q = (ql & 15).reshape(out, n, 8, 32) | ((qh & 3).reshape(out, n, 8, 32) << 4)  # 6-bit, element 32 j + e
        low = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)
        hi = q >> 4
        lo_half, hi_half = hi[..., :16].reshape(out, n, 8, 2, 2, 4), hi[..., 16:].reshape(out, n, 8, 2, 2, 4)
        words = lo_half[..., 0, :] | (hi_half[..., 0, :] << 2) | (lo_half[..., 1, :] << 4) | (hi_half[..., 1, :] << 6)
        return [b[..., 208:210], b[..., 192:208][..., None], low.reshape(out, n, 8, 4, 4), words]
    raise SpeculateError(f"block type {kind} is not supported (supported: {', '.join(TYPES)})")


def _field_shapes(kind: str) -> list[tuple[int, ...]]:
    """The trailing shape of each of :func:`fields`' tensors (read off one zero block)."""
    return [tuple(f.shape[2:]) for f in fields(torch.zeros(1, TYPES[kind][2], dtype=torch.uint8), kind)]


SLICE = 2048  # outputs :func:`interleave` lays out at a time
#: Block types whose second activation pass adds no offset term: BlockLinear.argmax_matmul_2d takes them.
ARGMAX_TYPES = ("Q4_0", "Q8_0", "Q6_K")
#: Segments of the inputs the argmax head's bound takes its largest activation error over (kernels/blocks.c).
SEGMENTS = 4


def interleave(raw: torch.Tensor, kind: str, width: int) -> torch.Tensor:
    """GGUF blocks [out, blocks · bytes] → the layout the kernel runs: groups of ``width`` outputs (:func:`group`);
    per group and block, each field of :func:`fields` for the ``width`` outputs in turn (the output axis just before
    a field's last, unit axis: 4 quant bytes of every output, then the next 4); outputs padded with zero blocks.
    Groups are independent, so a large tensor is done in slices of :data:`SLICE` outputs: the temporaries of
    :func:`fields` stay small (loading the Qwen 1.5B's q4 cache peaked ~1 GB higher without)."""
    out = raw.shape[0]
    groups = -(-out // width)
    if out > SLICE and SLICE % width == 0:
        first = interleave(raw[:SLICE], kind, width)
        packed = torch.empty(groups, first.shape[1], dtype=torch.uint8)
        packed[: first.shape[0]] = first
        for start in range(SLICE, out, SLICE):
            part = interleave(raw[start: start + SLICE], kind, width)
            packed[start // width: start // width + part.shape[0]] = part
        return packed
    parts = fields(raw, kind)
    packed = []
    for f in parts:
        pad = torch.zeros(groups * width, *f.shape[1:], dtype=torch.uint8)
        pad[:out] = f
        v = pad.view(groups, width, *f.shape[1:])  # [g, lane, n, ..., unit]
        nd = v.dim()
        packed.append(v.permute(0, 2, *range(3, nd - 1), 1, nd - 1).reshape(groups, f.shape[1], -1))
    return torch.cat(packed, -1).reshape(groups, -1).contiguous()


def deinterleave(packed: torch.Tensor, kind: str, out: int, width: int) -> list[torch.Tensor]:
    """:func:`interleave`'s inverse: the fields of :func:`fields`."""
    shapes = _field_shapes(kind)
    sizes = [width * int(np.prod(shape)) for shape in shapes]
    groups = packed.shape[0]
    p = packed.view(groups, -1, sum(sizes))
    n, result, offset = p.shape[1], [], 0
    for shape, size in zip(shapes, sizes):
        v = p[..., offset: offset + size].reshape(groups, n, *shape[:-1], width, shape[-1])
        nd = v.dim()
        v = v.permute(0, nd - 2, 1, *range(2, nd - 2), nd - 1).reshape(groups * width, n, *shape)
        result.append(v[:out])
        offset += size
    return result


def k_integers(parts: list[torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """A K type's :func:`fields` as per-block values, [out, blocks of 32, ...]: ``q`` (the integers), and the fp32
    scales the kernel forms: Q4_K ``dw`` = d · sc and ``mw`` = −(dmin · m); Q6_K ``dlo``, ``dhi`` = d · sc of the
    block's two halves (q − 32 is what they scale)."""
    d = parts[0].contiguous().view(torch.float16).float()  # [out, n, 1]
    out, n = d.shape[:2]
    if kind == "Q4_K":
        dmin = parts[1].contiguous().view(torch.float16).float()
        nib = parts[4].reshape(out, n, 8, 16)
        q = torch.cat([nib & 15, nib >> 4], -1).reshape(out, n * 8, 32)
        return {"q": q, "dw": (d * parts[2][..., 0].float()).reshape(out, -1),
                "mw": -(dmin * parts[3][..., 0].float()).reshape(out, -1)}
    low, words = parts[2].reshape(out, n, 8, 16), parts[3]  # words [out, n, 8, 2, 4]
    bits = [(words >> shift) & 3 for shift in (0, 2, 4, 6)]  # elements 8h+i, 16+8h+i, 8h+4+i, 16+8h+4+i
    lo_half = torch.stack([bits[0], bits[2]], -2).reshape(out, n, 8, 16)
    hi_half = torch.stack([bits[1], bits[3]], -2).reshape(out, n, 8, 16)
    q = torch.cat([(low & 15) | (lo_half << 4), (low >> 4) | (hi_half << 4)], -1).reshape(out, n * 8, 32)
    scaled = (d * parts[1][..., 0].view(torch.int8).float()).reshape(out, n * 8, 2)
    return {"q": q, "dlo": scaled[..., 0], "dhi": scaled[..., 1]}


def dequantize_fields(parts: list[torch.Tensor], kind: str) -> torch.Tensor:
    """fp32 [out, in] from :func:`fields`' tensors: ggml's formulas, each product and sum one float32 operation."""
    if kind not in ("Q4_K", "Q6_K"):
        out, n = parts[0].shape[:2]
        return dequantize(torch.cat([f.reshape(out, n, -1) for f in parts], -1).reshape(out, -1), kind)
    v = k_integers(parts, kind)
    q = v["q"].float()
    if kind == "Q4_K":
        return (v["dw"][..., None] * q + v["mw"][..., None]).reshape(q.shape[0], -1)
    w = torch.cat([v["dlo"][..., None] * (q[..., :16] - 32), v["dhi"][..., None] * (q[..., 16:] - 32)], -1)
    return w.reshape(q.shape[0], -1)


def convert(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, str]:
    """Blocks of a type read into another exactly (:data:`CONVERTED`): Q5_0 → Q8_0."""
    if kind != "Q5_0":
        return raw, kind
    out = raw.shape[0]
    b = raw.reshape(out, -1, 22)
    bits = b[..., 2:6].contiguous().view(torch.int32)  # [out, n, 1]: bit e is element e's fifth bit
    high = (bits >> torch.arange(32, dtype=torch.int32)) & 1
    qs = b[..., 6:22]
    q = torch.cat([qs & 15, qs >> 4], -1).to(torch.int32) | (high << 4)
    q8 = (q - 16).to(torch.int8).view(torch.uint8)
    return torch.cat([b[..., 0:2], q8], -1).reshape(out, -1).contiguous(), "Q8_0"


# ---------------------------------------------------------------------------------------------------
# The formats: de-quantizing (the reference) and quantizing (for models that do not come as GGUF).

def dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """fp32 [rows, 32 · blocks] from uint8 [rows, blocks · bytes] of ``kind`` (gguf-py's de-quantization: ggml's
    formulas, w = d q (+ m), each product and sum one float32 operation)."""
    from gguf import quants

    out = quants.dequantize(blocks.numpy(), getattr(quants.GGMLQuantizationType, kind))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def quantize(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 blocks [rows, blocks · bytes] of ``weight`` [rows, in] (in a multiple of 32): gguf-py's quantization,
    llama.cpp's reference rules (Q4_1: d = (max - min) / 15, m = min per 32 weights)."""
    from gguf import quants

    if weight.shape[-1] % QK:
        raise SpeculateError(f"dtype q4 needs input sizes that are multiples of {QK}; a layer has {weight.shape[-1]}")
    out = quants.quantize(weight.detach().float().numpy(), getattr(quants.GGMLQuantizationType, kind))
    return torch.from_numpy(np.ascontiguousarray(out))


# ---------------------------------------------------------------------------------------------------
# The layer.

class BlockLinear(QuantizedLinear):
    """``y = x Wᵀ + b`` with W in GGUF blocks, rows of x quantized to int8 per block (kernels/blocks.c). A row's
    result does not depend on the other rows of the call, nor on the number of threads.

    ``BlockLinear(blocks, kind, in_features, bias)``, or :meth:`from_parts` for a fused layer whose members have
    different types (a GGUF's q and k in Q4_K, its v in Q6_K): one kernel call per part, each writing its columns."""

    def __init__(self, blocks: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        self._setup([(kind, blocks)], in_features, bias)

    @classmethod
    def from_parts(cls, parts: list[tuple[str, torch.Tensor]], in_features: int,
                   bias: torch.Tensor | None = None) -> "BlockLinear":
        layer = cls.__new__(cls)
        QuantizedLinear.__init__(layer)
        layer._setup(parts, in_features, bias)
        return layer

    def _setup(self, parts: list[tuple[str, torch.Tensor]], in_features: int, bias: torch.Tensor | None) -> None:
        self._fn = require_kernel()
        # self.passes (QuantizedLinear's, 2): activation rows per row of x in kernels/blocks.c, the row quantized to
        # int8 per block and then what that missed, ~16 bits in all. 1 is llama.cpp's Q8 activations (--dtype q4a8),
        # which changed the default model's answers ("L'Étoile" for the capital of France; docs/benchmarks.md).
        self.width = group()
        self.in_features = in_features
        self.kinds, hot, start = [], [], 0
        for i, (kind, blocks) in enumerate(parts):
            if kind not in TYPES:
                raise SpeculateError(f"block type {kind} is not supported (supported: {', '.join(TYPES)})")
            number, elems, size = TYPES[kind]
            if blocks.dtype != torch.uint8 or in_features % elems or blocks.shape[1] != in_features // elems * size:
                raise SpeculateError(f"{kind} blocks of shape {tuple(blocks.shape)} do not hold {in_features} inputs")
            # Only the interleaved copy is kept (the GGUF layout is a permutation of its bytes: deinterleave).
            self.register_buffer(f"packed{i}", interleave(blocks, kind, self.width))
            rows = blocks.shape[0]
            self.kinds.append((kind, start, rows))
            hot.append((number, getattr(self, f"packed{i}"), start, rows))
            start += rows
        self.out_features = start
        self.kind = "+".join(dict.fromkeys(k for k, _, _ in self.kinds))
        # (a copy: a bias read from the q4 cache is a view of the file's memory map, which it would keep resident
        # whole — 1.2 GB for the Qwen 1.5B — once the blocks above are interleaved copies)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        # Plain attributes for the hot call (nn.Module's buffer lookups cost more than the rest of its Python); the
        # same tensor objects as the buffers, so a deep copy keeps them together.
        self._hot = (hot, self.bias)

    @property
    def blocks(self) -> torch.Tensor:
        """The GGUF blocks [out, nb · bytes] (one part of Q4_0, Q4_1 or Q8_0)."""
        (kind, _, rows), = self.kinds
        parts = deinterleave(self.packed0, kind, rows, self.width)
        return torch.cat([f.reshape(rows, f.shape[1], -1) for f in parts], -1).reshape(rows, -1)

    def dequantized_weight(self) -> torch.Tensor:
        return torch.cat([dequantize_fields(deinterleave(getattr(self, f"packed{i}"), kind, rows, self.width), kind)
                          for i, (kind, _, rows) in enumerate(self.kinds)])

    def weight_bytes(self) -> int:
        return sum(getattr(self, f"packed{i}").numel() for i in range(len(self.kinds)))

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor | None = None,
             eps: float = 0.0, act: bool = False) -> torch.Tensor:
        x = x.float().contiguous()
        rows, out = x.shape[0], self.out_features
        hot, bias = self._hot
        y = torch.empty(rows, out, dtype=torch.float32)
        if residual is not None:
            residual = residual.float().contiguous()
        x_ptr, y_ptr = x.data_ptr(), y.data_ptr()
        norm_ptr = None if norm is None else norm.data_ptr()
        threads = torch.get_num_threads()
        for number, packed, start, n in hot:  # each part writes its columns (4 bytes a float)
            rc = self._fn(number, packed.data_ptr(), n, self.in_features, x_ptr, rows, norm_ptr, eps, int(act),
                          None if bias is None else bias.data_ptr() + 4 * start,
                          None if residual is None else residual.data_ptr() + 4 * start, y_ptr + 4 * start, out,
                          threads, self.passes)
            if rc:
                raise RuntimeError(f"block matmul failed ({rc})")
        return y

    def struct(self):
        """This layer as kernels/decoder.c's linear_t (pointers into this module's buffers: keep it alive)."""
        hot, bias = self._hot
        if len(hot) > 4:
            raise SpeculateError("a q4 layer of more than 4 parts")
        s = kernel.Linear(parts=len(hot), bias=None if bias is None else bias.data_ptr(), out=self.out_features,
                          k=self.in_features, passes=self.passes)
        for i, (number, packed, _, rows) in enumerate(hot):
            s.types[i], s.packed[i], s.rows[i] = number, packed.data_ptr(), rows
        return s

    def matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None)

    def argmax_runs(self) -> bool:
        """Whether :meth:`argmax_matmul_2d` takes this layer: one part of a type without offset terms
        (:data:`ARGMAX_TYPES`), two activation passes, no bias."""
        return (type(self) is BlockLinear and len(self.kinds) == 1 and self.kinds[0][0] in ARGMAX_TYPES
                and self.passes == 2 and self.bias is None)

    def argmax_matmul_2d(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(y, groups)``: :meth:`matmul_2d`'s values where a row's greatest may be, -inf everywhere else, so each
        row's argmax (first index on ties) is :meth:`matmul_2d`'s, by construction (kernels/blocks.c,
        ``speculate_block_argmax``: every second activation pass is bounded, and only the groups of outputs whose
        bound reaches the row's best run it). ``groups`` [rows]: how many groups of :func:`group` outputs did.
        Greedy decoding's LM head (models/fast.py): at 8 rows of the default model the second pass over its whole
        head was 6-10 % of a round (docs/benchmarks.md, "The argmax head")."""
        if not self.argmax_runs():
            raise SpeculateError(f"argmax_matmul_2d takes one part of {', '.join(ARGMAX_TYPES)} at two passes")
        x = x.float().contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        groups = torch.empty(rows, dtype=torch.int64)
        l1 = self.l1()
        rc = kernel.function("speculate_block_argmax")(
            TYPES[self.kinds[0][0]][0], self.packed0.data_ptr(), self.out_features, self.in_features, x.data_ptr(),
            rows, l1.data_ptr(), l1.shape[1], y.data_ptr(), groups.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"block argmax failed ({rc})")
        return y, groups

    def l1(self) -> torch.Tensor:
        """Σ |w_oj| over each segment of the inputs, as :meth:`argmax_matmul_2d`'s kernel reads it: [groups,
        segments, :func:`group`] fp32 (padding outputs 0), block b of 32 inputs in segment b · segments // blocks, with
        :data:`SEGMENTS` segments (fewer where the layer has fewer blocks). Computed once, a slice of outputs at a
        time (the Qwen 1.5B's head de-quantized whole would be 0.9 GB)."""
        if getattr(self, "_l1", None) is None:
            (kind, _, rows), = self.kinds
            nb = self.in_features // 32
            segments = min(SEGMENTS, nb)
            of = torch.arange(nb) * segments // nb  # each block's segment
            step = SLICE // self.width
            parts = []
            for g in range(0, self.packed0.shape[0], step):
                n = min(rows - g * self.width, step * self.width)
                w = dequantize_fields(deinterleave(self.packed0[g: g + step], kind, n, self.width), kind)
                per_block = w.double().abs().reshape(n, nb, 32).sum(-1)
                parts.append(torch.zeros(n, segments, dtype=torch.float64).index_add_(1, of, per_block))
            table = torch.zeros(self.packed0.shape[0] * self.width, segments)
            table[:rows] = torch.cat(parts).float()
            self._l1 = table.view(-1, self.width, segments).transpose(1, 2).contiguous()
        return self._l1

    def add_matmul_2d(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, residual)

    def norm_matmul_2d(self, x: torch.Tensor, norm: torch.Tensor, eps: float) -> torch.Tensor:
        """``matmul_2d(rms_norm(x) · norm)``, the norm computed in the kernel (kernels/blocks.c, prepare_row)."""
        return self._run(x, None, norm, eps)

    def add_silu_matmul_2d(self, residual: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """``residual + matmul_2d(silu(gate) · up)`` for gate_up = [gate | up], the SiLU in the kernel."""
        return self._run(gate_up, residual, act=True)

    def extra_repr(self) -> str:
        return f"{self.kind}, in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"


class FloatLinear(BlockLinear):
    """dtype fp32's and bf16's layers as the lean path runs them (models/fast.py): ``y = x Wᵀ + b`` through the
    kernel's float path over the model's own weights W [out, in], fp32 or bfloat16 (held, not copied: the Hugging
    Face modules keep them). Per (row, output), 16 fused multiply-add chains in fp32 in a fixed order, folded in a
    fixed tree (kernels/blocks.c, "Float weights"); a bf16 weight is widened to the float of the same value as it is
    read, so a bf16 layer computes exactly what an fp32 layer computes on its weights widened. A row's result does
    not depend on the other rows of the call or the thread count, by construction.
    Why: PyTorch's matmul hands the rows to a BLAS that picks its kernel, and its order of sums, by the shape, so a
    row verified beside others could round differently from the same row decoded alone; and this path reads the
    weights faster at a decode step (docs/benchmarks.md, "fp32 through the kernel", "bf16 through the kernel")."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        QuantizedLinear.__init__(self)
        if not float_layer_runs(weight):
            raise SpeculateError(f"a float layer needs fp32 or bf16 weights with inputs a multiple of 16; got "
                                 f"{weight.dtype} {tuple(weight.shape)}")
        self._fn = require_kernel()
        self.out_features, self.in_features = weight.shape
        self.weight = weight.detach().contiguous()  # (contiguous already where the lean path fused the layer)
        self.kind = FLOAT_LAYOUTS[weight.dtype][0]
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        self._hot = ([(FLOAT_LAYOUTS[weight.dtype][1], self.weight, 0, self.out_features)], self.bias)

    @property
    def blocks(self) -> torch.Tensor:
        raise AttributeError("a float layer holds no GGUF blocks (its weights: .weight)")

    def dequantized_weight(self) -> torch.Tensor:
        return self.weight.float()

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


# The kernel's type numbers for row-major float weights (ggml's F32 and BF16), by dtype.
FLOAT_LAYOUTS = {torch.float32: ("F32", 0), torch.bfloat16: ("BF16", 30)}


def float_layer_runs(weight: torch.Tensor) -> bool:
    """Whether :class:`FloatLinear` runs ``weight``: fp32 or bf16, [out, in] with in a multiple of 16, the kernel
    built here."""
    return (weight.dtype in FLOAT_LAYOUTS and weight.dim() == 2 and weight.shape[1] % 16 == 0
            and available())


# ---------------------------------------------------------------------------------------------------
# Building the model: which layers, from which blocks.

# Hugging Face module name → GGUF tensor name, for the Llama family (llama.cpp's names).
_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def settings() -> dict[str, str]:
    return {"format": str(FORMAT), "kind": "q4"}


def _gguf_name(name: str, tied: bool) -> str:
    if name == "lm_head":
        return "token_embd.weight" if tied else "output.weight"
    parts = name.split(".")  # model.layers.{i}.self_attn.q_proj
    return f"blk.{parts[2]}.{_GGUF['.'.join(parts[3:])]}.weight"


def _from_gguf(tensors: dict, name: str, weight: torch.Tensor, tied: bool) -> tuple[torch.Tensor, str]:
    """The GGUF's blocks for the module ``name`` (``tensors``: the file's, by name), rows in the order of ``weight``
    (the converter's de-quantized copy of the same tensor), checked to de-quantize to exactly ``weight``."""
    gname = _gguf_name(name, tied)
    tensor = tensors.get(gname)
    if tensor is None:
        raise SpeculateError(f"dtype q4: the GGUF has no tensor {gname} for {name}")
    kind = tensor.tensor_type.name
    if kind not in TYPES and kind not in CONVERTED:
        raise SpeculateError(f"dtype q4 runs {', '.join([*TYPES, *CONVERTED])} blocks; {gname} is {kind} "
                             "(not supported)")
    blocks = torch.from_numpy(np.array(tensor.data, copy=True)).reshape(weight.shape[0], -1)
    deq = dequantize(blocks, kind)
    if not torch.equal(deq, weight):
        # Rows permuted by the converter (llama's q and k): find each row of ``weight`` among the blocks' rows.
        index = {row.numpy().tobytes(): i for i, row in enumerate(deq)}
        try:
            order = torch.tensor([index[row.numpy().tobytes()] for row in weight.float()])
        except KeyError:
            raise SpeculateError(f"dtype q4: the blocks of {gname} do not de-quantize to the converted weights") from None
        blocks = blocks[order]
    blocks, kind = convert(blocks.contiguous(), kind)
    if not torch.equal(dequantize_fields(fields(blocks, kind), kind), weight):  # what the kernel will read
        raise SpeculateError(f"dtype q4: the blocks of {gname} do not de-quantize to the converted weights")
    return blocks, kind


def build(model: nn.Module, gguf: Path | None) -> dict[str, torch.Tensor]:
    """The tensors :func:`apply` takes, per fused layer of :func:`quantize.plan`: ``part.<layer>.<i>.<kind>`` (uint8
    blocks; consecutive members of one type in one part) and ``bias.<layer>``, from the GGUF file (``gguf``) or
    quantized from the fp32 weights (None: Q4_1, the LM head Q8_0)."""
    tensors = None
    if gguf is not None:
        from gguf import GGUFReader
        tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for fused, members in plan(model):
        parts: list[tuple[str, list[torch.Tensor]]] = []
        biases = []
        for name in members:
            module = model.get_submodule(name)
            weight = module.weight.detach().float()
            if tensors is not None and (name == "lm_head" or name.startswith("model.layers.")):
                blocks, kind = _from_gguf(tensors, name, weight, tied)
            else:
                kind = "Q8_0" if name == "lm_head" else "Q4_1"
                blocks = quantize(weight, kind)
            if parts and parts[-1][0] == kind:
                parts[-1][1].append(blocks)
            else:
                parts.append((kind, [blocks]))
            biases.append(module.bias)
        for i, (kind, pieces) in enumerate(parts):
            out[f"part.{fused}.{i}.{kind}"] = torch.cat(pieces).contiguous()
        if all(b is not None for b in biases):
            out[f"bias.{fused}"] = torch.cat([b.detach().float() for b in biases]).contiguous()
    return out


def apply(model: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Turn the fp32 ``model`` into its q4 form in place: each fused layer becomes a :class:`BlockLinear` and its
    members views of it (:class:`LinearPart`), as quantize.apply does for int8."""
    from .quantize import _set

    parts: dict[str, list[tuple[int, str, torch.Tensor]]] = {}
    for key, tensor in tensors.items():
        if key.startswith("part."):
            fused, index, kind = key[len("part."):].rsplit(".", 2)
            parts.setdefault(fused, []).append((int(index), kind, tensor))
    for fused, members in plan(model):
        if fused not in parts:
            continue
        in_features = model.get_submodule(members[0]).in_features
        layer = BlockLinear.from_parts([(kind, t) for _, kind, t in sorted(parts[fused], key=lambda p: p[0])],
                                       in_features, tensors.get(f"bias.{fused}"))
        views = [] if members == [fused] else [(name, model.get_submodule(name).out_features) for name in members]
        _set(model, fused, layer)
        start = 0
        for name, rows in views:
            _set(model, name, LinearPart(layer, start, start + rows))
            start += rows
    return model
