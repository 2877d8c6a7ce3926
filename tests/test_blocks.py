"""dtype q4: GGUF blocks run as they are (models/blocks.py, kernels/blocks.c); and dtype fp32's layers through the
same kernel (F32, the model's own weights in a fixed order of sums).

The kernel is reproduced bit for bit by a PyTorch formulation of its documented arithmetic on random blocks (so
it reads every nibble, scale and minimum as ggml defines them); a row's result does not depend on the other rows
or the thread count; the default model's q4 layers de-quantize to exactly the weights the converter read from
the same GGUF; and greedy speculative decoding at q4 equals plain q4 decoding.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from speculate import SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec
from speculate.drafters import get_drafter
from speculate.errors import SpeculateError
from speculate.models import blocks
from speculate.models.loader import DTYPES
from speculate.models.fast import FastKVModel
from speculate.models.forward import Rows
from speculate.models.cpu import cpu_flags
from conftest import assert_chains_equal_one_token, assert_pytest_passed, torch_threads

KINDS = list(blocks.TYPES)
SIMPLE = ["Q4_0", "Q4_1", "Q8_0"]  # what gguf-py also quantizes, and what a folder's weights become


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path))
    return tmp_path


def random_blocks(kind: str, rows: int, k: int, seed: int) -> torch.Tensor:
    """Random bytes for the quants (and the K types' sub-block scales), random finite fp16 scales (and minimums)
    of either sign."""
    g = torch.Generator().manual_seed(seed)
    _, elems, size = blocks.TYPES.get(kind) or (0, 32, 22)  # Q5_0: 22 bytes a block
    raw = torch.randint(0, 256, (rows, k // elems, size), generator=g, dtype=torch.uint8)
    at = {"Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}.get(kind, [0])  # where the fp16 scales sit
    for offset in at:
        scale = ((torch.rand(rows, k // elems, 1, generator=g) - 0.5) * 0.02).half()
        raw[..., offset: offset + 2] = scale.view(torch.uint8).reshape(rows, k // elems, 2)
    return raw.reshape(rows, -1)


def reference(blocks_: torch.Tensor, kind: str, x: torch.Tensor, bias=None, residual=None, passes: int = 2) -> torch.Tensor:
    """kernels/blocks.c's arithmetic in PyTorch float32 ops, each one rounding as the C code's: the row's own
    quantized product, plus (two passes) that of the rest the quantization missed, then the bias and the residual."""
    fold = k_fold if kind in ("Q4_K", "Q6_K") else block_fold
    qa, da = activations(x)
    y = fold(blocks_, kind, qa, da)
    if passes == 2:
        rest = x.reshape(qa.shape) - da[..., None] * qa.float()  # (a product, then a difference: each rounded)
        y = y + fold(blocks_, kind, *activations(rest.reshape(x.shape)))
    if bias is not None:
        y = y + bias
    return y if residual is None else residual + y


def block_fold(blocks_: torch.Tensor, kind: str, qa: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """Q4_0 / Q4_1 / Q8_0: the exact integer dots of each block, folded in block order."""
    rows, nb = da.shape
    size = blocks.TYPES[kind][2]
    b = blocks_.reshape(-1, nb, size)
    dw = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # [out, nb]
    if kind == "Q8_0":
        qw = b[..., 2:].contiguous().view(torch.int8).long()
        mw = None
    else:
        qs = b[..., 4:] if kind == "Q4_1" else b[..., 2:]
        qw = torch.cat([qs & 0x0F, qs >> 4], dim=-1).long()
        mw = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0] if kind == "Q4_1" else None
    sums = qa.sum(-1)
    dots = (qw[None] * qa[:, None]).sum(-1)  # [rows, out, nb], exact integers
    if kind == "Q4_0":
        dots = dots - 8 * sums[:, None]
    acc = torch.zeros(rows, qw.shape[0])
    mt = torch.zeros(rows, qw.shape[0])
    for j in range(nb):  # the folds, in block order
        acc = acc + dots[:, :, j].float() * (dw[None, :, j] * da[:, None, j])
        if kind == "Q4_1":
            mt = mt + mw[None, :, j] * (da[:, j] * sums[:, j].float())[:, None]
    return acc + mt if kind == "Q4_1" else acc


def activations(x: torch.Tensor):
    """The kernel's int8 activations: per row and block of 32, da = max|x| / 127, qa = round-half-even(x · 127 / max)."""
    rows, k = x.shape
    xb = x.reshape(rows, k // 32, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax != 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(xb * inv[..., None]).long(), amax / 127


def k_fold(raw: torch.Tensor, kind: str, qa: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """The K types' arithmetic (kernels/blocks.c, "K types"), from the fields the kernel reads."""
    v = blocks.k_integers(blocks.fields(raw, kind), kind)
    qw = v["q"].long()  # [out, nb, 32]
    acc = torch.zeros(qa.shape[0], qw.shape[0])
    mt = torch.zeros_like(acc)
    for j in range(qw.shape[1]):
        if kind == "Q4_K":
            dots = (qw[None, :, j] * qa[:, None, j]).sum(-1).float()
            acc = acc + dots * (v["dw"][None, :, j] * da[:, None, j])
            mt = mt + v["mw"][None, :, j] * (da[:, j] * qa[:, j].sum(-1).float())[:, None]
        else:
            for half, scale in ((slice(0, 16), "dlo"), (slice(16, 32), "dhi")):
                dots = (qw[None, :, j, half] * qa[:, None, j, half]).sum(-1) - 32 * qa[:, None, j, half].sum(-1)
                acc = acc + dots.float() * (v[scale][None, :, j] * da[:, None, j])
    return acc + mt if kind == "Q4_K" else acc


@pytest.mark.parametrize("kind", KINDS)
def test_kernel_reproduces_its_arithmetic_exactly_on_random_blocks(kind):
    shapes = [(1, 7, 32), (3, 40, 96), (9, 33, 256), (13, 300, 64)]
    if kind in ("Q4_K", "Q6_K"):  # super-blocks of 256 inputs
        shapes = [(1, 7, 256), (3, 40, 512), (9, 33, 256), (13, 70, 768)]
    for seed, (rows, out, k) in enumerate(shapes):
        w = random_blocks(kind, out, k, seed)
        g = torch.Generator().manual_seed(100 + seed)
        x = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 4
        x[0, :32] = 0  # an all-zero block: its scale is 0
        bias, residual = torch.randn(out, generator=g), torch.randn(rows, out, generator=g)
        for passes in (2, 1):
            layer = blocks.BlockLinear(w, kind, k, bias)
            layer.passes = passes
            assert torch.equal(layer.matmul_2d(x), reference(w, kind, x, bias, passes=passes)), (kind, rows, out, k)
            assert torch.equal(layer.add_matmul_2d(residual, x), reference(w, kind, x, bias, residual, passes))
            plain = blocks.BlockLinear(w, kind, k)
            plain.passes = passes
            assert torch.equal(plain(x), reference(w, kind, x, passes=passes))


# The bytes of a block that hold its quants (Q6_K: the low 4 bits, then the high 2).
QUANT_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q8_0": (2, 34), "Q4_K": (16, 144), "Q6_K": (0, 192)}


@pytest.mark.parametrize("kind", KINDS)
def test_the_largest_integer_sums_are_exact(kind):
    """Every quant at its largest (Q4 15, Q6_K 63, Q8_0 -128 and 127) against activations at +-127 in every lane:
    the block sums the AVX2 path adds in 16 bits (kernels/blocks.c, q4_block and q6_half) at their bounds (30480,
    32004), so an overflow would show as a wrong integer."""
    k = 256 if kind in ("Q4_K", "Q6_K") else 64
    size = blocks.TYPES[kind][2]
    for value in ((0xFF,), (0x80, 0x7F)) if kind == "Q8_0" else ((0xFF,),):
        w = random_blocks(kind, 24, k, 5).reshape(24, -1, size)
        start, stop = QUANT_BYTES[kind]
        w[..., start:stop] = torch.tensor(value, dtype=torch.uint8).repeat((stop - start) // len(value))
        w = w.reshape(24, -1)
        sign = torch.tensor([1.0, -1.0]).repeat(k // 64).repeat_interleave(32)
        x = torch.stack([torch.ones(k), -torch.ones(k), sign, 3 * sign])  # constant blocks: every a = +-127
        for passes in (2, 1):
            layer = blocks.BlockLinear(w, kind, k)
            layer.passes = passes
            assert torch.equal(layer.matmul_2d(x), reference(w, kind, x, passes=passes)), (kind, value, passes)


@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_the_interleaved_layout_is_a_permutation_of_the_fields(kind, sliced, monkeypatch):
    """Also when laid out in slices of outputs (a large tensor's: blocks.SLICE), the last slice partial."""
    if sliced:
        monkeypatch.setattr(blocks, "SLICE", 16)
    k = 256 if kind in ("Q4_K", "Q6_K") else 96
    for out in (1, 8, 13, 40):
        w = random_blocks(kind, out, k, out)
        parts = blocks.fields(w, kind)
        assert sum(f[0].numel() for f in parts) == w.shape[1] or kind == "Q4_K"  # Q4_K: 12 packed scale bytes → 16
        for width in (8, 16):
            packed = blocks.interleave(w, kind, width)
            assert packed.numel() == -(-out // width) * width * sum(f[0].numel() for f in parts)
            assert all(torch.equal(a, b) for a, b in zip(blocks.deinterleave(packed, kind, out, width), parts))
        if kind in SIMPLE:
            assert torch.equal(blocks.BlockLinear(w, kind, k).blocks, w)


def test_a_layer_keeps_no_view_of_the_tensors_it_was_built_from():
    """The q4 cache's tensors are views of the file's memory map: a layer that kept one (its bias) kept the whole
    file resident (1.2 GB of the Qwen 1.5B's RSS). Its blocks are interleaved copies; its bias must be a copy too."""
    w, bias = random_blocks("Q4_1", 16, 64, 0), torch.arange(16.0)
    layer = blocks.BlockLinear(w, "Q4_1", 64, bias)
    kept = {t.untyped_storage().data_ptr() for t in layer.buffers()}
    assert not kept & {w.untyped_storage().data_ptr(), bias.untyped_storage().data_ptr()}
    assert torch.equal(layer.bias, bias)


@pytest.mark.parametrize("kind", [*KINDS, "Q5_0"])
def test_the_fields_dequantize_to_ggmls_weights(kind):
    """What the kernel reads (the fields, and Q5_0 converted to Q8_0) de-quantizes to exactly gguf-py's weights."""
    k = 512 if kind in ("Q4_K", "Q6_K") else 128
    raw = random_blocks(kind, 24, k, 3)
    want = blocks.dequantize(raw, kind)
    converted, as_kind = blocks.convert(raw, kind)
    assert as_kind == blocks.CONVERTED.get(kind, kind)
    assert torch.equal(blocks.dequantize_fields(blocks.fields(converted, as_kind), as_kind), want)
    layer = blocks.BlockLinear(converted, as_kind, k)
    assert torch.equal(layer.dequantized_weight(), want)


def test_a_layer_of_parts_of_several_types_equals_its_parts(cache):
    """A fused layer whose members differ in type (a GGUF's q, k in Q4_K and v in Q6_K): each part's columns are
    what that part computes alone, with its slice of the bias and the residual."""
    parts = [("Q4_K", random_blocks("Q4_K", 24, 256, 1)), ("Q6_K", random_blocks("Q6_K", 8, 256, 2)),
             ("Q4_1", random_blocks("Q4_1", 5, 256, 3))]
    bias, x, residual = torch.randn(37), torch.randn(6, 256), torch.randn(6, 37)
    layer = blocks.BlockLinear.from_parts(parts, 256, bias)
    assert layer.kind == "Q4_K+Q6_K+Q4_1" and layer.out_features == 37
    got = layer.add_matmul_2d(residual, x)
    start = 0
    for kind, raw in parts:
        n = raw.shape[0]
        alone = blocks.BlockLinear(raw, kind, 256, bias[start: start + n])
        assert torch.equal(got[:, start: start + n], alone.add_matmul_2d(residual[:, start: start + n].contiguous(), x))
        start += n
    assert torch.equal(layer.dequantized_weight(),
                       torch.cat([blocks.dequantize(raw, kind) for kind, raw in parts]))


@pytest.mark.parametrize("kind", [*KINDS, "F32", "BF16"])
def test_rows_do_not_depend_on_the_other_rows_or_the_thread_count(kind):
    k = 256 if kind in ("Q4_K", "Q6_K") else 192
    if kind in ("F32", "BF16"):  # (dtype fp32's and bf16's layers: the model's float weights)
        w = torch.randn(523, k, generator=torch.Generator().manual_seed(7))
        layer = blocks.FloatLinear(w if kind == "F32" else w.bfloat16())
        assert layer.kind == kind
    else:
        layer = blocks.BlockLinear(random_blocks(kind, 520, k, 7), kind, k)
    x = torch.randn(61, k)
    with torch_threads(2):
        batched = layer.matmul_2d(x)
    with torch_threads(1):
        alone = torch.cat([layer.matmul_2d(x[i: i + 1]) for i in range(len(x))])
    assert torch.equal(batched, alone)
    for n in (2, 3, 5, 9, 16):
        assert torch.equal(layer.matmul_2d(x[:n]), batched[:n])


@pytest.mark.parametrize("kind", blocks.ARGMAX_TYPES)
def test_the_argmax_head_gives_each_rows_argmax_and_only_the_full_calls_bits(kind):
    """BlockLinear.argmax_matmul_2d (greedy decoding's LM head): over rows where the first activation pass alone
    would pick another output than both passes (one large value per block makes its 8-bit step coarse), every row's
    argmax is the full call's, every value it computes is the full call's bits, the rest are -inf, and most groups
    skip their second pass. Row and thread invariant, as the full call."""
    k = 256
    layer = blocks.BlockLinear(random_blocks(kind, 523, k, 11), kind, k)  # (523: the last group padded)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(600, k, generator=g)
    x.view(600, k // 32, 32)[:, :, 0] *= 40
    full = layer.matmul_2d(x)
    layer.passes = 1
    first = layer.matmul_2d(x)
    layer.passes = 2
    flipped = first.argmax(-1) != full.argmax(-1)
    assert flipped.sum() >= 5  # (the rows where the second pass decides: the bound must keep them right)
    with torch_threads(2):
        got, groups = layer.argmax_matmul_2d(x)
    with torch_threads(1):
        alone = [layer.argmax_matmul_2d(x[i: i + 1]) for i in range(0, 600, 37)]
    assert torch.equal(got.argmax(-1), full.argmax(-1))
    kept = got != float("-inf")
    assert torch.equal(got[kept], full[kept])
    width = blocks.group()
    assert torch.equal(groups, torch.tensor([len({o // width for o in row.nonzero()[:, 0].tolist()}) for row in kept]))
    assert groups.float().mean() < -(-523 // width) / 4 and groups.min() >= 1
    for j, (row, n) in zip(range(0, 600, 37), alone):
        assert torch.equal(row[0], got[j]) and n[0] == groups[j]
    with pytest.raises(SpeculateError):  # (a head with offset terms, or at one pass, computes every logit)
        blocks.BlockLinear(random_blocks("Q4_1", 64, k, 1), "Q4_1", k).argmax_matmul_2d(x[:2])


def f32_reference(w: torch.Tensor, x: torch.Tensor, bias=None, residual=None) -> torch.Tensor:
    """kernels/blocks.c's F32 arithmetic ("Float weights"): per (row, output) 16 partial sums, s_l = fma(w_j, x_j, s_l)
    for j = l, l + 16, ..., folded in halves, then the bias and the residual. Each fma in float64 (the product of two
    floats is exact there) rounded to float32: one rounding as the fma's, unless the float64 sum itself was rounded
    onto a float32 midpoint (then the two could differ), which is checked not to happen here."""
    w64, x64 = w.double(), x.double()
    s = torch.zeros(16, x.shape[0], w.shape[0])
    for j in range(0, w.shape[1], 16):
        for lane in range(16):
            exact = x64[:, j + lane, None] * w64[None, :, j + lane] + s[lane].double()
            s[lane] = exact.float()
            other = torch.nextafter(s[lane], torch.where(exact > s[lane].double(), torch.inf, -torch.inf))
            assert not (exact == (s[lane].double() + other.double()) / 2).any()  # (no midpoint: single rounding)
    for half in (8, 4, 2, 1):
        s[:half] = s[:half] + s[half: 2 * half]
    y = s[0] if bias is None else s[0] + bias
    return y if residual is None else residual + y


def test_f32_layers_reproduce_their_arithmetic_exactly():
    """dtype fp32's layers (blocks.FloatLinear over the model's own weights): the documented fixed order, bit for bit,
    with a bias and a residual; and a row alone gets the bits it gets beside others."""
    for seed, (rows, out, k) in enumerate([(1, 1, 16), (3, 7, 48), (5, 33, 96), (9, 70, 576)]):
        g = torch.Generator().manual_seed(seed)
        w, x = torch.randn(out, k, generator=g), torch.randn(rows, k, generator=g) * 3
        bias, residual = torch.randn(out, generator=g), torch.randn(rows, out, generator=g)
        layer = blocks.FloatLinear(w, bias)
        assert layer.dequantized_weight().data_ptr() == w.data_ptr()  # the model's tensor itself, not a copy
        assert torch.equal(layer.matmul_2d(x), f32_reference(w, x, bias)), (rows, out, k)
        assert torch.equal(layer.add_matmul_2d(residual, x), f32_reference(w, x, bias, residual))
        assert torch.equal(blocks.FloatLinear(w)(x), f32_reference(w, x))
        assert torch.allclose(layer.matmul_2d(x), x @ w.T + bias, rtol=1e-5, atol=1e-4)
        assert layer.matmul_2d(x[:0]).shape == (0, out)  # (no rows: nothing computed, no error)
    with pytest.raises(SpeculateError, match="multiple of 16"):
        blocks.FloatLinear(torch.zeros(4, 40))


def test_the_final_norm_reproduces_its_arithmetic_exactly_row_by_row(tiny_folders):
    """The block path's final RMSNorm (kernels/blocks.c, speculate_rms_rows; LeanModel._final_norm): the squares
    summed left to right in float32, inv = 1 / sqrt(ss / k + eps), (x · inv) · w, each a single float32 rounding, so a
    reproduction of that order gives the same bits; a row alone the bits it gets beside others; and within
    float32 rounding of PyTorch's rms_norm (whose order of sums is its own)."""
    from speculate.models.fast import lean_model

    lean = lean_model(load_model(str(tiny_folders[0]), dtype="q4"))
    g = torch.Generator().manual_seed(0)
    k = lean.hidden_size
    x = torch.randn(7, k, generator=g) * torch.rand(7, 1, generator=g) * 40  # rows of different scales
    x[3] = 0.0  # (ss = 0: inv = 1 / sqrt(eps))
    w = lean._final_norm_weight
    # (numpy's float32 operations, each correctly rounded, sqrt included: PyTorch's vectorized sqrt need not be)
    xs, f32 = x.numpy(), np.float32
    ss = np.zeros(7, dtype=f32)
    for j in range(k):
        ss = ss + xs[:, j] * xs[:, j]
    inv = f32(1) / np.sqrt(ss / f32(k) + f32(lean.eps))
    want = torch.from_numpy((xs * inv[:, None]) * w.numpy())
    got = lean._final_norm(x)
    assert torch.equal(got, want)
    assert torch.equal(torch.cat([lean._final_norm(x[j: j + 1]) for j in range(7)]), got)
    assert torch.allclose(got, torch.nn.functional.rms_norm(x, (k,), w, lean.eps), rtol=1e-5, atol=1e-6)


def test_bf16_layers_are_f32_layers_on_their_weights_widened():
    """dtype bf16's layers: the bf16 weights themselves (not copied), each widened to the float of the same value as
    it is read, so the bits are the F32 layer's on ``w.float()`` (whose order the test above checks), fp32 sums
    throughout."""
    for seed, (rows, out, k) in enumerate([(1, 1, 16), (3, 7, 48), (5, 33, 96), (9, 70, 576)]):
        g = torch.Generator().manual_seed(seed)
        w, x = torch.randn(out, k, generator=g).bfloat16(), torch.randn(rows, k, generator=g) * 3
        bias, residual = torch.randn(out, generator=g), torch.randn(rows, out, generator=g)
        layer = blocks.FloatLinear(w, bias)
        assert layer.kind == "BF16" and layer.weight.data_ptr() == w.data_ptr() and layer.weight_bytes() == 2 * out * k
        wide = w.float()
        assert torch.equal(layer.matmul_2d(x), blocks.FloatLinear(wide, bias).matmul_2d(x)), (rows, out, k)
        assert torch.equal(layer.add_matmul_2d(residual, x), blocks.FloatLinear(wide, bias).add_matmul_2d(residual, x))
        assert torch.equal(layer.dequantized_weight(), wide) and not hasattr(layer, "blocks")  # (no GGUF blocks)
        assert torch.allclose(layer.matmul_2d(x), x @ wide.T + bias, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", SIMPLE)
def test_quantize_and_dequantize_are_ggmls(kind):
    """Our blocks for models that do not come as GGUF: gguf-py's (llama.cpp's reference rules), within each
    format's step of the weights; and the layer is close to x Wᵀ with the de-quantized W (int8 activations)."""
    from gguf import quants

    w = torch.randn(96, 128) * 0.1
    b = blocks.quantize(w, kind)
    assert np.array_equal(b.numpy(), quants.quantize(w.numpy(), getattr(quants.GGMLQuantizationType, kind)))
    deq = blocks.dequantize(b, kind)
    # Half a step, plus the fp16 scale's rounding (Q4_0: a whole one at the end of the range opposite its largest value, 8 d clipped to 7 d).
    bound = {"Q8_0": 0.5 / 127, "Q4_0": 1 / 8, "Q4_1": 0.5 / 15}[kind]
    span = w.reshape(96, 4, 32).abs().amax(-1, keepdim=True) * (2 if kind == "Q4_1" else 1)
    assert ((deq - w).reshape(96, 4, 32).abs() <= span * bound * 1.15 + 1e-6).all()  # + the fp16 scale's rounding
    x = torch.randn(5, 128)
    exact = x @ deq.T
    got = blocks.BlockLinear(b, kind, 128).matmul_2d(x)
    assert ((got - exact).norm() / exact.norm()) < 0.01


@pytest.mark.skipif(os.environ.get("SPECULATE_KERNEL_FLAGS") is not None, reason="already another code path")
# AVX2 without VNNI (8 outputs a vector, 16-bit pair sums), AVX2 with AVX-VNNI, and the scalar loops.
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v3 -mavxvnni", "x86-64-v2"])
def test_the_other_code_paths_compute_the_same(march, tmp_path):
    """The kernel's AVX2 and scalar paths, compiled here with another -march, pass this file's kernel tests (the
    same bit-exact reference, BF16 as F32 on the widened weights, row and thread invariance) in a fresh process."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 code paths")
    if "avxvnni" in march and "avx_vnni" not in cpu_flags():
        pytest.skip("this CPU has no AVX-VNNI")
    env = {**os.environ, "SPECULATE_KERNEL_FLAGS": f"-march={march}", "SPECULATE_CACHE": str(tmp_path)}
    here = Path(__file__).resolve()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here), "-k",
                           "arithmetic or thread_count or several_types or dequantize_to or widened or largest "
                           "or argmax_head"],
                          env=env,
                          cwd=here.parent.parent, capture_output=True, text=True, timeout=600)
    assert_pytest_passed(done)
    probe = subprocess.run([sys.executable, "-c", "from speculate.models import blocks; print(blocks.group())"],
                           env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "8", probe.stderr[-1000:]  # the 256-bit or scalar layout, not this CPU's


def test_amx_tiles_give_the_vnni_loops_bits_and_can_be_turned_off():
    """Where the CPU runs AMX (kernels/blocks.c, AMX: Q8_0 at 8 activation rows and more), the tile path's integer
    dots feed the same float steps as the VNNI loops: every value the same bits, the full call's and the argmax
    head's; SPECULATE_NO_AMX keeps it off. Elsewhere only the last part runs."""
    from speculate.models import kernel

    code = "from speculate.models import kernel; print(kernel.amx_tiles())"
    off = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SPECULATE_NO_AMX": "1"},
                         capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "False", off.stderr
    if not kernel.amx_tiles():
        pytest.skip("no AMX-INT8 that this process may use")
    layer = blocks.BlockLinear(random_blocks("Q8_0", 300, 576, 3), "Q8_0", 576)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(40, 576, generator=g)
    x.view(40, 18, 32)[:, :, 0] *= 40  # (so that some groups run the argmax head's second pass)
    tiles = [layer.matmul_2d(x), *layer.argmax_matmul_2d(x), layer.matmul_2d(x[:5])]
    enable = kernel.function("lib").speculate_amx_enable
    enable(1)
    try:
        loops = [layer.matmul_2d(x), *layer.argmax_matmul_2d(x), layer.matmul_2d(x[:5])]
    finally:
        assert enable(0) == 1
    for a, b in zip(tiles, loops):
        assert torch.equal(a, b)


def test_bad_blocks_are_refused():
    with pytest.raises(SpeculateError, match="Q5_K"):
        blocks.BlockLinear(torch.zeros(4, 20, dtype=torch.uint8), "Q5_K", 32)
    with pytest.raises(SpeculateError, match="do not hold"):
        blocks.BlockLinear(torch.zeros(4, 20, dtype=torch.uint8), "Q4_1", 64)
    with pytest.raises(SpeculateError, match="multiples of 32"):
        blocks.quantize(torch.zeros(4, 40), "Q4_1")


def random_prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 259, (n,), generator=g).tolist()


def assert_chains_and_tree_equal_one_token(kv, ids):
    """A prefill, chains after a rollback (conftest's) and a tree after 60 positions: each row one-token decoding's
    bits. Returns the tree's (tokens, parents)."""
    assert_chains_equal_one_token(kv, ids)
    parents = [-1, 0, 0, 1, 1, 2, 5, -1, 7]
    tokens = torch.tensor(random_prompt(4, len(parents)))
    kv.keep(60)
    tree = kv.forward(tokens, tree_parents=parents)
    for path in ([0, 1, 3], [0, 1, 4], [0, 2, 5, 6], [7, 8]):
        kv.keep(60)
        assert torch.equal(tree[path], torch.cat([kv.forward(tokens[[t]]) for t in path])), path
    return tokens, parents


def test_tiny_model_at_q4_chains_and_trees_equal_one_token_decoding(tiny_folders, tiny, cache, monkeypatch):
    """A tiny random model quantized to Q4_1 (head Q8_0): every layer is a block layer, the load-time self-check
    passes, and a prefill, a chain after a rollback and a tree give each row one-token decoding's bits."""
    loaded = load_model(str(tiny_folders[0]), dtype="q4")
    kinds = {m.kind for m in loaded.model.modules() if isinstance(m, blocks.BlockLinear)}
    assert kinds == {"Q4_1", "Q8_0"}
    fp32 = tiny[0].model
    q_proj = loaded.model.model.layers[0].self_attn.qkv_proj
    assert torch.equal(q_proj.dequantized_weight()[:64],
                       blocks.dequantize(blocks.quantize(fp32.model.layers[0].self_attn.q_proj.weight, "Q4_1"), "Q4_1"))
    kv = FastKVModel(loaded)
    assert kv.attention in ("kernel", "integer") and not kv.row_by_row
    ids = torch.tensor(random_prompt(3, 120))
    tokens, parents = assert_chains_and_tree_equal_one_token(kv, ids)
    # The layers in one C call (kernels/decoder.c) and layer by layer from Python give the same bits.
    assert kv.lean.decoder is not None
    kv.keep(60)
    one_call = kv.forward(tokens, tree_parents=parents)
    with monkeypatch.context() as patch:
        patch.setattr(kv.lean, "decoder", None)  # (the loaded model's one lean model: put back after)
        kv.keep(60)
        assert torch.equal(kv.forward(tokens, tree_parents=parents), one_call)
    # Greedy speculation (prompt lookup on a repetitive prompt) gives plain q4 decoding's tokens.
    prompt = random_prompt(5, 8) * 5
    ref = SpeculativeDecoder(loaded, SpeculativeSpec("none")).generate(prompt, max_new_tokens=40)
    out = SpeculativeDecoder(loaded,
                             SpeculativeSpec("lookup", verifier="greedy", k=6)).generate(prompt, max_new_tokens=40)
    assert out.token_ids == ref.token_ids and ref.stats.exactness == "batched"


def test_greedy_rows_take_the_argmax_head_and_decode_the_full_heads_tokens(tiny_folders, cache, monkeypatch):
    """At q4 (head Q8_0) the rows of a greedy verification go through the argmax head (Rows.argmax): the logits that
    cannot be a row's greatest are -inf, the others the full head's bits. Greedy decoding, plain and speculative,
    gives the full head's tokens, and a request that reads more than the argmax (log-probabilities) gets every
    logit."""
    loaded = load_model(str(tiny_folders[0]), dtype="q4")
    ids = torch.tensor(random_prompt(4, 40))
    both = []
    for argmax in (False, True):
        kv = FastKVModel(loaded)
        kv.reset()
        both.append(kv.forward_many([Rows(kv, ids, want=12, argmax=argmax)])[0])
    full, masked = both
    kept = masked != float("-inf")
    assert torch.equal(masked.argmax(-1), full.argmax(-1)) and torch.equal(masked[kept], full[kept])
    assert kept.float().mean() < 0.5
    # One forward over a generation that reads its argmax alone and one that reads every logit: each gets its own.
    kvs = [FastKVModel(loaded) for _ in range(2)]
    for kv in kvs:
        kv.reset()
    mixed = kvs[0].forward_many([Rows(kvs[0], ids, want=12, argmax=True), Rows(kvs[1], ids, want=12)])
    assert torch.equal(mixed[0], masked) and torch.equal(mixed[1], full)
    prompt = random_prompt(5, 8) * 5
    runs, scored = {}, {}
    for head in ("argmax", "full"):
        with monkeypatch.context() as patch:
            if head == "full":
                patch.setattr(FastKVModel(loaded).lean, "argmax_head", None)  # (the loaded model's one lean model)
            for drafter in ("none", "lookup"):
                decoder = SpeculativeDecoder(loaded, SpeculativeSpec(drafter, verifier="greedy", k=6))
                runs[head, drafter] = decoder.generate(prompt, max_new_tokens=40).token_ids
            scored[head] = decoder.generate(prompt, max_new_tokens=8, logprobs=3).logprobs
    assert len(set(map(tuple, runs.values()))) == 1
    assert scored["argmax"] == scored["full"] and all(math.isfinite(t.logprob) for t in scored["full"])


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_tiny_model_at_fp32_and_bf16_runs_through_the_kernel_exactly(tiny_folders, cache, monkeypatch, dtype):
    """fp32 (a folder's default precision) and bf16: the lean path's layers are float layers over the model's own
    weights (the Hugging Face modules keep theirs, shared), all layers in one C call; a prefill, chains and a tree
    give one-token decoding's bits, and greedy speculation equals plain decoding, reported "batched". fp32's logits
    are PyTorch's within float rounding; bf16's are, bit for bit, fp32's on the bf16 weights widened (everything
    else computed in fp32). Without the kernel: PyTorch's layers, and no exactness claimed."""
    loaded = load_model(str(tiny_folders[0]), dtype=dtype)
    kv = FastKVModel(loaded)
    lean = kv.lean
    assert lean.invariant and not kv.row_by_row and lean.decoder is not None
    assert {type(m) for layer in lean.blocks for m in (layer[1], layer[2], layer[4], layer[5])} == {blocks.FloatLinear}
    attn = loaded.model.model.layers[0].self_attn
    assert type(attn.q_proj) is torch.nn.Linear and lean.blocks[0][1].weight.data_ptr() == attn.q_proj.weight.data_ptr()
    assert lean.blocks[0][1].kind == {"fp32": "F32", "bf16": "BF16"}[dtype]
    assert attn.q_proj.weight.dtype == DTYPES[dtype]
    ids = torch.tensor(random_prompt(3, 120))
    assert_chains_and_tree_equal_one_token(kv, ids)
    kv.reset(128)
    if dtype == "fp32":
        with torch.no_grad():
            reference = loaded.model(ids[None, :90]).logits[0]
        assert torch.allclose(kv.forward(ids[:90]), reference, rtol=1e-4, atol=1e-4)
    else:
        widened = load_model(str(tiny_folders[0]), dtype="fp32")
        widened.model.load_state_dict({k: v.float() for k, v in loaded.model.state_dict().items()})
        assert torch.equal(kv.forward(ids[:90]), FastKVModel(widened).forward(ids[:90]))
    prompt = random_prompt(5, 8) * 5
    ref = SpeculativeDecoder(loaded, SpeculativeSpec("none")).generate(prompt, max_new_tokens=40)
    for drafter in (get_drafter("lookup"), get_drafter("model", loaded, loaded)):  # (itself: every draft verified)
        out = SpeculativeDecoder(loaded, SpeculativeSpec(verifier="greedy", k=6),
                                 drafter=drafter).generate(prompt, max_new_tokens=40)
        assert out.token_ids == ref.token_ids and ref.stats.exactness == "batched", drafter.name
    assert out.stats.accepted_draft_tokens > 20
    monkeypatch.setenv("SPECULATE_NO_KERNEL", "1")
    plain = SpeculativeDecoder(load_model(str(tiny_folders[0]), dtype=dtype), SpeculativeSpec("none"))
    assert plain.generate(prompt, max_new_tokens=4).stats.exactness == "none"


@pytest.mark.slow
def test_default_model_q4_runs_the_ggufs_own_blocks(default_model):
    """Every q4 layer of the default model de-quantizes to exactly the fp32 weights the converter read from the
    same GGUF (the layers Q4_1, the tied head Q8_0, as the file has them), and q4 greedy speculation (lookup,
    retrieval) equals plain q4 decoding."""
    q4 = load_model(dtype="q4")
    fp32 = default_model.model
    layer = q4.model.model.layers[3]
    assert layer.self_attn.qkv_proj.kind == "Q4_1" and q4.model.lm_head.kind == "Q8_0"
    a = fp32.model.layers[3].self_attn
    assert torch.equal(layer.self_attn.qkv_proj.dequantized_weight(),
                       torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
    assert torch.equal(layer.mlp.down_proj.dequantized_weight(), fp32.model.layers[3].mlp.down_proj.weight)
    assert torch.equal(q4.model.lm_head.dequantized_weight(), fp32.lm_head.weight)
    from speculate.bench.datasets import load_dataset

    prompts = [[{"role": "user", "content": s.turns[0]}] for s in load_dataset("mt_bench", limit=6)]
    plain = SpeculativeDecoder(q4, SpeculativeSpec("none"))
    for method in ("lookup", "retrieval"):
        decoder = SpeculativeDecoder(q4, SpeculativeSpec(method, verifier="greedy", k=5))
        for prompt in prompts:
            ref = plain.generate(prompt, max_new_tokens=32)
            assert decoder.generate(prompt, max_new_tokens=32).token_ids == ref.token_ids, (method, prompt)


def test_auto_precision_is_q4_only_where_the_gguf_runs_as_it_ships(tiny_folders):
    from speculate.models import resolve_dtype

    assert resolve_dtype("smollm2-135m-instruct", "auto") == "q4"  # Q4_1 layers and a Q8_0 head
    assert resolve_dtype("qwen2.5-coder-1.5b-instruct", "auto") == "q4"  # Q4_K, Q6_K
    assert resolve_dtype("gemma-3-270m", "auto") == "fp32"  # not a Llama-family model: q4 is not checked there
    assert resolve_dtype(str(tiny_folders[0]), "auto") == "fp32"  # a folder: q4 would quantize it
    assert resolve_dtype(str(tiny_folders[0]), "int8") == "int8"
    assert load_model(str(tiny_folders[0]), dtype="auto").dtype == "fp32"
    with pytest.raises(SpeculateError, match="auto"):
        load_model(str(tiny_folders[0]), dtype="q3")


def test_without_a_compiler_auto_is_fp32_and_q4_says_why(tiny_folders, cache, monkeypatch):
    from speculate.models import resolve_dtype

    monkeypatch.setenv("SPECULATE_NO_KERNEL", "1")
    assert resolve_dtype("smollm2-135m-instruct", "auto") == "fp32"
    with pytest.raises(SpeculateError, match="C compiler"):
        load_model(str(tiny_folders[1]), dtype="q4")


def test_q4a8_is_q4s_tensors_at_one_activation_row_judged_once_per_model(tiny_folders, cache, monkeypatch):
    """--dtype q4a8: q4's cached tensors with one 8-bit activation row in every layer (the kernel's arithmetic at
    passes=1 is checked above), so its logits are not q4's; its quality gate runs at the first load only and the
    verdict is cached; a failing verdict warns at every load, from the cache, without judging again."""
    import json
    import warnings

    from speculate.models import quality
    from speculate.models.loader import QualityWarning

    from speculate.models import loader

    # (a random tiny model at 4 bits is far from its fp32 self: the gate's limits are for real models)
    monkeypatch.setattr(quality, "MAX_MEAN_GAP", 10.0)
    monkeypatch.setattr(quality, "MAX_WORST_GAP", 10.0)
    monkeypatch.setattr(loader, "CLOSE", 0)
    q4 = load_model(str(tiny_folders[1]), dtype="q4")
    a8 = load_model(str(tiny_folders[1]), dtype="q4a8")
    assert a8.dtype == "q4a8" and a8.weights == q4.weights.replace(" x2", " x1") and a8.weights.endswith(" x1")
    passes = {m.passes for m in a8.model.modules() if isinstance(m, blocks.BlockLinear)}
    assert passes == {1} and {m.passes for m in q4.model.modules() if isinstance(m, blocks.BlockLinear)} == {2}
    ids = torch.tensor(random_prompt(7, 40))
    one, two = FastKVModel(a8), FastKVModel(q4)
    one.reset(64), two.reset(64)
    assert not torch.equal(one.forward(ids), two.forward(ids))
    (gate,) = cache.glob("*.q4a8/gate.json")
    stored = json.loads(gate.read_text())
    assert stored["q4"] == blocks.settings() | {"close": "0", "source": stored["q4"]["source"]}
    assert len(stored["verdict"]["rows"]) == len(quality.GATE_PROMPTS) and stored["verdict"]["passed"]

    def judged(*args, **kwargs):
        raise AssertionError("the gate ran again")

    with monkeypatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("error", QualityWarning)
        patch.setattr(quality, "reference_answers", judged)
        patch.setattr(quality, "gate", judged)
        assert load_model(str(tiny_folders[1]), dtype="q4a8").weights == a8.weights
    # A model that fails it: judged once, then warned about from the cache.
    __import__("shutil").rmtree(gate.parent)
    failing = quality.Verdict(False, ["a degenerate answer where fp32's is not: 'x'"], 0.0, 0.0, [])
    monkeypatch.setattr(quality, "gate", lambda *args, **kwargs: failing)
    with pytest.warns(QualityWarning, match="q4a8 .* failed its quality gate .* degenerate"):
        load_model(str(tiny_folders[1]), dtype="q4a8")
    monkeypatch.setattr(quality, "gate", judged)
    monkeypatch.setattr(quality, "reference_answers", judged)
    with pytest.warns(QualityWarning, match="failed its quality gate"):
        assert load_model(str(tiny_folders[1]), dtype="q4a8").dtype == "q4a8"
