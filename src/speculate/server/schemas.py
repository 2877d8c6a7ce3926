"""Request bodies of the OpenAI API (the subset we honour), validated strictly: a wrongly typed field is a
400, not silently coerced; ``null`` is "not given", as at OpenAI. Unknown top-level fields are ignored, as OpenAI clients send many; fields we
know but cannot honour (penalties, tools, logprobs in a stream, ...) are refused rather than ignored. The
extra ``speculative`` object is strict: an unknown key there is a 400."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from pydantic_core import PydanticCustomError

from ..drafters import ALL_DRAFTERS, check_name
from ..errors import SpeculateError
from ..sampling import MAX_LOGPROBS, check_seed
from ..policy.draft_length import parse_k
from ..text import ROLES, check_unicode
from ..verifiers import PARAMS, VERIFIERS, check_params, param_help
from .errors import APIError

MAX_STOP = 4  # stop sequences a request may give (OpenAI's limit)
MAX_STOP_CHARS = 1024  # characters of one stop sequence: each is searched in the text after every token
MAX_CHOICES = 64  # prompts × n of one request: each choice is a generation of its own in the batch


class _Speculative(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    drafter: str | None = Field(None, description="one of: " + ", ".join(ALL_DRAFTERS))
    verifier: Literal[tuple(VERIFIERS)] | None = None
    k: int | Literal["auto"] | None = None  # auto: sized per round (speculate/policy/auto.py); 1..64: spec.parse_k
    share: bool | None = Field(None, description="false: this request's answer neither feeds nor drafts from the "
                                                 "answers the server has served (drafter suffix); others ignore it")

    @field_validator("drafter", "k")
    @classmethod
    def _check_once(cls, value, info):
        """The drafter's name and k, by the checks every settings path makes (drafters.check_name, spec.parse_k),
        with their text."""
        check = {"drafter": check_name, "k": parse_k}[info.field_name]
        try:
            return None if value is None else check(value)
        except SpeculateError as e:
            raise PydanticCustomError("invalid_value", "{message}", {"message": str(e)}) from None

    def verifier_params(self) -> dict:
        return {key: getattr(self, key) for key in PARAMS if getattr(self, key) is not None}

    @model_validator(mode="after")
    def _check_verifier_params(self):
        """A named verifier's parameters, checked by its declaration (get_verifier's text). Without a verifier
        they go to the server's, over its own flags, and the engine checks them when it builds it."""
        if self.verifier is not None:
            try:
                check_params(self.verifier, self.verifier_params())
            except ValueError as e:
                raise PydanticCustomError("invalid_value", "{message}", {"message": str(e)}) from None
        return self


def _verifier_field(name: str):
    """A request field for the verifier parameter ``name``: its type from the declarations (a number, or
    'auto' where a verifier takes it), its description theirs."""
    declared = [param for _, param in PARAMS[name]]
    kind = declared[0].kind
    annotation = (kind | Literal["auto"]) if any(param.auto for param in declared) else kind
    return annotation | None, Field(None, description=param_help(name))


# The verifier parameters' fields (eps, beta, delta, D, tol, ...) follow from the verifiers' declarations.
SpeculativeSettings = create_model(
    "SpeculativeSettings", __base__=_Speculative, __module__=__name__,
    __doc__="Per-request speculative settings; anything left out comes from the server's flags.",
    **{name: _verifier_field(name) for name in PARAMS})


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = None  # not OpenAI's; vLLM's and llama.cpp's servers take it too (None, 0 or -1: off)
    stop: str | list[str] | None = None
    seed: int | None = None  # sampling.check_seed: the command line's rule
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None
    speculative: SpeculativeSettings | None = None
    # Structured output: OpenAI's on chats; on completions as vLLM's server takes it too (speculate/grammar.py)
    response_format: dict | None = None

    def json_schema(self) -> tuple[bool, dict | None]:
        """(structured, schema): ``response_format`` ``json_schema`` gives its schema, ``json_object`` any JSON object
        (schema None), ``text`` or none no structure."""
        rf = self.response_format
        kind = "text" if rf is None else rf.get("type")
        if kind == "text":
            return False, None
        if kind == "json_object":
            return True, None
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError(400, "response_format.json_schema: an object with a \"schema\" object (and a \"name\")",
                               "response_format", "invalid_value")
            return True, spec.get("schema", {})
        raise APIError(400, "response_format.type: one of \"text\", \"json_object\", \"json_schema\"",
                       "response_format", "invalid_value")

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data):
        """OpenAI reads ``null`` in an optional field as "not given" (clients send ``"temperature": null``): such
        a field takes its default. A required field sent as null is still missing (a 400)."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    @field_validator("seed")
    @classmethod
    def _seed(cls, seed):
        try:
            return check_seed(seed)
        except SpeculateError as e:
            raise PydanticCustomError("invalid_value", "{message}", {"message": str(e)}) from None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop sequences", "stop", "invalid_value")
        for stop in stops:
            try:
                check_unicode(stop, "a stop sequence")
            except SpeculateError as error:
                raise APIError(400, f"stop: {error}", "stop", "invalid_value") from None
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"stop: a stop sequence may have at most {MAX_STOP_CHARS} characters", "stop",
                           "invalid_value")
        return [s for s in stops if s]

    def check_supported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported (only 0)", name, "unsupported_parameter")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias", "unsupported_parameter")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for completions; 0 only with echo (scoring)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # K: each token's and the K most likely tokens'
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 generates nothing; it is only for scoring a prompt (with echo)",
                           "max_tokens", "invalid_value")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of: only 1 is supported", "best_of", "unsupported_parameter")
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix", "unsupported_parameter")

    def prompts(self) -> list[str | list[int]]:
        """The prompts: a string or token ids is one; a list of strings or of token-id lists is one each (a
        choice per prompt, n per prompt, at most MAX_CHOICES in all)."""
        p = self.prompt  # ([] is one empty prompt: generation.prepare refuses it, as any empty prompt)
        many = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        if len(many) * self.n > MAX_CHOICES:
            raise APIError(400, f"prompt, n: {len(many)} prompt(s) × n = {self.n} choices; at most {MAX_CHOICES}",
                           "n", "invalid_value")
        return many


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal[ROLES]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.n > MAX_CHOICES:
            raise APIError(400, f"n: at most {MAX_CHOICES}", "n", "invalid_value")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")
        if self.tools:
            raise APIError(400, "tools are not supported", "tools", "unsupported_parameter")
        if self.tool_choice not in (None, "none", "auto"):  # a forced call with no tools to call
            raise APIError(400, "tool_choice: tools are not supported", "tool_choice", "unsupported_parameter")
        for name in ("functions", "function_call"):
            if getattr(self, name) not in (None, [], "none", "auto"):
                raise APIError(400, f"{name} is not supported", name, "unsupported_parameter")
        self.json_schema()  # (its shape checked here; the schema itself when it compiles)
        if self.modalities not in (None, ["text"]):
            raise APIError(400, "modalities: only [\"text\"] is supported", "modalities", "unsupported_parameter")

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]
