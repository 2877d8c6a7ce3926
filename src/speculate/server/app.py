"""The FastAPI application: routes of the OpenAI API, /health and /metrics.

``create_app(config, target, draft)`` takes models that are already loaded; the generation thread
(server/scheduler.py) starts with the app (lifespan), and /health answers 200 only from then on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from .. import __version__
from ..policy.batch import BatchPlanner
from ..policy.gate import DraftGate
from ..errors import SpeculateError
from ..models.loader import LoadedModel
from ..drafters.suffix import indexes as suffix_indexes
from ..models.kv import position_bytes
from ..models.paged import pool_bytes
from ..models.prefix_store import PrefixStore
from .auth import check_api_key
from .body import read_json
from .config import ServerConfig
from .errors import APIError, error_body, install_error_handlers, refused, validation_error
from .guard import HostGuard
from .decoders import Decoders
from .generation import build_decoder, open_run, prepare
from .metrics import OUTCOME_KEY, Metrics, StatusCounter
from .scheduler import Closed, Job, Outcome, QueueFull, Scheduler
from .responses import DONE, Shaper, sse
from .schemas import ChatCompletionRequest, CompletionRequest
from .sse import EventStream
from . import tokenizer_api

log = logging.getLogger("speculate.server")
RETRY_AFTER_SECONDS = 1
KV_SLACK = 65  # positions a draft may take past the last token (a tree's nodes), reserved with each request


def create_app(config: ServerConfig, target: LoadedModel, draft: LoadedModel | None = None,
               scheduler: Scheduler | None = None) -> FastAPI:
    """``scheduler``: the generation thread's scheduler, when the models were loaded on it (server/main.py,
    build_app); by default a new one."""
    metrics = Metrics()
    if scheduler is None:
        scheduler = new_scheduler(config)
    scheduler.on_change = metrics.set_load
    scheduler.on_round = metrics.record_round
    scheduler.on_admit = metrics.queue_time.observe
    scheduler.on_preempt = metrics.preemptions.inc
    # --k auto and the server's k as a cap: each round's draft lengths, gated by measurement (speculate/policy/batch.py)
    planner = BatchPlanner(target, DraftGate(enabled=config.draft_gate))
    scheduler.plan = planner.round
    scheduler.observe = planner.observe
    metrics.gate = planner.gate

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            await anyio.to_thread.run_sync(scheduler.stop)

    app = FastAPI(title="speculate", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ready = False
    app.state.config, app.state.metrics, app.state.scheduler = config, metrics, scheduler
    app.state.target = target  # (tools that drive an app in-process: its tokenizer)
    app.state.planner = planner  # (the draft gate's state, for tests and tools)
    routes = Routes(app, config, target, draft, scheduler, metrics)
    app.state.begin_shutdown = routes.begin_shutdown
    install_error_handlers(app, partial(check_api_key, api_keys=config.api_keys))
    app.router.redirect_slashes = False  # its 307 built the Location from the (client's) Host header
    app.add_middleware(HostGuard, bound_host=config.host, allowed_hosts=config.allowed_hosts,
                       keyless=not config.api_keys)
    app.add_middleware(StatusCounter, metrics=metrics)
    for method in (app.get, app.head):  # (one route each: OpenAPI wants an operation id per method)
        method("/health")(routes.health)
        method("/metrics")(routes.prometheus_metrics)
        method("/v1/models")(routes.list_models)
    app.post("/v1/completions")(routes.completions)
    app.post("/v1/chat/completions")(routes.chat_completions)
    app.get("/tokenizer_info")(routes.tokenizer_info)
    app.post("/tokenize")(routes.tokenize)
    app.post("/detokenize")(routes.detokenize)
    app.get("/openapi.json", include_in_schema=False)(routes.openapi)
    return app


class Routes:
    """The handlers, each a small method; what they share (the models, the generation thread, the decoders, the
    metrics) is set once here. Engine and scheduler errors become HTTP answers here only (:func:`as_api_error`);
    a client that left gets :meth:`client_gone`'s 499, wherever it left."""

    def __init__(self, app: FastAPI, config: ServerConfig, target: LoadedModel, draft: LoadedModel | None,
                 scheduler: Scheduler, metrics: Metrics):
        self.app, self.config, self.target, self.scheduler, self.metrics = app, config, target, scheduler, metrics
        # Prompts' and answers' KV blocks for every request, whatever its settings, of the target and the draft model
        # (models/prefix_store.py).
        self.prefix_store = PrefixStore(int(config.prefix_cache_gib * 2**30)) if config.prefix_cache else None
        metrics.store = self.prefix_store
        metrics.indexes = partial(suffix_indexes, target)
        # One decoder per speculative settings in use, shared by their requests (each run has its own cache).
        self.decoders = Decoders(lambda s: build_decoder(target, draft, s, self.prefix_store), keep=config.max_batch)
        # KV bytes a token may take: the target's cache and (for the drafters that run it) the draft model's; a
        # request reserves its prompt, max tokens and a draft's rows of them (over-counting the draft model's for
        # requests that do not use it).
        self.kv_per_token = position_bytes(target) + (position_bytes(draft) if draft is not None else 0)
        metrics.kv_budget.set(scheduler.kv_budget)
        metrics.kv_reserved = lambda: scheduler.kv_reserved
        metrics.kv_pool = partial(pool_bytes, target.model)
        self.model_id = config.model
        self.public_name = Path(target.name).name  # an alias, or a local folder's last component: never its path
        self.created = int(time.time())
        self._openapi: dict | None = None

    def begin_shutdown(self) -> None:
        """From the event loop, when a stop begins (SIGTERM, Ctrl-C: server/main.py): admit nothing more, answer
        queued requests 503, and give running generations ``shutdown_grace`` seconds before they are ended
        with a 503 (a stream: an error event, then [DONE])."""
        self.app.state.ready = False
        error = APIError(503, "the server is shutting down", code="shutting_down")
        self.scheduler.close(error)
        asyncio.get_running_loop().call_later(self.config.shutdown_grace, self.scheduler.end_running, error)

    async def health(self):
        # The model's name, not its id: the id of a local folder is its path, which is not for everyone to see.
        if self.app.state.ready and self.scheduler.started:
            return {"status": "ok", "model": self.public_name}
        return JSONResponse(error_body(503, "the server is not ready", code="not_ready"), status_code=503)

    async def prometheus_metrics(self):
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def list_models(self, request: Request):
        check_api_key(request, self.config.api_keys)
        return {"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                            "owned_by": "speculate"}]}

    async def completions(self, request: Request):
        return await self.generate(request, "text")

    async def chat_completions(self, request: Request):
        return await self.generate(request, "chat")

    async def openapi(self, request: Request):
        """The OpenAPI 3 description of these routes, their request bodies declared by the same Pydantic models
        that validate them (``speculative`` among their fields). Behind the key, as the routes are."""
        check_api_key(request, self.config.api_keys)
        if self._openapi is None:
            self._openapi = openapi_schema(self.app, bool(self.config.api_keys), self.model_id,
                                          self.config.max_tokens)
        return self._openapi

    async def tokenizer_info(self, request: Request):
        check_api_key(request, self.config.api_keys)
        return tokenizer_api.tokenizer_info(self.target.tokenizer, self.target.context_window)

    async def tokenize(self, request: Request):
        req, _ = await self.validated(request, tokenizer_api.TokenizeRequest)
        tokenize = partial(tokenizer_api.tokenize, self.target.tokenizer, req, self.target.context_window)
        return await anyio.to_thread.run_sync(tokenize)  # (a long prompt is not tokenized on the event loop)

    async def detokenize(self, request: Request):
        req, _ = await self.validated(request, tokenizer_api.DetokenizeRequest)
        return await anyio.to_thread.run_sync(tokenizer_api.detokenize, self.target.tokenizer, req)

    async def generate(self, request: Request, kind: str):
        """Validate, queue every choice (a generation each, in the batch together), then answer whole or as a
        stream."""
        req, tenant = await self.validated(request, ChatCompletionRequest if kind == "chat" else CompletionRequest)
        scope = "" if self.config.share_drafts else tenant  # whose served answers may draft for it (suffix)
        prepared = await anyio.to_thread.run_sync(prepare, self.config, self.target, req, scope)
        jobs = self.submit(prepared)
        prompts = len(prepared) // req.n
        shaper = Shaper(kind, self.model_id, prepared[0].spec, len(prepared), prompts, self.target.tokenizer)
        outcome = request.scope.get(OUTCOME_KEY, {})
        echoes = [(p.echo, p.ids[0]) if p.echo is not None else None for p in prepared]
        if req.stream:
            scored = [p.sampling.prompt_logprobs is not None for p in prepared]  # (their echo waits for its values)
            return await self.stream(request, jobs, shaper, kind, req.include_usage, outcome,
                                     [e if e and not s else None for e, s in zip(echoes, scored)], echoes)
        gens = []
        for job in jobs:
            event, value = await wait_or_disconnect(job, request)
            job.finished = True
            if event == "done":
                self.record(job, value)
                gens.append(value.generation)
                continue
            for other in jobs:  # one choice failed or the client left: the others stop too
                other.cancel()
            if event == "error":
                raise as_api_error(value)
            return client_gone(jobs, outcome)
        return shaper.whole(gens, echoes)

    async def validated(self, request: Request, schema):
        """(the request's body validated by ``schema``, the tenant of its API key: server/auth.py)."""
        tenant = check_api_key(request, self.config.api_keys)
        data = await read_json(request, self.config.max_body_bytes, self.config.body_timeout)
        try:
            req = schema.model_validate(data)
        except ValidationError as e:
            raise validation_error(e.errors(), data) from None
        if req.model is not None and req.model != self.model_id:  # (the tokenizer's requests may name none)
            raise APIError(404, "the model named in the request does not exist; GET /v1/models lists the one this "
                                "server serves", "model", "model_not_found")
        return req, tenant

    def submit(self, prepared: list) -> list[Job]:
        """A job per choice, admitted together or not at all (a 429 takes none of them)."""
        loop = asyncio.get_running_loop()
        jobs = [Job(partial(open_run, p, self.decoders, self.scheduler.prefill_chunk), loop, p.prompt_tokens,
                    p.spec.registry_name,
                    self.kv_per_token * (p.prompt_tokens + p.sampling.max_new_tokens + KV_SLACK), self.kv_per_token)
                for p in prepared]
        for job in jobs:
            if self.scheduler.too_large(job):
                gib = 2**30
                raise APIError(400, f"this request needs {job.kv_bytes / gib:.2f} GiB of KV cache (its prompt and "
                                    f"max tokens); this server runs {self.scheduler.kv_budget / gib:.2f} GiB "
                                    f"(--kv-memory): ask for fewer tokens", "max_tokens", "kv_memory_exceeded")
        try:
            self.scheduler.submit(*jobs)
        except Closed:
            raise APIError(503, "the server is shutting down", code="shutting_down") from None
        except QueueFull:
            busy = f"a batch of {self.scheduler.max_batch} generation(s) and a queue of {self.scheduler.max_queue}"
            raise APIError(429, f"the server is busy: {busy} are all taken; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        return jobs

    async def stream(self, request: Request, jobs: list[Job], shaper: Shaper, kind: str, include_usage: bool,
                     outcome: dict, echo_now: list, echoes: list):
        # Wait for the generation thread to open every choice's stream: settings the engine refuses are still a
        # 400, not an error event inside a 200 stream.
        for job in jobs:
            event, value = await wait_or_disconnect(job, request, until_ready=True)  # (cancels it if torn down)
            if event == "ready":
                continue
            for other in jobs:
                other.cancel()
            if event == "error":
                job.finished = True
                raise as_api_error(value)
            return client_gone(jobs, outcome)  # the client left while the request was queued

        def on_close():
            if not all(job.finished for job in jobs):
                client_gone(jobs, outcome)
        return EventStream(self.events(jobs, shaper, kind, include_usage, outcome, echo_now, echoes), on_close)

    async def events(self, jobs: list[Job], shaper: Shaper, kind: str, include_usage: bool, outcome: dict,
                     echo_now: list, echoes: list):
        """The choices' chunks as their pieces arrive (each with its index), each choice's finish chunk as it ends,
        then (include_usage) the usage chunk and [DONE]. A choice's error ends the stream (the others stop). A
        completion's ``echo`` is its choice's first chunk: at once (``echo_now``), or with the prompt's
        log-probabilities once its prefill has computed them (``echoes``: each choice's prompt text and first token)."""
        if kind == "chat":
            for i in range(len(jobs)):
                yield sse(shaper.chunk(text="", first=True, index=i))
        for i, echo in enumerate(echo_now):
            if echo is not None:
                yield sse(shaper.echo_chunk(*echo, index=i))
        waiting = {asyncio.ensure_future(job.events.get()): i for i, job in enumerate(jobs)}
        gens: dict[int, object] = {}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=waiting.get):  # (the lower index first where both are ready)
                    i = waiting.pop(future)
                    event, value = future.result()
                    if event == "prompt_logprobs":
                        yield sse(shaper.echo_chunk(*echoes[i], entries=value, index=i))
                        waiting[asyncio.ensure_future(jobs[i].events.get())] = i
                    elif event in ("piece", "logprobs"):
                        text, scored = (value, None) if event == "piece" else ("", value)
                        yield sse(shaper.chunk(text=text, index=i, logprobs=scored))
                        waiting[asyncio.ensure_future(jobs[i].events.get())] = i
                    elif event == "done":
                        jobs[i].finished = True
                        self.record(jobs[i], value)
                        gens[i] = value.generation
                        yield sse(shaper.finish_chunk(value.generation, i))
                    elif event == "error":
                        jobs[i].finished = True
                        for job in jobs:
                            job.cancel()
                        err = as_api_error(value)
                        outcome["status"] = str(err.status)
                        yield sse(err.body())
                        yield DONE
                        return
                    else:  # cancelled: the client is gone
                        return
            if include_usage:
                yield sse(shaper.usage_chunk([gens[i] for i in range(len(jobs))]))
            yield DONE
        finally:
            for future in waiting:
                future.cancel()

    def record(self, job: Job, result: Outcome) -> None:
        now = time.perf_counter()
        ttft = result.first_piece_at - job.submitted_at if result.first_piece_at is not None else None
        self.metrics.record_generation(result.generation, ttft, now - job.submitted_at, job.drafter)


# The routes whose bodies the handlers read themselves (for the size limit and the one-line errors) and validate with
# these models: the schema gets them as request bodies.
REQUEST_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                  "/tokenize": tokenizer_api.TokenizeRequest, "/detokenize": tokenizer_api.DetokenizeRequest}


