"""int8 weights with SmoothQuant smoothing: accurate, batch-invariant, and faster on CPU.

What runs: every linear layer (the LM head included) becomes an :class:`Int8Linear`: int8 weights with
one scale per output channel, and activations quantized on the fly *per row* (per token) as two int8 rows, the row
and what its rounding missed (:func:`split_rows`: ~15 bits in all). The integer matmul is PyTorch's fbgemm kernel
(exact integer products); both rows go through one call, so a decode step still reads the weights once. Its fixed
cost per call (~20 us, 121 calls a SmolLM2 step) is why an int8 step is under 2x faster than fp32 on 2 cores, not 4x
(docs/benchmarks.md, "int8"). Per-row scales make a row's result independent, bit for bit, of the other
rows in the call (PyTorch's own dynamic quantization uses one scale per call); with the fast path's
batch-invariant attention (kernel.py) a draft verified in one forward gets exactly the logits that
one-token-at-a-time decoding gives, so greedy speculative decoding stays exact at int8.

Why two rows: with one 8-bit row per token, the activations' rounding alone changed whole answers of the default
model (MT-Bench question 81 answered "La la la ..."; docs/benchmarks.md, "No precision may break the model"); with
two, int8's error is its weights' (KL(fp32‖int8) per token 0.013 → 0.005 on 36 shipped prompts), and every
conversion passes models/quality.py's gate on whole answers before it is cached.

Why smoothing: SmolLM2-class models have a few activation channels far larger than the rest, and one
int8 scale per row then crushes every other channel. SmoothQuant (Xiao et al. 2023) moves that range
into the weights: for input channel j of a linear layer, s_j = max|X_j|^α / max|W_j|^(1−α); the layer's
weight columns are multiplied by s and its input divided by s, and the division is folded into the
operation before it, so nothing is added at run time:

* q/k/v and gate/up: the preceding RMSNorm's weight is divided by s;
* down_proj: silu(g)·u/s = silu(g)·(u/s), so up_proj's rows are divided by s;
* o_proj: its input channel (h, d) is value channel (h // (heads per KV head), d), so v_proj's rows
  (and bias) are divided by s, one s per value channel, shared by the query heads of a KV group;
* the LM head: the final norm's weight is divided by s; the tied embedding keeps its own fp32 copy.

max|X_j| is calibrated by running the model in float64 over :data:`CALIBRATION` (a fixed, self-contained
text: chat turns with arithmetic, prose and code; ~1,000 tokens; the whole conversion takes ~8 s for the
default model on one core), and it and s are rounded to bf16's grid, so the int8 weights are the same on
every CPU (see :func:`_on_grid`). Only Llama-family models (Llama, Qwen2, Mistral) are smoothed and fused;
other architectures get unsmoothed int8 layers and run on the Hugging Face path, where batched rows are
not bit-exact.

Smoothing, per-channel weight scales and no layer kept in fp32 are what agreed best with fp32 on held-out
text (the comparisons: docs/benchmarks.md, "How the quantizer was chosen"; α with two activation rows: :data:`ALPHA`).

Everything that touches PyTorch's quantized kernels is in :func:`_pack`, :func:`_unpack` and
:func:`_kernel` (quantized tensors are deprecated in PyTorch; torch.ao.quantization itself is not used):
replacing them (torchao, a custom kernel) is a change to those three alone. The kernel's integer products
are exact with VNNI; without it fbgemm saturates 16-bit pair sums of full-range uint8 activations, so there
each activation row is two rows of 7 bits and stays exact (:func:`activation_levels`, measured once per process).

:func:`quantize` returns plain tensors (int8 weights, scales, biases, and the smoothed fp32 norm
weights): the loader caches them (atomic, checksummed) and :func:`apply` rebuilds the int8 model from
them without calibrating again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import warnings

import torch
from torch import nn

from ..errors import SpeculateError, SpeculateWarning

# Bump when the cached tensors or their numerics change. 2: statistics and s in float64 on bf16's grid (were fp32,
# CPU-dependent). 3: activations as two int8 rows (split_rows); the tensors are FORMAT 2's (the same digest).
FORMAT = 3
# SmoothQuant migration strength α per kind of layer. Measured on SmolLM2-135M (held-out GSM8K test
# answers and MT-Bench questions, mean of α ± 0.004): 0.5 everywhere gives KL(fp32‖int8) 0.019 / 0.028
# per token; α = 0.8 for q/k/v 0.016 / 0.023; other changes (0.6 everywhere; 0.9, 0.7, 0.6, 0.45 on
# single kinds) were no better. With two activation rows (FORMAT 3) the activations' error is gone and smoothing only
# shapes the weights: on 36 shipped prompts (default model) KL 0.0053 with this α, 0.0047 at 0.5, 0.0036 at 0.3, 0.0040
# unsmoothed; kept, since the Qwen pair was not measured that way yet and this α's conversion is pinned (the tests).
ALPHA = {"qkv_proj": 0.8, "o_proj": 0.5, "gate_up_proj": 0.5, "down_proj": 0.5, "lm_head": 0.5}
SMOOTHED = {"llama", "qwen2", "mistral"}  # architectures whose structure smooth() knows

# (user, assistant) turns for calibration; rendered with the chat template where the tokenizer has one.
CALIBRATION = [
    ("A baker makes 36 muffins in the morning and twice as many in the afternoon. She sells 75 of them. "
     "How many muffins are left?",
     "In the afternoon she makes 2 x 36 = 72 muffins.\nAltogether she makes 36 + 72 = 108 muffins.\n"
     "After selling 75, she has 108 - 75 = 33 muffins left.\nThe answer is 33."),
    ("A train travels 180 km in 2.5 hours. At the same speed, how far does it go in 4 hours?",
     "Its speed is 180 / 2.5 = 72 km per hour. In 4 hours it travels 72 * 4 = 288 km.\n#### 288"),
    ("Tom has $50. He buys 3 notebooks at $4.25 each and a pen for $1.80. What fraction of his money "
     "does he spend, and how much change does he get?",
     "The notebooks cost 3 x $4.25 = $12.75. With the pen he spends $12.75 + $1.80 = $14.55.\n"
     "His change is $50 - $14.55 = $35.45, and he spends 14.55 / 50 = 29.1% of his money."),
    ("Explain why the sky looks blue during the day but red at sunset.",
     "Sunlight contains every color. Air molecules scatter short wavelengths, such as blue, much more "
     "strongly than long ones, so blue light reaches our eyes from all directions of the sky. At sunset "
     "the light crosses far more air before it reaches us; most of the blue is scattered away on the "
     "way, and the remaining orange and red light colors the horizon."),
    ("Write a short paragraph about the history of the printing press.",
     "Around 1440, Johannes Gutenberg combined movable metal type, oil-based ink and a screw press "
     "adapted from wine making. Books that had taken scribes months to copy could now be printed in "
     "days, prices fell, and literacy spread across Europe. Within fifty years, presses operated in "
     "more than two hundred cities, and pamphlets, newspapers and scientific journals followed."),
    ("Write a Python function that returns the n-th Fibonacci number.",
     "Here is an iterative version that runs in linear time:\n\n```python\n"
     "def fibonacci(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci number (fibonacci(0) == 0).\"\"\"\n"
     "    if n < 0:\n        raise ValueError(\"n must be non-negative\")\n    a, b = 0, 1\n"
     "    for _ in range(n):\n        a, b = b, a + b\n    return a\n```\n\n"
     "For example, `fibonacci(10)` returns 55."),
    ("Give me three tips for a job interview.",
     "1. Research the company: know its products, its customers and recent news.\n"
     "2. Prepare concrete examples of problems you solved, using the situation, task, action and "
     "result format.\n3. Ask thoughtful questions at the end; it shows genuine interest in the role."),
    ("Translate to French: The weather is nice today, let's go for a walk in the park.",
     "Il fait beau aujourd'hui, allons nous promener dans le parc."),
]


# ---------------------------------------------------------------------------------------------------
# The int8 layer: the only code that touches PyTorch's quantized kernels.

def _pack(int8: torch.Tensor, scales: torch.Tensor):
    """fbgemm's packed form of an int8 weight [out, in] with per-output-channel scales."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated; this is their one use
        q = torch._make_per_channel_quantized_tensor(
            int8.contiguous(), scales.double(), torch.zeros(len(scales), dtype=torch.long), 0)
        return torch.ops.quantized.linear_prepack(q, None)


