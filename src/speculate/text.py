"""Prompts in, text out: chat templates, incremental detokenization and stop strings."""

from __future__ import annotations

from .errors import ContextLengthError, SpeculateError


ROLES = ("system", "developer", "user", "assistant", "tool")  # the chat roles (the server's schema takes the same)


def check_unicode(text: str, what: str) -> None:
    """SpeculateError unless ``text`` is valid Unicode: JSON's "\\ud800" escapes decode to lone surrogates,
    which no tokenizer (and no UTF-8 output) can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise SpeculateError(f"{what} is not valid Unicode: a lone surrogate (U+{ord(error.object[error.start]):04X}) "
                             f"at character {error.start}") from None


EMPTY_PROMPT = "the prompt is empty"


def check_text_prompt(prompt: str) -> None:
    """A prompt given as text: valid Unicode, and not empty or blank (before any tokenizer or model is needed)."""
    check_unicode(prompt, "the prompt")
    if not prompt.strip():
        raise SpeculateError(EMPTY_PROMPT)


def check_prompt(ids: list[int], max_new_tokens: int, window: int, budget: str = "max_new_tokens") -> None:
    """The one check of a prompt's token ids against the model, wherever a generation starts (the engine, the
    server): not empty, and room in the context ``window`` for it and ``max_new_tokens`` new tokens (``budget``:
    that setting's name where the user gave it; ContextLengthError otherwise)."""
    if not ids:
        raise SpeculateError(EMPTY_PROMPT)
    if len(ids) + max_new_tokens > window:
        raise ContextLengthError(f"this model's context window is {window} tokens; the prompt has {len(ids)} tokens "
                                 f"and {budget} is {max_new_tokens}: shorten the prompt or lower {budget}")


def encode_prompt(tokenizer, prompt, chat: bool | None = None) -> list[int]:
    """A string or a list of chat messages → prompt token ids.

    Messages always go through the chat template. A plain string does too when the tokenizer has one
    (it is then the user turn), unless ``chat`` is False: then the raw text is encoded.
    """
    if isinstance(prompt, str):
        check_text_prompt(prompt)
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if chat is None:
            chat = has_template
        if not chat:
            return list(tokenizer(prompt)["input_ids"])
        if not has_template:
            raise SpeculateError("this model's tokenizer has no chat template; send the raw prompt (--no-chat)")
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str) for m in prompt):
        raise SpeculateError(f"the prompt must be a string, token ids, or a non-empty list of {{'role', 'content'}} "
                             f"messages with a role in {', '.join(ROLES)} and text content")
    for message in prompt:
        check_unicode(message["content"], f"a {message['role']} message")
    if not getattr(tokenizer, "chat_template", None):
        raise SpeculateError("this model's tokenizer has no chat template; send a plain prompt")
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def eos_ids(loaded) -> set[int]:
    """Every id that ends a generation: the tokenizer's EOS and the generation config's."""
    ids = set()
    for source in (loaded.tokenizer.eos_token_id, getattr(loaded.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


def held_back(text: str, end: int, stop: str, emitted: int = 0) -> int:
    """The length of the longest tail of ``text[:end]`` (past ``emitted``) that is a proper prefix of ``stop``:
    text that must be held back because the next tokens could complete the stop string.

    Only the tail's positions holding ``stop[0]`` can start it, and each is checked once with one comparison,
    so the cost is linear in the tail (trying every prefix length, as before, was quadratic in the stop
    string's length: 60 s for a 500,000-character stop string)."""
    start = max(emitted, end - len(stop) + 1, 0)
    i = text.find(stop[0], start, end)
    while i >= 0:
        if stop.startswith(text[i:end]):
            return end - i
        i = text.find(stop[0], i + 1, end)
    return 0


class Detokenizer:
    """Turns token ids into text pieces as they arrive, and finds stop strings.

    Held back: a trailing incomplete UTF-8 character (decoded as U+FFFD) and any tail that could be
    the start of a stop string, so that no streamed piece ever has to be taken back. The final text
    ends before the first stop string; the stop string itself is not part of it.
    """

    def __init__(self, tokenizer, stop: list[str] | None = None):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.emitted = 0  # characters of the text already returned
        self.text = ""
        self.stopped = False
        # Incremental decoding (as vLLM and TGI do): decode only the ids from prefix_offset on, and
        # take the text beyond what ids[prefix_offset:read_offset] decode to. Decoding the whole output
        # per token would cost O(n²) over a long generation; a window that starts a few tokens back
        # still sees the context that byte-level and sentencepiece decoders need for spaces and merges.
        self._done = ""  # text of ids[:read_offset], final
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _current(self) -> str:
        """The text of every id so far (a trailing incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.ids[self._prefix_offset: self._read_offset])
        window = self._decode(self.ids[self._prefix_offset:])
        if len(window) > len(prefix) and window.startswith(prefix) and not window.endswith("\ufffd"):
            self._done += window[len(prefix):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            return self._done
        if not window.startswith(prefix):  # the decoder revised text inside the window: start afresh
            self._done = self._decode(self.ids)
            self._prefix_offset = self._read_offset = len(self.ids)
            return self._done
        return self._done + window[len(prefix):]

    def add(self, token_id: int) -> str:
        """Append one token; return the new text that is now safe to show."""
        self.ids.append(token_id)
        text = self._current()
        # Held-back text never reaches the caller, so a stop string can only start at >= emitted
        # (minus its length, in case decoding revised the tail).
        hits = [j for s in self.stop if (j := text.find(s, max(0, self.emitted - len(s)))) >= 0]
        if hits:
            self.stopped = True
            self.text = text[: min(hits)]
            return self._take(len(self.text))
        self.text = text
        safe = len(text) - text.endswith("\ufffd")
        hold = max((held_back(text, safe, s, self.emitted) for s in self.stop), default=0)
        return self._take(safe - hold)

    def flush(self) -> str:
        """At the end of a generation: everything not yet returned."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        piece, self.emitted = self.text[self.emitted: upto], upto
        return piece
