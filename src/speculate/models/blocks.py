"""``dtype="q4"``: the GGUF file's own quantized blocks, run as they are (4-bit Q4_0/Q4_1, 8-bit Q8_0).

Why: the default model ships as a Q4_1 GGUF (its LM head, the tied embedding, as Q8_0); our fp32 weights are
those blocks de-quantized. Reading the blocks themselves loses nothing against the file and reads ~0.7x the bytes
of int8 per step (the layers at 5 bits a weight, the head at 8.5), and a decode step is bound by reading weights.
The matmul is a compiled kernel (kernels/blocks.c) that quantizes each row of activations to int8 per block of
32, as llama.cpp does for these formats, and sums every (row, output) pair in one fixed order: a row's logits
are the same bits whatever the other rows of the forward are, so greedy speculative decoding is exact here too
(with the batch-invariant attention of kernel.py; models/exactness.py checks the whole model at load).

Where the blocks come from: for a model alias, the GGUF tensors themselves, each matched row for row against the
weights the converter de-quantized from the same file (they must be equal bit for bit: this checks the reading,
and finds the row order — the llama converter permutes q and k rows); for any other model folder, its fp32
weights quantized with llama.cpp's rules (Q4_1 per 32 weights: d = (max - min) / 15, m = min; the LM head Q8_0).
The blocks are cached once (atomic, checksummed) like the int8 tensors.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..errors import SpeculateError
from . import kernel
from .quantize import LinearPart, QuantizedLinear

FORMAT = 1  # bump when the meaning of the cached tensors changes
QK = 32  # weights a block
# ggml type number, bytes a block
TYPES = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
_NAMES = {number: name for name, (number, _) in TYPES.items()}
_lock = threading.Lock()
_fn: list = []  # [the matmul, GROUP]: outputs interleaved in the layout it runs (16 with AVX-512, else 8)


def _kernel():
    """The compiled matmul (kernels/blocks.c), built once per machine; a clear error where it cannot be."""
    with _lock:
        if not _fn:
            lib = kernel.library("blocks.c", extra=("-fopenmp",))
            fn = None if lib is None else lib.speculate_block_matmul
            if fn is not None:
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            _fn[:] = [fn, None if lib is None else lib.speculate_block_group()]
        if _fn[0] is None:
            raise SpeculateError("dtype q4 needs a C compiler (cc) to build its kernel; use int8 or fp32")
        return _fn[0]


def available() -> bool:
    """Whether the kernel builds here (a C compiler, and SPECULATE_NO_KERNEL unset)."""
    try:
        _kernel()
    except SpeculateError:
        return False
    return True


def group() -> int:
    """Outputs a vector of the compiled kernel holds: the interleaving of its layout."""
    _kernel()
    return _fn[1]


def _parts(kind: str) -> tuple[int, int, int]:
    """(bytes a block, fp16 scales a block, bytes of quants a block)."""
    size = TYPES[kind][1]
    scales = 2 if kind == "Q4_1" else 1
    return size, scales, size - 2 * scales


def interleave(blocks: torch.Tensor, kind: str, width: int) -> torch.Tensor:
    """GGUF blocks [out, nb · bytes] → the layout the kernel runs (kernels/blocks.c, "Layout as run"): groups of
    ``width`` outputs (:func:`group`), per block their scales, then their quants in units of 4 bytes, unit c of every output in turn;
    outputs padded to a multiple of ``width`` with zero blocks."""
    size, ns, qb = _parts(kind)
    out = blocks.shape[0]
    groups = -(-out // width)
    padded = torch.zeros(groups * width, blocks.shape[1], dtype=torch.uint8)
    padded[:out] = blocks
    b = padded.view(groups, width, -1, size)  # [g, lane, nb, bytes]
    scales = b[..., : 2 * ns].reshape(groups, width, -1, ns, 2).permute(0, 2, 3, 1, 4)  # [g, nb, ns, lane, 2]
    quants = b[..., 2 * ns:].reshape(groups, width, -1, qb // 4, 4).permute(0, 2, 3, 1, 4)  # [g, nb, c, lane, 4]
    nb = b.shape[2]
    return torch.cat([scales.reshape(groups, nb, -1), quants.reshape(groups, nb, -1)], -1).reshape(groups, -1)


def deinterleave(packed: torch.Tensor, kind: str, out: int, width: int) -> torch.Tensor:
    """:func:`interleave`'s inverse: GGUF blocks [out, nb · bytes]."""
    size, ns, qb = _parts(kind)
    groups = packed.shape[0]
    p = packed.view(groups, -1, width * size)
    nb = p.shape[1]
    scales = p[..., : 2 * ns * width].reshape(groups, nb, ns, width, 2).permute(0, 3, 1, 2, 4)
    quants = p[..., 2 * ns * width:].reshape(groups, nb, qb // 4, width, 4).permute(0, 3, 1, 2, 4)
    b = torch.cat([scales.reshape(groups, width, nb, -1), quants.reshape(groups, width, nb, -1)], -1)
    return b.reshape(groups * width, nb * size)[:out].contiguous()


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
    """``y = x Wᵀ + b`` with W in GGUF blocks of ``kind``, rows of x quantized to int8 per block (kernels/blocks.c).
    A row's result does not depend on the other rows of the call, nor on the number of threads."""

    def __init__(self, blocks: torch.Tensor, kind: str, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        if kind not in TYPES:
            raise SpeculateError(f"block type {kind} is not supported (supported: {', '.join(TYPES)})")
        self.kind, self.type = kind, TYPES[kind][0]
        self.out_features, self.in_features = blocks.shape[0], in_features
        if blocks.dtype != torch.uint8 or blocks.shape[1] != in_features // QK * TYPES[kind][1]:
            raise SpeculateError(f"{kind} blocks of shape {tuple(blocks.shape)} do not hold {in_features} inputs")
        self._fn = _kernel()
        # Only the interleaved copy is kept (the GGUF layout is a permutation of its bytes: deinterleave).
        self.width = group()
        self.register_buffer("packed", interleave(blocks, kind, self.width))
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())
        # Plain attributes for the hot call (nn.Module's buffer lookups cost more than the rest of its Python); the
        # same tensor objects as the buffers, so a deep copy keeps them together.
        self._hot = (self.packed, self.bias)

    @property
    def blocks(self) -> torch.Tensor:
        """The GGUF blocks [out, nb · bytes]."""
        return deinterleave(self.packed, self.kind, self.out_features, self.width)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize(self.blocks, self.kind)

    def weight_bytes(self) -> int:
        return self.packed.numel()

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None, norm: torch.Tensor | None = None,
             eps: float = 0.0, act: bool = False) -> torch.Tensor:
        x = x.float().contiguous()
        rows = x.shape[0]
        packed, bias = self._hot
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if residual is not None:
            residual = residual.float().contiguous()
        rc = self._fn(self.type, packed.data_ptr(), self.out_features, self.in_features, x.data_ptr(), rows,
                      None if norm is None else norm.data_ptr(), eps, int(act), None if bias is None else bias.data_ptr(),
                      None if residual is None else residual.data_ptr(), y.data_ptr(), torch.get_num_threads())
        if rc:
            raise RuntimeError(f"block matmul failed ({rc})")
        return y

    def matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, None)

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


