"""From a validated request to a running generation: the checks made before a request is queued, and what the
generation thread does with it when it joins the batch.

:func:`prepare` runs the checks that need the tokenizer (prompt length against the context window) and merges
the speculative settings, off the event loop, *before* the request is queued: a bad prompt is a 400 and never
takes a place in the batch. Everything that touches the models happens on the generation thread
(server/scheduler.py): :func:`open_run` takes the :class:`SpeculativeDecoder` for the request's settings from the
server's :class:`~speculate.server.decoders.Decoders` (the one kept, or a new one — which may load an answer store or
heads, measure a cost profile, calibrate ε) and starts its run. Why there: a thread that runs torch keeps an OpenMP team, and extra teams slow every forward
(models/loader.py, check_thread) — a store loaded in the request-preparing thread pool did that to every later
request. Settings the engine refuses are reported as the job's first event, before any text, so the client still
gets a 400 (streamed or not). A decoder is shared by every request with its settings; each request's run holds its
own KV cache and drafter state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..engine import Run, SpeculativeDecoder
from ..errors import ContextLengthError, SpeculateError
from ..grammar import json_schema_grammar
from ..models.loader import LoadedModel
from ..models.prefix_store import PrefixStore
from ..sampling import SamplingParams
from ..spec import SpeculativeSpec
from ..text import check_prompt, encode_prompt
from .config import ServerConfig
from .decoders import Decoders
from .errors import APIError, refused
from .tokenizer_api import check_ids
from .schemas import ChatCompletionRequest, CompletionRequest, SpeculativeSettings

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context window


@dataclass
class Prepared:
    ids: list[int]  # the prompt's tokens
    sampling: SamplingParams  # how it samples and stops, max_new_tokens and log-probabilities included
    spec: SpeculativeSpec  # the speculative settings in force, the verifier named
    echo: str | None = None  # a completion's ``echo``: the prompt's text, put before the answer's
    # Whether the request named its k. A fixed k it did not name (the server's --k) is a cap that the batch planner
    # may lower where drafting does not pay (speculate/policy/batch.py); one it named, it keeps.
    k_named: bool = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)


def prepare(config: ServerConfig, target: LoadedModel, req: CompletionRequest | ChatCompletionRequest,
            scope: str = "") -> list[Prepared]:
    """Check one request (called off the event loop: it tokenizes; it never runs the models) and make its choices:
    each prompt (a completion may send several) ``n`` times, prompt-major as OpenAI indexes them; the j-th of a
    prompt's n samples draws with ``seed + j`` (a seeded request is reproducible, its samples differ). ``scope``: whose
    served answers its drafter may learn from and draft with (the tenant of its API key; '': the server's). Raises
    APIError."""
    req.check_supported()
    stops = req.stops()
    if isinstance(req, ChatCompletionRequest):
        budget = req.token_budget()
        budget_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        prompts = [_prompt_ids(target, req.message_dicts(), "messages")]
        checked = [_budget(target, ids, budget, "messages", budget_param, config.max_tokens) for ids in prompts]
    else:
        budget = req.max_tokens if "max_tokens" in req.model_fields_set else None
        if budget is None:  # OpenAI's default, within the server's cap (a cap below 16 is not the client's error)
            budget = min(COMPLETIONS_DEFAULT_MAX_TOKENS, config.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
        many = len(req.prompts()) > 1
        prompts = [_prompt_ids(target, p, f"prompt[{i}]" if many else "prompt") for i, p in enumerate(req.prompts())]
        checked = [_budget(target, ids, budget, f"prompt[{i}]" if many else "prompt", "max_tokens",
                           config.max_tokens) for i, ids in enumerate(prompts)]
    try:  # (the engine's own default verifier named, so that the stats can report it)
        spec = request_spec(config, req.speculative, scope).with_verifier(req.temperature == 0)
    except SpeculateError as e:
        raise APIError(400, f"speculative: {e}", "speculative", "invalid_value") from None
    seeds = [None if req.seed is None else (req.seed + j) % 2**63 for j in range(req.n)]
    grammar = None
    structured, schema = req.json_schema()
    if structured:
        try:
            grammar = json_schema_grammar(schema)
        except SpeculateError as e:
            raise APIError(400, f"response_format: {e}", "response_format", "invalid_value") from None
    if isinstance(req, ChatCompletionRequest):
        logprobs, prompt_logprobs, echoes = (req.top_logprobs or 0) if req.logprobs else None, None, [None]
    else:  # (echo: the prompt as sent; token ids as their text)
        logprobs, prompt_logprobs = req.logprobs, req.logprobs if req.echo else None
        echoes = [(p if isinstance(p, str) else target.tokenizer.decode(ids)) if req.echo else None
                  for p, ids in zip(req.prompts(), prompts)]
    k_named = req.speculative is not None and req.speculative.k is not None
    try:
        return [Prepared(ids, SamplingParams(req.temperature, req.top_p, max(req.top_k or 0, 0), seed, max_tokens, stops,
                                             logprobs, prompt_logprobs, grammar), spec, echo, k_named)
                for ids, max_tokens, echo in zip(prompts, checked, echoes) for seed in seeds]
    except SpeculateError as e:  # (the schema's own checks are stricter: not expected)
        raise APIError(400, str(e), None, "invalid_value") from None


def _prompt_ids(target: LoadedModel, prompt, param: str) -> list[int]:
    """A prompt's token ids: chat messages through the template, text raw, token ids checked against the
    vocabulary."""
    tokenizer = target.tokenizer
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        check_ids(tokenizer, prompt, param)
        ids = list(prompt)
    elif isinstance(prompt, str):
        ids = _encode(lambda: encode_prompt(tokenizer, prompt, chat=False), param)
    else:
        ids = _encode(lambda: encode_prompt(tokenizer, prompt), param)
    return ids


def _budget(target: LoadedModel, ids: list[int], budget: int | None, prompt_param: str, budget_param: str,
            most: int = 0) -> int:
    """The new tokens a prompt may get: ``budget``, or (None) the rest of the context window up to ``most`` (the
    server's --max-tokens; 0: no cap); checked against the window and the cap."""
    window = target.context_window
    if most and budget is not None and budget > most:
        raise APIError(400, f"{budget_param}: {budget} exceeds this server's limit of {most} new tokens (--max-tokens)",
                       budget_param, "invalid_value")
    if budget is None:
        budget = window - len(ids) if not most else min(most, window - len(ids))
        if budget < 1:
            raise APIError(400, f"this model's context window is {window} tokens and the prompt has {len(ids)}: "
                                f"no room is left for a completion", prompt_param, "context_length_exceeded")
    if budget > window:
        raise APIError(400, f"{budget_param}: {budget} exceeds the model's context window of {window} tokens",
                       budget_param, "invalid_value")
    try:
        check_prompt(ids, budget, window, budget_param)  # (the engine's own check, run before the request queues)
    except ContextLengthError as e:
        raise APIError(400, str(e), prompt_param, "context_length_exceeded") from None
    except SpeculateError as e:
        raise APIError(400, f"{prompt_param}: {e}", prompt_param, "invalid_value") from None
    return budget


def open_run(prepared: Prepared, decoders: Decoders, prefill_chunk: int | None = None, *, resume: Run | None = None,
             reserve: int | None = None) -> tuple[Run, Callable[[], None]]:
    """On the generation thread, when the request joins the batch: its :class:`~speculate.engine.Run` on the decoder
    for its settings, and the function that gives the run's cache up (it was preempted, or it ended).
    ``resume``: the request's run, preempted, to go on; ``reserve``: cache positions to allocate now
    (server/scheduler.py, admission by memory). Raises APIError (400) for settings the engine refuses."""
    decoder = decoders.get(prepared.spec)  # build_decoder: 400
    try:
        if resume is not None:
            resume.resume(decoder, prefill_chunk, reserve)
            run = resume
        else:
            run = decoder.start(prepared.ids, prepared.sampling, prefill_chunk=prefill_chunk, reserve=reserve)
            run.k_is_cap = not prepared.k_named
    except SpeculateError as e:
        raise refused(e) from None
    return run, run.release


def _encode(fn, param: str) -> list[int]:
    try:
        return fn()
    except SpeculateError as e:
        raise APIError(400, f"{param}: {e}", param, "invalid_value") from None


def request_spec(config: ServerConfig, given: SpeculativeSettings | None, scope: str = "") -> SpeculativeSpec:
    """The request's speculative settings over the server's flags (``SpeculativeSpec.from_request``), in ``scope``
    (:meth:`SpeculativeSpec.scoped`)."""
    return SpeculativeSpec.from_request(given, config.spec, config.model).scoped(scope)


def build_decoder(target: LoadedModel, draft: LoadedModel | None, spec: SpeculativeSpec,
                  prefix_store: PrefixStore | None = None) -> SpeculativeDecoder:
    """The decoder for ``spec`` with the server's models; a refusal is a 400 at the request's ``speculative``.
    (The draft model's tokenizer was compared with the target's at startup; the comparison is remembered.)"""
    try:
        return SpeculativeDecoder(target, spec, draft_model=draft, prefix_store=prefix_store)
    except SpeculateError as e:
        raise refused(e, f"speculative: {e}", "speculative") from None