def openapi_schema(app: FastAPI, keyed: bool, model_id: str, max_tokens: int = 0) -> dict:
    """FastAPI's description of the routes, with each body's model (and the models it uses) in components. A body's
    ``model`` is the one name this server answers to (an enum of one): any other is a 404, so a client generated from
    the schema, or a schema-driven fuzzer, sends the name that reaches the handlers. ``max_tokens`` (the server's
    --max-tokens, 0: none) is the ``maximum`` of the new-token fields, which the server enforces."""
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title="speculate", version=__version__, routes=app.routes,
                         description="An OpenAI-compatible server with speculative decoding; the extension field "
                                     "`speculative` sets the drafter, the verifier and its parameters, and k.")
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        served = body["properties"]["model"]
        served.update({"enum": [model_id] + ([None] if "anyOf" in served else [])})
        for field in ("max_tokens", "max_completion_tokens"):
            prop = body["properties"].get(field)
            if max_tokens and prop is not None:
                for kind in prop.get("anyOf", [prop]):
                    if kind.get("type") == "integer":
                        kind["maximum"] = max_tokens
                if isinstance(prop.get("default"), int):  # (completions' 16, as the handler caps it)
                    prop["default"] = min(prop["default"], max_tokens)
        components[model.__name__] = body
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    if keyed:
        schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in schema["paths"].items():
            if path.startswith("/v1") or path in REQUEST_BODIES or path == "/tokenizer_info":
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
    return schema


