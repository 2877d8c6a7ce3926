"""Tiny random models with a real byte-level tokenizer, for tests and demos (no weights to download).

``save_tiny_model(folder, seed)`` writes an ordinary Hugging Face folder (config, safetensors,
tokenizer with a ChatML chat template), so it also exercises the "any local model folder" path.
Weights are drawn with a large init scale so that logits are peaked: a random model with near-uniform
logits would make greedy decoding hinge on float rounding, and exactness tests would test noise.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer():
    """A byte-level BPE with no merges: 256 byte tokens + 3 specials; lossless on any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(byte_chars):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = CHATML
    return fast


def tiny_model(seed: int = 0, vocab_size: int = 259, hidden: int = 64, layers: int = 2, heads: int = 4,
               kv_heads: int = 2, init_scale: float = 0.25, max_positions: int = 1024):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         initializer_range=init_scale, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    return model


def tiny_qwen2(seed: int = 4):
    """A tiny Qwen2: biases on q/k/v (random, so that paths which fold or smooth them are exercised),
    grouped-query attention, an untied LM head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.25, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return model.eval()


def save_tiny_model(folder: str | Path, seed: int = 0, arch: str = "llama", **kwargs) -> Path:
    """A tiny random model (``arch`` llama or qwen2) and the byte-level tokenizer, as an HF folder."""
    folder = Path(folder)
    (tiny_qwen2(seed) if arch == "qwen2" else tiny_model(seed, **kwargs)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
