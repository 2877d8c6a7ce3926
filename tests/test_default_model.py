"""The embedded default model (SmolLM2-135M-Instruct), converted once into the cache."""

from __future__ import annotations

import shutil

import pytest

from speculate import SpeculativeDecoder
from speculate.spec import SpeculativeSpec
from speculate.models.cache import verified
from speculate.models.gguf import ensure_converted
from speculate.models.registry import ALIASES

PARAGRAPH = ("Speculative decoding lets a small draft propose several tokens that the large target model "
             "then checks in a single forward pass. Accepted tokens are kept, the first rejected one is "
             "replaced by the target's own choice, and the output is exactly what the target would have "
             "written alone.")
PROMPTS = [
    "Rewrite the following paragraph in simpler words:\n\n" + PARAGRAPH,
    "Summarize this paragraph in two sentences:\n\n" + PARAGRAPH,
    "What is the capital of France? Answer in one sentence.",
]


@pytest.mark.slow
def test_greedy_lookup_and_consultant_agree_with_plain_decoding(default_model):
    plain = SpeculativeDecoder(default_model, SpeculativeSpec("none"))
    lookup = SpeculativeDecoder(default_model, SpeculativeSpec("lookup", verifier="greedy", k=6))
    for prompt in PROMPTS:
        ref = plain.generate(prompt, max_new_tokens=48)
        out = lookup.generate(prompt, max_new_tokens=48)
        assert out.token_ids == ref.token_ids
        assert out.stats.target_calls <= ref.stats.target_calls
    assert "Paris" in ref.text
    # Copying a paragraph: lookup drafts are accepted for long runs.
    copy = lookup.generate("Repeat this paragraph exactly:\n\n" + PARAGRAPH, max_new_tokens=60)
    assert copy.stats.mean_accepted_length > 2.5


@pytest.mark.slow
def test_corrupted_cache_is_rebuilt_not_loaded(default_model, tmp_path, monkeypatch):
    src = ALIASES["smollm2-135m-instruct"]
    monkeypatch.setenv("SPECULATE_CACHE", str(tmp_path))
    folder = tmp_path / src.alias
    shutil.copytree(default_model.path, folder)
    assert verified(folder)
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    assert not verified(folder)
    assert ensure_converted(src, progress=False) == folder
    assert verified(folder)
    assert weights.stat().st_size == (default_model.path / "model.safetensors").stat().st_size


def test_incremental_decoding_on_the_real_tokenizer(default_model):
    from test_text_and_cache import assert_incremental_equals_full

    tok = default_model.tokenizer
    import random

    rng = random.Random(1)
    text = "def f(x):\n    return x ** 2  # naïve 東京 😀\n\nThe answer is 42.  Done.\n"
    assert_incremental_equals_full(tok, tok(text, add_special_tokens=False)["input_ids"])
    assert_incremental_equals_full(tok, [rng.randrange(len(tok)) for _ in range(400)])
