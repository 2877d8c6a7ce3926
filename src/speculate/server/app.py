"""The FastAPI application: routes of the OpenAI API, /health and /metrics.

``create_app(config, target, draft)`` takes models that are already loaded; the worker pool starts with
the app (lifespan), and /health answers 200 only from then on.
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
from ..batch import BatchPlanner
from ..models.loader import LoadedModel
from .auth import check_api_key
from .body import read_json
from .config import ServerConfig
from .errors import APIError, error_body, install_error_handlers, validation_error
from .guard import HostGuard
from .decoders import Decoders
from .generation import build_decoder, open_run, prepare
from .metrics import OUTCOME_KEY, Metrics, StatusCounter
from .scheduler import Closed, Job, Outcome, QueueFull, Scheduler
from .responses import DONE, Shaper, sse
from .schemas import ChatCompletionRequest, CompletionRequest
from .sse import EventStream

log = logging.getLogger("speculate.server")
RETRY_AFTER_SECONDS = 1


def create_app(config: ServerConfig, target: LoadedModel, draft: LoadedModel | None = None,
               pool: Scheduler | None = None) -> FastAPI:
    """``pool``: the generation thread's scheduler, when the models were loaded on it (server/main.py,
    build_app); by default a new one."""
    metrics = Metrics()
    if pool is None:
        pool = scheduler(config)
    pool.on_change = metrics.set_load
    pool.on_round = metrics.record_round
    pool.on_admit = metrics.queue_time.observe
    pool.plan = BatchPlanner(target)  # --k auto: each round's draft lengths for the batch (speculate/batch.py)
    # Idle decoders between requests (prefix reuse): one per place in the batch, each holding its KV buffers.
    decoders = Decoders(lambda s: build_decoder(target, draft, s, config.prefix_cache), keep=config.max_batch)
    model_id = config.model
    public_name = Path(target.name).name  # an alias, or a local folder's last component: never its path
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pool.start()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False
            await anyio.to_thread.run_sync(pool.stop)

    app = FastAPI(title="speculate", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ready = False
    app.state.config, app.state.metrics, app.state.pool = config, metrics, pool

    def begin_shutdown() -> None:
        """From the event loop, when a stop begins (SIGTERM, Ctrl-C: server/main.py): admit nothing more, answer
        queued requests 503, and give running generations ``shutdown_grace`` seconds before they are ended
        with a 503 (a stream: an error event, then [DONE])."""
        app.state.ready = False
        error = APIError(503, "the server is shutting down", code="shutting_down")
        pool.close(error)
        asyncio.get_running_loop().call_later(config.shutdown_grace, pool.end_running, error)

    app.state.begin_shutdown = begin_shutdown
    install_error_handlers(app, partial(check_api_key, api_key=config.api_key))
    app.router.redirect_slashes = False  # its 307 built the Location from the (client's) Host header
    app.add_middleware(HostGuard, bound_host=config.host, allowed_hosts=config.allowed_hosts,
                       keyless=config.api_key is None)
    app.add_middleware(StatusCounter, metrics=metrics)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        # The model's name, not its id: the id of a local folder is its path, which is not for everyone to see.
        if app.state.ready and pool.started:
            return {"status": "ok", "model": public_name}
        return JSONResponse(error_body(503, "the server is not ready", code="not_ready"), status_code=503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models(request: Request):
        check_api_key(request, config.api_key)
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "speculate"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    async def generate(request: Request, kind: str):
        check_api_key(request, config.api_key)
        data = await read_json(request, config.max_body_bytes, config.body_timeout)
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req = schema.model_validate(data)
        except ValidationError as e:
            raise validation_error(e.errors(), data) from None
        if req.model != model_id:
            raise APIError(404, "the model named in the request does not exist; GET /v1/models lists the one this "
                                "server serves", "model", "model_not_found")
        prepared = await anyio.to_thread.run_sync(prepare, config, target, req)
        job = Job(partial(open_run, prepared, decoders, pool.prefill_chunk), asyncio.get_running_loop())
        try:
            pool.submit(job)
        except Closed:
            raise APIError(503, "the server is shutting down", code="shutting_down") from None
        except QueueFull:
            raise APIError(429, f"the server is busy: a batch of {pool.max_batch} generation(s) and a queue of "
                                f"{pool.max_queue} are all taken; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        shaper = Shaper(kind, model_id, prepared.settings)
        outcome = request.scope.get(OUTCOME_KEY, {})
        if req.stream:
            # Wait for the worker to open the stream: settings the engine refuses are still a 400, not an
            # error event inside a 200 stream.
            kind_, value = await wait_or_disconnect(job, request, until_ready=True)  # (cancels it if torn down)
            if kind_ == "error":
                job.finished = True
                raise as_api_error(value)
            if kind_ != "ready":  # the client left while the request was queued
                job.cancel()
                outcome["status"] = "499"
                return Response(status_code=499)

            def on_close():
                if not job.finished:
                    job.cancel()
                    outcome["status"] = "499"  # client closed the request
            return EventStream(stream_events(job, shaper, kind, req.include_usage, outcome), on_close)
        kind_, value = await wait_or_disconnect(job, request)
        job.finished = True
        if kind_ == "done":
            record(job, value)
            return shaper.whole(value.generation)
        if kind_ == "error":
            raise as_api_error(value)
        job.cancel()
        outcome["status"] = "499"
        return Response(status_code=499)

    async def stream_events(job: Job, shaper: Shaper, kind: str, include_usage: bool, outcome: dict):
        if kind == "chat":
            yield sse(shaper.chunk(text="", first=True))
        while True:
            event, value = await job.events.get()
            if event == "piece":
                yield sse(shaper.chunk(text=value))
            elif event == "done":
                job.finished = True
                record(job, value)
                for chunk in shaper.final_chunks(value.generation, include_usage):
                    yield sse(chunk)
                yield DONE
                return
            elif event == "error":
                job.finished = True
                err = as_api_error(value)
                outcome["status"] = str(err.status)
                yield sse(err.body())
                yield DONE
                return
            else:  # cancelled
                return

    def record(job: Job, result: Outcome) -> None:
        now = time.perf_counter()
        ttft = result.first_piece_at - job.submitted_at if result.first_piece_at is not None else None
        metrics.record_generation(result.generation, ttft, now - job.submitted_at)

    return app


def scheduler(config: ServerConfig) -> Scheduler:
    """The generation thread for ``config``: batches of ``--max-batch``, prompts fed ``--prefill-chunk`` at a time."""
    return Scheduler(config.max_batch, config.max_queue, prefill_chunk=config.prefill_chunk)


def as_api_error(value) -> APIError:
    if isinstance(value, APIError):
        return value
    log.error("generation failed", exc_info=value)
    return APIError(500, f"generation failed: {type(value).__name__}: {value}", code="generation_failed")


async def wait_or_disconnect(job: Job, request: Request, until_ready: bool = False):
    """The job's final event ('done', 'error', 'cancelled') — or, ``until_ready``, its first one ('ready' when
    its stream is open) — or ('disconnected', None) if the client left."""
    passing = ("piece",) if until_ready else ("piece", "ready")

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
