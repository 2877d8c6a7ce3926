"""Which models the lean decoder (models/fast.py) runs, and whether through the kernel's float layers: decided from
the model alone, so that the loader can say at load how a precision will run (a bf16 model on PyTorch's layers warns
where the CPU has no fast bf16 matmul) without importing the decoder."""

from __future__ import annotations

from torch import nn

from .blocks import available as blocks_available
from .blocks import float_layer_runs
from .quantize import is_quantized

SUPPORTED = {"llama", "qwen2", "mistral"}


def supports(model: nn.Module) -> bool:
    """Whether the lean decoder runs ``model``: a Llama-family model (no sliding window, no MLP bias) whose layers are
    plain linear layers or ours."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED:
        return False
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "mlp_bias", False):
        return False
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None):
        return False
    layer = model.model.layers[0]
    # Plain nn.Linear layers, or the quantized layers of models/quantize.py and blocks.py (fused, as they build them).
    mods = (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.down_proj, model.lm_head)
    return all(type(m) is nn.Linear or is_quantized(m) for m in mods)


def float_kernel(model: nn.Module) -> bool:
    """Whether the lean path runs ``model``'s linear layers through the kernel's float path (:class:`blocks.FloatLinear`:
    the fp32 or bf16 weights themselves, each row's sums in fp32 in a fixed order): plain fp32 or bf16 layers with
    inputs a multiple of 16, and the kernel built here (not with SPECULATE_NO_KERNEL)."""
    if not blocks_available():
        return False
    mods = [model.lm_head]
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        mods += [a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return all(type(m) is nn.Linear and float_layer_runs(m.weight) for m in mods)
