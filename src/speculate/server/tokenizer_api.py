"""vLLM's tokenizer endpoints, at the server's root as vLLM serves them: ``GET /tokenizer_info``, ``POST /tokenize``,
``POST /detokenize``.

lm-evaluation-harness's ``local-completions`` looks for them (``/tokenizer_info`` with an ``eos_token``, then
``/tokenize`` with ``{"prompt", "add_special_tokens"}`` and no model name) and, where they answer, tokenizes
through the server instead of downloading a tokenizer from a hub — which an offline machine cannot. A chat's
messages are tokenized as a chat request's are (text.encode_prompt: the template with the assistant's turn opened),
so ``count`` is the ``usage.prompt_tokens`` that request would report.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import SpeculateError
from ..text import check_unicode, encode_prompt
from .errors import APIError
from .schemas import ChatMessage


class TokenizeRequest(BaseModel):
    """A prompt (``add_special_tokens``: the tokenizer's own, e.g. a BOS; default true, as vLLM's) or chat
    ``messages``; ``model`` optional (lm-eval sends none)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def tokenizer_info(tokenizer, context_window: int) -> dict:
    """What a client needs to tokenize and template as the server does (vLLM's keys)."""
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
            "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": context_window,
            "vocab_size": len(tokenizer)}


def tokenize(tokenizer, req: TokenizeRequest, context_window: int) -> dict:
    try:
        if req.messages is not None:
            ids = encode_prompt(tokenizer, [{"role": m.role, "content": m.text()} for m in req.messages])
        else:
            check_unicode(req.prompt, "the prompt")
            ids = list(tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
    except SpeculateError as e:
        param = "messages" if req.messages is not None else "prompt"
        raise APIError(400, f"{param}: {e}", param, "invalid_value") from None
    out = {"count": len(ids), "max_model_len": context_window, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return out


def detokenize(tokenizer, req: DetokenizeRequest) -> dict:
    check_ids(tokenizer, req.tokens, "tokens")
    return {"prompt": tokenizer.decode(req.tokens)}


def check_ids(tokenizer, ids: list[int], param: str) -> None:
    """A 400 at ``param`` unless every token id is in the tokenizer's vocabulary."""
    vocab = len(tokenizer)
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"{param}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param,
                       "invalid_value")
