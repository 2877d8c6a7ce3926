"""OpenAI response objects: completions and chat completions, whole or as stream chunks."""

from __future__ import annotations

import json
import time
import uuid

from ..engine import Generation
from ..spec import SpeculativeSpec


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(gens: list[Generation], prompts: int = 1) -> dict:
    """Tokens of a request's choices: each prompt counted once (its n samples share it, as OpenAI counts them;
    ``prompts``: how many different prompts, the first choices of each are theirs), every completion's tokens."""
    per = max(len(gens) // prompts, 1)
    prompt = sum(g.prompt_tokens for g in gens[::per])
    completion = sum(len(g.token_ids) for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculative_stats(gen: Generation, settings: SpeculativeSpec) -> dict:
    return {**gen.stats.to_dict(), "drafter": settings.registry_name, "verifier": settings.verifier,
            "k": settings.k, **({"verifier_params": settings.verifier_params} if settings.params else {})}


class Shaper:
    """Builds the response objects of one request (``kind``: 'chat' or 'text') with ``choices`` choices from
    ``prompts`` prompts (index = prompt × n + sample, as OpenAI orders them)."""

    def __init__(self, kind: str, model: str, settings: SpeculativeSpec, choices: int = 1, prompts: int = 1):
        self.kind, self.model, self.settings, self.choices, self.prompts = kind, model, settings, choices, prompts
        self.id = new_id(kind)
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, gens: list[Generation]) -> dict:
        """The answer with every choice. One choice: our ``speculative_stats`` beside ``usage``; several: in each
        choice (each ran its own generation)."""
        choices = []
        for i, gen in enumerate(gens):
            if self.kind == "chat":
                choice = {"index": i, "message": {"role": "assistant", "content": gen.text}, "logprobs": None,
                          "finish_reason": gen.finish_reason}
            else:
                choice = {"index": i, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason}
            if len(gens) > 1:
                choice["speculative_stats"] = speculative_stats(gen, self.settings)
            choices.append(choice)
        out = {**self._head("chat.completion" if self.kind == "chat" else "text_completion"), "choices": choices,
               "usage": usage(gens, self.prompts)}
        if len(gens) == 1:
            out["speculative_stats"] = speculative_stats(gens[0], self.settings)
        return out

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False,
              index: int = 0) -> dict:
        if self.kind == "chat":
            delta = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def finish_chunk(self, gen: Generation, index: int = 0) -> dict:
        """A choice's chunk with its finish_reason (and our speculative_stats)."""
        return {**self.chunk(finish_reason=gen.finish_reason, index=index),
                "speculative_stats": speculative_stats(gen, self.settings)}

    def usage_chunk(self, gens: list[Generation]) -> dict:
        """With ``stream_options.include_usage``, the last chunk: no choices, the usage, as OpenAI sends it: usage
        once, only when asked (a client that adds up every chunk's usage, as LangChain's does, counted it twice)."""
        return {**self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion"), "choices": [],
                "usage": usage(gens, self.prompts)}


def sse(obj) -> bytes:
    """One server-sent event: ``data: JSON`` (or ``data: [DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")