def client_gone(jobs: list[Job], outcome: dict) -> Response:
    """The client left (or closed the stream): stop its generations, count it as 499 (nginx's "client closed
    request"); the response itself reaches nobody."""
    for job in jobs:
        job.cancel()
    outcome["status"] = "499"
    return Response(status_code=499)


def new_scheduler(config: ServerConfig) -> Scheduler:
    """The generation thread for ``config``: batches of ``--max-batch``, prompts fed ``--prefill-chunk`` at a time,
    ``--prefill-budget`` prompt tokens a round for all of them."""
    return Scheduler(config.max_batch, config.max_queue, prefill_chunk=config.prefill_chunk,
                     prefill_budget=config.prefill_budget, kv_budget=config.kv_budget())


def as_api_error(value) -> APIError:
    """What the client is told of a job's error: an APIError as it is, settings the engine refused (SpeculateError)
    as a 400, anything else as a 500 (logged)."""
    if isinstance(value, APIError):
        return value
    if isinstance(value, SpeculateError):
        return refused(value)
    log.error("generation failed", exc_info=value)
    return APIError(500, f"generation failed: {type(value).__name__}: {value}", code="generation_failed")


async def wait_or_disconnect(job: Job, request: Request, until_ready: bool = False):
    """The job's final event ('done', 'error', 'cancelled') — or, ``until_ready``, its first one ('ready' when
    its stream is open) — or ('disconnected', None) if the client left."""
    passing = ("piece", "logprobs", "prompt_logprobs") + (() if until_ready else ("ready",))

    async def final():
        while True:
            event, value = await job.events.get()
            if event not in passing:
                return event, value

    async def disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        return "disconnected", None

    tasks = [asyncio.ensure_future(final()), asyncio.ensure_future(disconnect())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled (a forced shutdown): nobody will read the job
        job.cancel()
        raise
    finally:
        for t in tasks:
            t.cancel()
    return (tasks[0] if tasks[0] in done else next(iter(done))).result()