def _unpack(packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, fp32 scales) back from :func:`_pack`'s result."""
    q, _ = torch.ops.quantized.linear_unpack(packed)
    return q.int_repr().contiguous(), q.q_per_channel_scales().float().contiguous()


def _kernel():
    """fp32 x, quantized to uint8 with a given scale and zero point, times a packed int8 weight → fp32
    (integer products, then one float rescale per output)."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32.default


def _exact_at(levels: int) -> bool:
    """Whether the kernel's products are exact with activations quantized to ±``levels`` (zero point
    levels + 1), on the inputs that overflow a 16-bit pair sum soonest: every activation at +1 (uint8
    2·levels + 1) against weights all at +127 or all at −127; one row (a decode step) and eight (a verification)."""
    int8 = torch.full((16, 256), 127, dtype=torch.int8)
    int8[8:] = -127
    packed = _pack(int8, torch.ones(16))
    want = 127.0 * 256 * int8[:, 0].float().sign()
    # (a saturated sum is off by half or more)
    return all(torch.allclose(_kernel()(torch.ones(rows, 256), 1 / levels, levels + 1, packed), want.expand(rows, -1),
                              rtol=1e-5, atol=0) for rows in (1, 8))


@functools.cache
def activation_levels() -> int:
    """The int8 activations' levels on each side of 0 on this CPU: 127, or 63 where 127 would saturate.

    fbgemm multiplies uint8 activations (the int8 value + a zero point) by int8 weights. With VNNI
    (``vpdpbusd``: Intel since Cascade Lake, AMD since Zen 4) products accumulate straight into int32,
    exactly. Without it (AVX2, and AVX-512 before VNNI) adjacent products are first added in int16 with
    saturation (``vpmaddubsw``): two products of 255 × 127 exceed 32,767 and the result is silently
    wrong. With 63 levels and zero point 64 every uint8 is at most 127 and a pair at most 2 × 127 × 127 =
    32,258: exact by construction, at 7-bit activation precision. Measured (:func:`_exact_at`), not read
    off the CPU's flags: the kernel's own dispatch decides (``FBGEMM_ENABLE_INSTRUCTIONS`` forces it)."""
    for levels in (127, 63):
        if _exact_at(levels):
            return levels
    raise SpeculateError("this CPU's int8 kernel (fbgemm) does not compute exact integer products; "
                         "use --dtype fp32")


class QuantizedLinear(nn.Module):
    """What the lean path (fast.py) calls on a quantized layer: ``matmul_2d(x)`` = x Wᵀ + b and
    ``add_matmul_2d(residual, x)`` = residual + x Wᵀ + b for 2-D x; ``dequantized_weight()``. Int8Linear here,
    BlockLinear (GGUF blocks) in blocks.py.

    ``passes``: integer activation rows per row of x, 2 (the row and what its rounding missed, ~15 bits) or 1
    (8 bits: the numerics before issue 34, which broke the default model's answers; ``--dtype q4a8`` opts into it
    for a model whose own gate passes, models/loader.py; and the probes and the quality test show what the second
    row buys, through :func:`set_activation_passes`)."""

    in_features: int
    out_features: int
    passes: int = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self.matmul_2d(x)
        return self.matmul_2d(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)

    def matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def add_matmul_2d(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes a forward reads (weights and scales)."""
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    """``y = x Wᵀ + b`` with an int8 W (symmetric, one scale per output row) and x quantized per row.

    Each row of x is scaled by its own max |x| and written as two integer rows on the grid of L levels (L =
    :func:`activation_levels`: 127, or 63 where fbgemm would saturate; :func:`split_rows`), and the integer
    products are rescaled by that max: rows never influence each other's rounding.
    """

    def __init__(self, int8: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = int8.shape
        self._packed = _pack(int8, scales)
        self._matmul = _kernel()  # looked up once: it runs 121 times per SmolLM2 step
        levels = activation_levels()
        # Constants of the activations' grid, computed once (not on the hot path): the kernel is handed the
        # integers themselves (scale 1, zero point L + 1), the low row carries 2L levels per high step.
        self._levels, self._zero, self._low = float(levels), levels + 1, 1 / (2 * levels)
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, per_channel: bool = True):
        int8, scales = quantize_weight(weight, per_channel)
        return cls(int8, scales, bias)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 weight, fp32 scales), as plain tensors."""
        return _unpack(self._packed)

    def dequantized_weight(self) -> torch.Tensor:
        int8, scales = self.tensors()
        return int8.float() * scales[:, None]

    def matmul_2d(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` for x of shape [rows, in_features] (the lean path calls this directly).

        Each row x is written as r/L · (hi + lo/2L), hi and lo integers in [−L, L] (:func:`split_rows`), and both
        go through the integer kernel as two rows of one call, so a row costs one more row of integer products
        (a decode step reads the weights once either way), not a second pass over them."""
        if self.passes == 1:  # one row: x / r on the grid 1/L (see the class's docstring)
            y, r = self._one_row(x)
            return y.mul_(r) if self.bias is None else torch.addcmul(self.bias, y, r)
        n = x.shape[0]
        r, rows = split_rows(x, self._levels)
        y = self._matmul(rows, 1.0, self._zero, self._packed)  # [hi; lo] · Wᵀ: exact integer sums, rescaled
        # (hi + lo/2L) · r/L, each step one separately rounded float op on this row's values alone
        y = y[n:].mul_(self._low).add_(y[:n]).mul_(r.div_(self._levels))
        return y if self.bias is None else y.add_(self.bias)

    def add_matmul_2d(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + forward(x)`` for 2-D x."""
        if self.passes == 1:  # (the one-row numerics as they were, rounding included)
            y, r = self._one_row(x)
            y = torch.addcmul(residual, y, r)
            return y if self.bias is None else y.add_(self.bias)
        return self.matmul_2d(x).add_(residual)

    def _one_row(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One 8-bit row per row of x: (the integer products of x / r on the grid 1/L, r = max |x|)."""
        r = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)
        return self._matmul(x / r, 1 / self._levels, self._zero, self._packed), r

    def weight_bytes(self) -> int:
        return self.in_features * self.out_features + 4 * self.out_features

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class LinearPart(nn.Module):
    """Output columns [start, stop) of a fused :class:`QuantizedLinear` (q_proj of a fused q/k/v, ...), so
    that the Hugging Face modules keep working on the fused int8 weights. The lean path (fast.py)
    calls the fused layer once instead."""

    def __init__(self, whole: QuantizedLinear, start: int, stop: int):
        super().__init__()
        self.whole_ref = [whole]  # a list: not registered as a submodule (the parent owns it)
        self.start, self.stop = start, stop
        self.in_features, self.out_features = whole.in_features, stop - start

    @property
    def whole(self) -> QuantizedLinear:
        return self.whole_ref[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.whole(x)[..., self.start: self.stop]


def quantize_weight(weight: torch.Tensor, per_channel: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in [-127, 127]: (int8 [out, in], fp32 scales [out]); one shared scale when
    ``per_channel`` is False (stored per row all the same)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1) if per_channel else w.abs().amax().expand(w.shape[0])
    scales = (amax / 127).clamp_min(1e-12)
    int8 = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return int8, scales.contiguous()


def split_rows(x: torch.Tensor, levels: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, k] → (r [n, 1], [hi; lo] [2n, k]): per row r = max |x| and u = x · L / r, hi = round(u) and lo =
    round((u − hi) · 2L), so that x = r/L · (hi + lo/2L) to within r / (4L²) (L = ``levels``: 127, or 63 where the
    kernel needs 7 bits). hi and lo are integers in [−L, L], given to the kernel as they are.

    Why two rows: one int8 row per token (x ≈ r/L · hi) leaves an error of r / 2L on every channel, and a row with
    one large channel (SmolLM2's and Qwen's activations have them) loses its small ones; on the default model that
    error alone flipped first tokens and collapsed whole answers (MT-Bench question 81 at int8: "La la la ...";
    docs/benchmarks.md, "int8 that never breaks the model"). With the low row the activations carry ~15 bits (~13
    at L = 63) and int8's error is the weights' alone. Every value is a function of its own row only, computed by
    elementwise ops each rounded once, so rows stay independent of each other bit for bit."""
    r = x.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-30)
    u = x * (levels / r)
    rows = x.new_empty(2 * x.shape[0], x.shape[1])  # [hi; lo] written in place: no concatenation copy
    hi = torch.round(u, out=rows[: x.shape[0]])
    torch.sub(u, hi, out=rows[x.shape[0]:]).mul_(2 * levels).round_()
    return r, rows


def set_activation_passes(model: nn.Module, passes: int) -> None:
    """Every quantized layer of ``model`` with ``passes`` activation rows per row (1 or 2; QuantizedLinear)."""
    if passes not in (1, 2):
        raise ValueError(f"passes is 1 or 2, not {passes}")
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.passes = passes


# ---------------------------------------------------------------------------------------------------
# Which layers are quantized, and how they are fused.

def plan(model: nn.Module) -> list[tuple[str, list[str]]]:
    """(int8 layer name, [the model's linear layers it replaces]), in model order. Llama-family layers
    fuse q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (beside the originals)."""
    if _smoothable(model):
        out = []
        for i in range(len(model.model.layers)):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            out += [(f"{a}.qkv_proj", [f"{a}.q_proj", f"{a}.k_proj", f"{a}.v_proj"]), (f"{a}.o_proj", [f"{a}.o_proj"]),
                    (f"{m}.gate_up_proj", [f"{m}.gate_proj", f"{m}.up_proj"]), (f"{m}.down_proj", [f"{m}.down_proj"])]
        return out + [("lm_head", ["lm_head"])]
    return [(name, [name]) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]


def _smoothable(model: nn.Module) -> bool:
    return getattr(model.config, "model_type", None) in SMOOTHED and hasattr(model, "lm_head")


def _selected(name: str, names) -> bool:
    """``name`` matches an entry of ``names`` as itself or as its last component(s)."""
    return any(name == n or name.endswith("." + n) for n in names)


# ---------------------------------------------------------------------------------------------------
# Calibration and smoothing (fp32; mathematically a no-op).

def calibration_ids(tokenizer) -> list[list[int]]:
    """The calibration text as token id sequences (one per conversation turn pair)."""
    out = []
    for user, assistant in CALIBRATION:
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": user},
                                                 {"role": "assistant", "content": assistant}],
                                                tokenize=True, return_dict=False)
        else:
            ids = tokenizer(f"{user}\n\n{assistant}\n\n")["input_ids"]
        out.append(list(ids))
    return out


# Every number that fixes the int8 weights is computed in float64 and then rounded to bfloat16's grid, so that
# it does not depend on the CPU: the fp32 kernels that run the model (BLAS blocking, vector width, threads)
# round differently from one CPU to another (statistics up to 2e-5 apart between AVX-512 and AVX2 kernels), and
# that moved 823 of the default model's 134 M int8 weights (2026-12-02). float64 kernels differ by ~1e-16 per
# operation instead (5e-14 in the statistics); a value that far from a boundary rounds the same everywhere. A
# value within MARGIN (relative) of a boundary between two grid points could round either way on another
# CPU: those are counted and reported (:func:`quantize` warns), never silently trusted. bf16's grid (2^-8
# relative) costs nothing in accuracy: s_j moves by ≤ 0.4 %, and smoothing folds the same s into both sides.
GRID = torch.bfloat16
MARGIN = 1e-10


def _on_grid(x64: torch.Tensor, near: list[int] | None = None) -> torch.Tensor:
    """float64 ``x64`` rounded to :data:`GRID`, as fp32; appends to ``near`` how many entries lie within
    a relative :data:`MARGIN` of a rounding boundary: there another CPU's float64 sums, a few ulps away,
    could round to the neighbouring grid value."""
    grid = x64.to(GRID)
    if near is not None:
        moved = (x64 * (1 - MARGIN)).to(GRID).ne(grid) | (x64 * (1 + MARGIN)).to(GRID).ne(grid)
        near.append(int(moved.sum()))
    return grid.float()


def _rms64(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """Llama's RMSNorm (x / rms(x) · w) in float64."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.double()


def _rope64(model: nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos and sin [length, head_dim] in float64. The default rope's frequencies are recomputed in
    float64 (Hugging Face computes them in fp32, with a vectorised pow); other rope types' come from the
    model's buffer, as they are."""
    rotary = model.model.rotary_emb
    inv = rotary.inv_freq.double()
    theta = (getattr(model.config, "rope_parameters", None) or {}).get("rope_theta")
    if getattr(rotary, "rope_type", "default") == "default" and theta:
        exact = 1.0 / (float(theta) ** (torch.arange(0, 2 * len(inv), 2, dtype=torch.float64) / (2 * len(inv))))
        if torch.allclose(exact, inv, rtol=1e-6):  # the same frequencies: the buffer is their fp32 rounding
            inv = exact
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    scale = float(getattr(rotary, "attention_scaling", 1.0))
    return angles.cos() * scale, angles.sin() * scale


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as Hugging Face's Llama applies it (x [heads, T, d]; the halves' rotation)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@torch.inference_mode()
def hf_statistics(model: nn.Module, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """The reference for :func:`calibrate`: max |x_j| of every linear layer's input, by hooks on Hugging Face's own
    forward in the model's dtype, unrounded (float64 tensors). FORMAT 1 calibrated this way at fp32, which made
    the int8 weights depend on the CPU (benchmarks/probes/int8_cpu_paths.py --old); tests/test_int8.py checks
    calibrate() against it."""
    stats: dict[str, torch.Tensor] = {}
    hooks = []

    def hook(name):
        def record(module, args):
            amax = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).double()
            stats[name] = amax if name not in stats else torch.maximum(stats[name], amax)
        return record

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            hooks.append(module.register_forward_pre_hook(hook(name)))
    try:
        for ids in sequences:
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return stats


@torch.inference_mode()
def calibrate(model: nn.Module, sequences: list[list[int]], near: list[int] | None = None) -> dict[str, torch.Tensor]:
    """max |x_j| over the calibration tokens, per input channel j of every linear layer of a Llama-family
    model, on :data:`GRID` (see :func:`_on_grid`; ``near`` collects the count of values near a boundary).

    The decoder runs here in float64, one layer at a time over every sequence (a layer's weights are
    converted once, and a float64 copy of the whole model, 2x its fp32 memory, is never made). It is
    Hugging Face's Llama/Qwen2/Mistral forward (tests/test_int8.py compares the two): the calibration turns
    are a few hundred tokens, shorter than any sliding window of these architectures."""
    cfg, decoder = model.config, model.model
    n_heads, n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
    stats: dict[str, torch.Tensor] = {}

    def record(name: str, x: torch.Tensor) -> None:
        amax = x.abs().amax(dim=0)
        stats[name] = amax if name not in stats else torch.maximum(stats[name], amax)

    embed = decoder.embed_tokens.weight
    hidden = [embed[torch.tensor(ids)].double() for ids in sequences]  # [T, H] per sequence
    ropes = [_rope64(model, len(ids)) for ids in sequences]
    for i, layer in enumerate(decoder.layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        w = {name: p.detach().double() for name, p in layer.named_parameters()}

        def linear(x, name):
            return torch.nn.functional.linear(x, w[name + ".weight"], w.get(name + ".bias"))

        attn = layer.self_attn
        for j, (h, (cos, sin)) in enumerate(zip(hidden, ropes)):
            t = h.shape[0]
            x = _rms64(h, layer.input_layernorm)  # q/k/v's input
            for name in ("q_proj", "k_proj", "v_proj"):
                record(a + name, x)
            q, k, v = (linear(x, f"self_attn.{name}").view(t, -1, attn.head_dim).transpose(0, 1)
                       for name in ("q_proj", "k_proj", "v_proj"))  # [heads, T, d]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            k, v = k.repeat_interleave(n_heads // n_kv, dim=0), v.repeat_interleave(n_heads // n_kv, dim=0)
            scores = (q @ k.transpose(1, 2)) * attn.scaling
            scores.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))  # causal
            o = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1)  # o_proj's input
            record(a + "o_proj", o)
            h = h + linear(o, "self_attn.o_proj")
            x = _rms64(h, layer.post_attention_layernorm)  # gate/up's input
            record(m + "gate_proj", x)
            record(m + "up_proj", x)
            u = layer.mlp.act_fn(linear(x, "mlp.gate_proj")) * linear(x, "mlp.up_proj")  # down_proj's input
            record(m + "down_proj", u)
            hidden[j] = h + linear(u, "mlp.down_proj")
    if isinstance(model.get_output_embeddings(), nn.Linear):
        for h in hidden:
            record("lm_head", _rms64(h, decoder.norm))  # the final norm's output: the LM head's input
    return {name: _on_grid(amax, near) for name, amax in stats.items()}


def smooth(model: nn.Module, stats: dict[str, torch.Tensor], alpha: float | dict[str, float] = ALPHA,
           skip=(), layers=None, head: bool = True, near: list[int] | None = None) -> dict[str, torch.Tensor]:
    """SmoothQuant scales folded into the weights: {parameter name: new fp32 tensor} for every
    parameter that changes (the model itself is not modified). Layers named in ``skip`` (see
    :func:`_selected`) are left as they are. The result computes the same function as the model.
    ``alpha``: one value, or one per kind of layer (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head).
    ``layers`` (indices; default all) and ``head``: which parts to smooth (one at a time saves memory).
    Every s is on :data:`GRID` (``near``: see :func:`_on_grid`), so the folds are exact to the tensors' rounding."""
    if not _smoothable(model):
        return {}

    def _scales(act, wmax, kind):  # float64, then GRID: see _on_grid
        a = alpha.get(kind, 0.5) if isinstance(alpha, dict) else alpha
        act, wmax = act.double().clamp_min(1e-5), wmax.double().clamp_min(1e-5)
        return _on_grid((act.pow(a) / wmax.pow(1 - a)).clamp_min(1e-5), near)

    params = dict(model.named_parameters(remove_duplicate=False))
    new: dict[str, torch.Tensor] = {}

    def get(name):
        return new[name] if name in new else params[name].detach()

    def has(name):
        return name in new or name in params

    cfg = model.config
    for i in range(len(model.model.layers)) if layers is None else layers:
        layer = model.model.layers[i]
        pre = f"model.layers.{i}."
        a, m = pre + "self_attn.", pre + "mlp."
        # o_proj ← v_proj rows: one s per value channel (g, d), shared by the query heads of group g.
        if not _selected(a + "o_proj", skip) and not _selected(a + "qkv_proj", skip):
            n_kv, hd = cfg.num_key_value_heads, layer.self_attn.head_dim
            rep = cfg.num_attention_heads // n_kv
            o_w = get(a + "o_proj.weight")
            act = stats[a + "o_proj"].view(n_kv, rep, hd).amax(dim=1)
            wmax = o_w.abs().amax(dim=0).view(n_kv, rep, hd).amax(dim=1)
            s = _scales(act, wmax, "o_proj").reshape(-1)  # [n_kv * hd], v_proj's rows
            new[a + "o_proj.weight"] = o_w * s.view(n_kv, 1, hd).expand(n_kv, rep, hd).reshape(1, -1)
            new[a + "v_proj.weight"] = get(a + "v_proj.weight") / s[:, None]
            if has(a + "v_proj.bias"):
                new[a + "v_proj.bias"] = get(a + "v_proj.bias") / s
        # down_proj ← up_proj rows.
        if not _selected(m + "down_proj", skip) and not _selected(m + "gate_up_proj", skip):
            d_w = get(m + "down_proj.weight")
            s = _scales(stats[m + "down_proj"], d_w.abs().amax(dim=0), "down_proj")
            new[m + "down_proj.weight"] = d_w * s
            new[m + "up_proj.weight"] = get(m + "up_proj.weight") / s[:, None]
        # q/k/v ← input norm, gate/up ← post-attention norm.
        for group, members, norm, stat in (
                ("qkv_proj", ["q_proj", "k_proj", "v_proj"], "input_layernorm", a + "q_proj"),
                ("gate_up_proj", ["gate_proj", "up_proj"], "post_attention_layernorm", m + "gate_proj")):
            prefix = a if group == "qkv_proj" else m
            if _selected(prefix + group, skip):
                continue
            ws = [get(f"{prefix}{p}.weight") for p in members]
            s = _scales(stats[stat], torch.cat(ws).abs().amax(dim=0), group)
            for p, w in zip(members, ws):
                new[f"{prefix}{p}.weight"] = w * s
            new[f"{pre}{norm}.weight"] = get(f"{pre}{norm}.weight") / s
    # LM head ← final norm (the LM head gets its own copy: the tied embedding is left alone).
    if head and not _selected("lm_head", skip):
        w = get("lm_head.weight")
        s = _scales(stats["lm_head"], w.abs().amax(dim=0), "lm_head")
        new["lm_head.weight"] = w * s
        new["model.norm.weight"] = get("model.norm.weight") / s
    return new


# ---------------------------------------------------------------------------------------------------
# The whole conversion, and rebuilding from its tensors.

def settings() -> dict[str, str]:
    """What the cached tensors depend on besides the model (stored with them; a mismatch rebuilds)."""
    return {"format": str(FORMAT), "alpha": json.dumps(ALPHA, sort_keys=True),
            "calibration": hashlib.sha256(json.dumps(CALIBRATION).encode()).hexdigest()[:16]}


def quantize(model: nn.Module, tokenizer, alpha: float | dict[str, float] = ALPHA, per_channel: bool = True,
             keep_fp32=(), smooth_layers: bool = True) -> dict[str, torch.Tensor]:
    """Calibrate, smooth and quantize ``model`` (fp32, unmodified): the tensors :func:`apply` takes.

    ``keep_fp32``: layer names (e.g. ``"down_proj"``, ``"lm_head"``, a full name) left in fp32.
    Keys: ``int8.<layer>.{weight,scales,bias}`` for int8 layers, ``fp32.<parameter>`` for changed fp32
    parameters (smoothed norms, smoothed layers kept in fp32)."""
    smoothing = smooth_layers and _smoothable(model)
    near: list[int] = []  # values near a rounding boundary (see _on_grid)
    stats = calibrate(model, calibration_ids(tokenizer), near) if smoothing else {}
    params = dict(model.named_parameters(remove_duplicate=False))
    groups = plan(model)
    # One decoder layer at a time (then the head): the smoothed fp32 copies of one layer at most.
    parts = [(f"model.layers.{i}.", [i], False) for i in range(len(model.model.layers))] if smoothing else []
    parts.append(("", [], True))
    out: dict[str, torch.Tensor] = {}
    done = set()
    for prefix, layers, head in parts:
        new = smooth(model, stats, alpha, skip=keep_fp32, layers=layers, head=head, near=near) if smoothing else {}

        def get(name):
            return new[name] if name in new else params[name].detach()

        quantized = set()
        for fused, members in groups:
            if fused in done or not fused.startswith(prefix):
                continue
            done.add(fused)
            if _selected(fused, keep_fp32) or any(_selected(n, keep_fp32) for n in members):
                continue
            int8, scales = quantize_weight(torch.cat([get(n + ".weight") for n in members]), per_channel)
            out[f"int8.{fused}.weight"], out[f"int8.{fused}.scales"] = int8, scales
            if all(n + ".bias" in params for n in members):
                out[f"int8.{fused}.bias"] = torch.cat([get(n + ".bias") for n in members]).float().contiguous()
            quantized.update(n + suffix for n in members for suffix in (".weight", ".bias"))
        for name, tensor in new.items():
            if name not in quantized:
                out[f"fp32.{name}"] = tensor.contiguous()
    if sum(near):
        warnings.warn(f"int8 conversion: {sum(near)} smoothing value(s) lie within {MARGIN:g} of a rounding boundary, "
                      f"so another CPU may convert this model into slightly different int8 weights", SpeculateWarning)
    return out


def apply(model: nn.Module, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """Turn the fp32 ``model`` into its int8 form, in place, from :func:`quantize`'s tensors.

    A smoothed final norm divides the hidden rows by the LM head's s; ``model.speculate_feature_scale``
    (that s, per channel) turns them back into features on the fp32 model's scale
    (:func:`feature_scale`), which is what draft heads were trained on."""
    norm = tensors.get("fp32.model.norm.weight")
    if norm is not None:  # the smoothed final norm: remember how to undo it for the hidden rows
        before = model.get_submodule("model.norm").weight.detach().float()
        model.speculate_feature_scale = torch.where(norm != 0, before / norm, torch.ones_like(norm))
    for key, tensor in tensors.items():
        if key.startswith("fp32."):
            owner, _, pname = key[len("fp32."):].rpartition(".")
            # A new Parameter, never an in-place copy: a tied parameter (the embedding) keeps its value.
            setattr(model.get_submodule(owner), pname, nn.Parameter(tensor.clone(), requires_grad=False))
    for fused, members in plan(model):
        if f"int8.{fused}.weight" not in tensors:
            continue
        layer = Int8Linear(tensors[f"int8.{fused}.weight"], tensors[f"int8.{fused}.scales"],
                           tensors.get(f"int8.{fused}.bias"))
        start = 0
        parts = [] if members == [fused] else [(name, model.get_submodule(name).out_features) for name in members]
        _set(model, fused, layer)  # beside the originals when fused (e.g. self_attn.qkv_proj)...
        for name, rows in parts:  # ...which become views of it
            _set(model, name, LinearPart(layer, start, start + rows))
            start += rows
    return model


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    owner, _, child = name.rpartition(".")
    setattr(model.get_submodule(owner) if owner else model, child, module)


def feature_scale(model: nn.Module) -> torch.Tensor | None:
    """Per-channel factor from this model's final-normed hidden rows to the fp32 model's (None: 1)."""
    return getattr(model, "speculate_feature_scale", None)


def lm_head_weight(model: nn.Module) -> torch.Tensor:
    """The LM head as an fp32 [V, H] matrix on the fp32 model's feature scale: the weight itself, or
    for an int8 head the tied embedding (never quantized) or else its dequantized, unsmoothed weight."""
    head = model.get_output_embeddings()
    if not is_quantized(head):
        return head.weight.detach().float()
    if getattr(model.config, "tie_word_embeddings", False):
        return model.get_input_embeddings().weight.detach().float()
    weight = head.dequantized_weight()
    scale = feature_scale(model)
    return weight if scale is None else weight / scale


def quantize_linears(module: nn.Module) -> nn.Module:
    """Every ``nn.Linear`` in ``module`` (itself included) becomes an :class:`Int8Linear`, unsmoothed, in
    place; returns the (possibly new) module. For small draft heads beside an int8 target: their
    fp32 weights, read once per drafted level, would cost more than their arithmetic."""
    if isinstance(module, nn.Linear):
        return Int8Linear.from_float(module.weight, module.bias)
    for name, child in list(module.named_children()):
        setattr(module, name, quantize_linears(child))
    return module


def weight_bytes(module: nn.Module) -> int:
    """Bytes of weights a forward reads per step: linear layers (int8: a byte per weight plus the scales),
    norms and other parameters; not embedding tables (one row is read). Decoding one row on a CPU is
    bound by reading these, so their ratio between two networks is the ratio of their step costs."""
    total = 0
    for m in module.modules():
        if isinstance(m, (nn.Embedding, LinearPart)):  # a part: its fused layer is counted
            continue
        if isinstance(m, QuantizedLinear):
            total += m.weight_bytes()
        total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


def is_quantized(module: nn.Module) -> bool:
    """An int8 or GGUF-block layer, or a part of one."""
    return isinstance(module, (QuantizedLinear, LinearPart))