# ---------------------------------------------------------------------------------------------------
# Building the model: which layers, from which blocks.

# Hugging Face module name → GGUF tensor name, for the Llama family (llama.cpp's names).
_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down"}


def settings() -> dict[str, str]:
    return {"format": str(FORMAT), "kind": "q4"}


def _linear_names(model: nn.Module) -> list[tuple[str, list[str]]]:
    from .quantize import plan
    return plan(model)


def _gguf_name(name: str, tied: bool) -> str:
    if name == "lm_head":
        return "token_embd.weight" if tied else "output.weight"
    parts = name.split(".")  # model.layers.{i}.self_attn.q_proj
    return f"blk.{parts[2]}.{_GGUF['.'.join(parts[3:])]}.weight"


def _from_gguf(reader, name: str, weight: torch.Tensor, tied: bool) -> tuple[torch.Tensor, str]:
    """The GGUF's blocks for the module ``name``, rows in the order of ``weight`` (the converter's de-quantized
    copy of the same tensor), checked to de-quantize to exactly ``weight``."""
    gname = _gguf_name(name, tied)
    tensor = next((t for t in reader.tensors if t.name == gname), None)
    if tensor is None:
        raise SpeculateError(f"dtype q4: the GGUF has no tensor {gname} for {name}")
    kind = tensor.tensor_type.name
    if kind not in TYPES:
        raise SpeculateError(f"dtype q4 runs {', '.join(TYPES)} blocks; {gname} is {kind} (not supported)")
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
        if not torch.equal(dequantize(blocks, kind), weight):
            raise SpeculateError(f"dtype q4: the blocks of {gname} do not de-quantize to the converted weights")
    return blocks.contiguous(), kind


def build(model: nn.Module, gguf: Path | None) -> dict[str, torch.Tensor]:
    """The tensors :func:`apply` takes: ``blocks.<kind>.<layer>`` (uint8) and ``bias.<layer>`` per fused layer of
    :func:`quantize.plan`, from the GGUF file (``gguf``) or quantized from the fp32 weights (None)."""
    reader = None
    if gguf is not None:
        from gguf import GGUFReader
        reader = GGUFReader(str(gguf))
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out: dict[str, torch.Tensor] = {}
    for fused, members in _linear_names(model):
        parts, kinds, biases = [], set(), []
        for name in members:
            module = model.get_submodule(name)
            weight = module.weight.detach().float()
            if reader is not None and (name == "lm_head" or name.startswith("model.layers.")):
                blocks, kind = _from_gguf(reader, name, weight, tied)
            else:
                kind = "Q8_0" if name == "lm_head" else "Q4_1"
                blocks = quantize(weight, kind)
            parts.append(blocks)
            kinds.add(kind)
            biases.append(module.bias)
        if len(kinds) > 1:  # members of different types cannot share one matmul
            raise SpeculateError(f"dtype q4: {fused} mixes block types {sorted(kinds)} (not supported)")
        kind = kinds.pop()
        out[f"blocks.{kind}.{fused}"] = torch.cat(parts).contiguous()
        if all(b is not None for b in biases):
            out[f"bias.{fused}"] = torch.cat([b.detach().float() for b in biases]).contiguous()
    return out


def apply(model: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Turn the fp32 ``model`` into its q4 form in place: each fused layer becomes a :class:`BlockLinear` and its
    members views of it (:class:`LinearPart`), as quantize.apply does for int8."""
    from .quantize import _set

    kinds = {key.split(".", 2)[2]: key.split(".")[1] for key in tensors if key.startswith("blocks.")}
    for fused, members in _linear_names(model):
        if fused not in kinds:
            continue
        in_features = model.get_submodule(members[0]).in_features
        layer = BlockLinear(tensors[f"blocks.{kinds[fused]}.{fused}"], kinds[fused], in_features,
                            tensors.get(f"bias.{fused}"))
        parts = [] if members == [fused] else [(name, model.get_submodule(name).out_features) for name in members]
        _set(model, fused, layer)
        start = 0
        for name, rows in parts:
            _set(model, name, LinearPart(layer, start, start + rows))
            start += rows
    return model
