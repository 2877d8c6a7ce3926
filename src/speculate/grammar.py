"""Structured output: a grammar every new token must follow (a JSON schema, OpenAI's ``response_format``), through
llguidance (the Rust grammar engine behind Guidance and several serving engines: a JSON schema compiles in ~3 ms and
a token mask costs ~2 ms on the default model's 49k-token vocabulary, on one core; no dependency of its own).

Speculation keeps the grammar exact. The target's rows of a round are masked row by row: row r, which scores the token
after the root-to-node path of its draft, keeps only the tokens the grammar allows after that path (the matcher walks
the path, fills the row's mask, and rolls back). So a greedy round accepts exactly the tokens plain constrained
decoding would choose, and under sampling the verifier sees the constrained target distribution, which it reproduces
(lossless with respect to it; a draft token the grammar forbids has target probability 0 and is rejected). Greedy
rounds also cut a chain draft at its first forbidden token before the forward (rows that could never be accepted);
sampling rounds do not cut, since cutting by the drawn value would change the distribution of the token drawn there.
The committed tokens then advance the grammar; a grammar that has ended ends the generation ("stop"). A draft model
(drafters/model.py) drafts under the grammar as well, from its own matcher, so its chains are never cut.
"""

from __future__ import annotations

import functools
import json

import torch

from .errors import SpeculateError


@functools.lru_cache(maxsize=4)
def _tokenizer(hf_tokenizer):
    """llguidance's view of a Hugging Face tokenizer (its byte-level vocabulary; ~0.4 s on the default model, once)."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer)


def json_schema_grammar(schema: dict | None) -> str:
    """The grammar of JSON documents following ``schema`` (None: any JSON object, OpenAI's ``json_object``), written
    compactly (no whitespace between tokens: a small model let free to indent can emit whitespace until its token
    budget ends; a schema's own ``x-guidance`` options, e.g. ``{"whitespace_flexible": true}``, take precedence).
    SpeculateError naming the problem when the schema cannot be compiled."""
    import llguidance

    schema = {"type": "object"} if schema is None else dict(schema)
    options = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
    schema["x-guidance"] = {"whitespace_flexible": False, **options}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except Exception as e:  # noqa: BLE001 — llguidance reports a bad schema as a ValueError or its own error
        raise SpeculateError(f"the JSON schema cannot be used: {e}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise SpeculateError(f"the JSON schema cannot be used: {'; '.join(map(str, messages))}")
    return grammar


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack(bits: torch.Tensor, width: int) -> torch.Tensor:
    """llguidance's bitmask rows ([rows, words] int32, bit j of word w allowing token 32·w + j) as [rows, width]
    booleans; tokens past the words (a padded LM head) are not allowed. Plain eager ops: llguidance's own
    ``apply_token_bitmask_inplace`` is a torch.compile kernel, which needs a C++ compiler at first use and masked
    wrongly under ATEN_CPU_CAPABILITY=avx2 (128 tokens allowed of 1) on torch 2.13."""
    allowed = ((bits.unsqueeze(-1) >> _SHIFTS) & 1).bool().flatten(1)[:, :width]
    if allowed.shape[1] < width:
        allowed = torch.cat([allowed, allowed.new_zeros(allowed.shape[0], width - allowed.shape[1])], dim=1)
    return allowed


class Constraint:
    """One generation's place in its grammar (see the module's docstring)."""

    def __init__(self, hf_tokenizer, grammar: str):
        import llguidance

        self.tokenizer = _tokenizer(hf_tokenizer)
        self.matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if self.matcher.is_error():
            raise SpeculateError(f"the grammar cannot be used: {self.matcher.get_error()}")
        self.vocab = self.tokenizer.vocab_size

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading ``tokens`` the grammar allows from here."""
        return self.matcher.validate_tokens(tokens)

    def mask(self, logits: torch.Tensor, paths: list[list[int]]) -> None:
        """Mask, in place, each row r of ``logits`` [rows, V] to the tokens allowed after ``paths[r]`` (the draft
        tokens before that row). A row whose path the grammar forbids is left as it is: its path is rejected before
        it could be used. Tokens past the grammar's vocabulary (a padded LM head) are never allowed."""
        import llguidance.torch as lt

        bits = lt.allocate_token_bitmask(len(paths), self.vocab)
        used = []
        for r, path in enumerate(paths):
            if path and self.matcher.validate_tokens(path) < len(path):
                continue
            if path:
                self.matcher.consume_tokens(path)
            lt.fill_next_token_bitmask(self.matcher, bits, r)
            if path:
                self.matcher.rollback(len(path))
            used.append(r)
        if used:
            rows = torch.tensor(used)
            allowed = unpack(bits[rows], logits.shape[-1])
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))

    def consume(self, token: int) -> None:
        """Advance by a committed token (the verifier's rows were masked: it is allowed)."""
        if not self.matcher.consume_token(token):
            raise SpeculateError(f"token {token} does not follow the grammar: {self.matcher.get_error()}")

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens consumed (a drafter's own drafts, once proposed)."""
        self.matcher.rollback(n)

    @property
    def ended(self) -> bool:
        return self.matcher.is_stopped()
