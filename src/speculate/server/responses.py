"""OpenAI response objects: completions and chat completions, whole or as stream chunks."""

from __future__ import annotations

import json
import time
import uuid

from ..engine import Generation, TokenLogprob
from ..spec import SpeculativeSpec


def new_id(kind: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"


def usage(gens: list[Generation], prompts: int = 1) -> dict:
    """Tokens of a request's choices: each prompt counted once (its n samples share it, as OpenAI counts them;
    ``prompts``: how many different prompts, the first choices of each are theirs), every completion's tokens, and
    the prompt tokens that came from a cache."""
    per = max(len(gens) // prompts, 1)
    prompt = sum(g.prompt_tokens for g in gens[::per])
    completion = sum(len(g.token_ids) for g in gens)
    # Prompt tokens whose KV was not computed again (a decoder's own cache, or the shared prefix store), as OpenAI
    # reports its prompt caching.
    cached = sum(g.stats.reused_prompt_tokens for g in gens[::per])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def speculative_stats(gen: Generation, spec: SpeculativeSpec) -> dict:
    return {**gen.stats.to_dict(), "drafter": spec.registry_name, "verifier": spec.verifier,
            "k": spec.k, **({"verifier_params": spec.verifier_params} if spec.params else {})}


class Shaper:
    """Builds the response objects of one request (``kind``: 'chat' or 'text') with ``choices`` choices from
    ``prompts`` prompts (index = prompt × n + sample, as OpenAI orders them)."""

    def __init__(self, kind: str, model: str, spec: SpeculativeSpec, choices: int = 1, prompts: int = 1,
                 tokenizer=None):
        self.kind, self.model, self.spec, self.choices, self.prompts = kind, model, spec, choices, prompts
        self.tokenizer = tokenizer  # (a token's text in log-probabilities)
        self.id = new_id(kind)
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, gens: list[Generation], echoes: list[tuple[str, int] | None] | None = None) -> dict:
        """The answer with every choice. One choice: our ``speculative_stats`` beside ``usage``; several: in each
        choice (each ran its own generation). ``echoes``: where a completion asked for ``echo``, each choice's
        prompt text and first token."""
        choices = []
        for i, gen in enumerate(gens):
            if self.kind == "chat":
                logprobs = None if gen.logprobs is None else chat_logprobs(self.tokenizer, gen.logprobs)
                choice = {"index": i, "message": {"role": "assistant", "content": gen.text}, "logprobs": logprobs,
                          "finish_reason": gen.finish_reason}
            else:
                echo, first = echoes[i] if echoes and echoes[i] else ("", None)
                entries = (gen.prompt_logprobs or []) + (gen.logprobs or [])
                logprobs = None if gen.logprobs is None else completion_logprobs(self.tokenizer, entries, first)
                choice = {"index": i, "text": echo + gen.text, "logprobs": logprobs, "finish_reason": gen.finish_reason}
            if len(gens) > 1:
                choice["speculative_stats"] = speculative_stats(gen, self.spec)
            choices.append(choice)
        out = {**self._head("chat.completion" if self.kind == "chat" else "text_completion"), "choices": choices,
               "usage": usage(gens, self.prompts)}
        if len(gens) == 1:
            out["speculative_stats"] = speculative_stats(gens[0], self.spec)
        return out

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False,
              index: int = 0, logprobs: list[TokenLogprob] | None = None) -> dict:
        """A stream's chunk: a piece of text, or (``logprobs``) the log-probabilities of the tokens committed in a
        round, sent after that round's text (the text can lag its tokens: the detokenizer holds back what may be a
        stop string's start)."""
        if self.kind == "chat":
            delta = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            shaped = None if logprobs is None else chat_logprobs(self.tokenizer, logprobs)
            choice = {"index": index, "delta": delta, "logprobs": shaped, "finish_reason": finish_reason}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        shaped = None if logprobs is None else completion_logprobs(self.tokenizer, logprobs)
        choice = {"index": index, "text": text or "", "logprobs": shaped, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def echo_chunk(self, echo: str, first: int, entries: list[TokenLogprob | None] | None = None,
                   index: int = 0) -> dict:
        """A streamed completion's first chunk with ``echo``: the prompt's text, and (``entries``, where logprobs were
        asked) its tokens' log-probabilities, the first token's None as in a whole answer."""
        shaped = None if entries is None else completion_logprobs(self.tokenizer, entries, first)
        return {**self._head("text_completion"), "choices": [{"index": index, "text": echo, "logprobs": shaped,
                                                              "finish_reason": None}]}

    def finish_chunk(self, gen: Generation, index: int = 0) -> dict:
        """A choice's chunk with its finish_reason (and our speculative_stats)."""
        return {**self.chunk(finish_reason=gen.finish_reason, index=index),
                "speculative_stats": speculative_stats(gen, self.spec)}

    def usage_chunk(self, gens: list[Generation]) -> dict:
        """With ``stream_options.include_usage``, the last chunk: no choices, the usage, as OpenAI sends it: usage
        once, only when asked (a client that adds up every chunk's usage, as LangChain's does, counted it twice)."""
        return {**self._head("chat.completion.chunk" if self.kind == "chat" else "text_completion"), "choices": [],
                "usage": usage(gens, self.prompts)}


def _text(tokenizer, token: int) -> str:
    return tokenizer.decode([token])


def completion_logprobs(tokenizer, entries: list[TokenLogprob | None], first: int | None = None) -> dict:
    """A completion choice's ``logprobs`` as OpenAI's legacy API shapes it: per token its text, its log-probability,
    a dict of the most likely tokens' texts (the token's own among them, as vLLM sends it) and its offset in the
    choice's text. ``entries``: with echo the prompt's (``first``: the first prompt token, which nothing scores: its
    values are None), then the new tokens'."""
    tokens, values, tops, offsets, at = [], [], [], [], 0
    for entry in entries:
        if entry is None:
            text, value, top = _text(tokenizer, first), None, None
        else:
            text, value = _text(tokenizer, entry.token), entry.logprob
            top = {}
            for t, v in sorted(((entry.token, entry.logprob), *entry.top), key=lambda tv: -tv[1]):
                top.setdefault(_text(tokenizer, t), v)  # (two tokens of one text: the likelier's value)
        tokens.append(text), values.append(value), tops.append(top), offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(tokenizer, entries: list[TokenLogprob]) -> dict:
    """A chat choice's ``logprobs``: per new token its text, log-probability and UTF-8 bytes, and ``top_logprobs``
    alternatives (``top_logprobs`` of the request), as OpenAI's chat API shapes them."""
    def one(token: int, value: float) -> dict:
        text = _text(tokenizer, token)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries],
            "refusal": None}


def sse(obj) -> bytes:
    """One server-sent event: ``data: JSON`` (or ``data: [DONE]``)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")
