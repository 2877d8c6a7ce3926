"""OpenAI response objects: completions and chat completions, whole or as stream chunks."""

from __future__ import annotations

import json
import time
import uuid

from ..engine import Generation
from ..spec import SpeculativeSpec


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(gen: Generation) -> dict:
    n = len(gen.token_ids)
    return {"prompt_tokens": gen.prompt_tokens, "completion_tokens": n, "total_tokens": gen.prompt_tokens + n}


def speculative_stats(gen: Generation, settings: SpeculativeSpec) -> dict:
    return {**gen.stats.to_dict(), "drafter": settings.registry_name, "verifier": settings.verifier,
            "k": settings.k, **({"verifier_params": settings.verifier_params} if settings.params else {})}


class Shaper:
    """Builds the response objects of one request (``kind``: 'chat' or 'text')."""

    def __init__(self, kind: str, model: str, settings: SpeculativeSpec):
        self.kind, self.model, self.settings = kind, model, settings
        self.id = new_id(kind)
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, gen: Generation) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": gen.text}, "logprobs": None,
                      "finish_reason": gen.finish_reason}
            head = self._head("chat.completion")
        else:
            choice = {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage(gen),
                "speculative_stats": speculative_stats(gen, self.settings)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.kind == "chat":
            delta = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def final_chunks(self, gen: Generation, include_usage: bool) -> list[dict]:
        """The chunk with finish_reason (and our speculative_stats); with ``stream_options.include_usage``, then
        one chunk with no choices and the usage, as OpenAI sends it: usage once, in the last chunk, and only when
        asked (a client that adds up every chunk's usage, as LangChain's does, counted it twice)."""
        last = {**self.chunk(finish_reason=gen.finish_reason), "speculative_stats": speculative_stats(gen, self.settings)}
        if not include_usage:
            return [last]
        return [last, {**self._head(last["object"]), "choices": [], "usage": usage(gen)}]


def sse(obj) -> bytes:
    """One server-sent event: ``data: JSON`` (or ``data: [DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")
