"""``speculate serve --ray``: the same OpenAI-compatible app, one engine per Ray Serve replica.

We do not write a cluster layer: Ray Serve gives replicas, the HTTP proxy, autoscaling, health checks, restarts
and graceful drains. Two deployments make one application:

- ``Engine`` (``--replicas`` of them): each holds the whole app of ``speculate serve`` (server/app.py: the same
  handlers, validation, errors, streaming, API key, limits, /metrics) with its own generation thread, and runs
  one HTTP request through it per call (:meth:`Engine.http`), yielding the app's ASGI messages.
- ``Front`` (the ingress, behind Ray's proxy): reads a request's body (server/body.py's limits), hands it whole to
  an engine replica through a Ray handle, and relays the answer as it streams.

The hop through ``Front`` exists for routing: Ray's proxy hands a replica only the request's headers, and the
body streams in afterwards, so a router placed there could not see the prompt. ``PrefixAffinityRouter`` sees it
here (:class:`HTTPCall` carries the prompt's block keys) and sends a request to the replica that served its
longest known prefix, whose prefix store (models/prefix_store.py) then holds its KV; a saturated owner, or no
owner, falls back to the power of two choices, as Ray's default router does.

A stop (``serve_on_ray``) is the plain server's: ``Front.drain`` answers new requests 503, gives the answers in
flight ``--shutdown-grace`` seconds and ends the rest with the plain server's error; only then does Serve stop.
A replica that dies is restarted by Ray. A request that had begun its answer there ends with a clear error (a
stream's error event, then ``[DONE]``); one whose answer had not begun is sent once more, to another replica (a
generation has no side effects, and the client has seen nothing), and only then is a 503.

``build(config, options)`` makes the application; ``speculate.serve_ray.app(args)`` makes it from ``speculate
serve``'s flags (``serve run speculate.serve_ray:app model=... replicas=2``, or a Serve config file). The plain server
never imports Ray.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import ray
from ray import serve
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ..errors import SpeculateError
from .config import ServerConfig
from .errors import APIError

log = logging.getLogger("speculate.server")

APP_NAME = "speculate"
REPLICA_HEADER = b"x-speculate-replica"  # names the replica that answered, on every response
BLOCK_CHARS = 64  # the router's prefix blocks: characters of the prompt's text each
MAX_BLOCKS = 64  # the first 4,096 characters decide; past them requests share enough to stay together


# --- settings ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RayOptions:
    """``serve --ray``'s own flags, checked once. ``replicas``: a fixed count; or ``min_replicas`` ..
    ``max_replicas`` with Ray's autoscaler aiming at ``target_ongoing`` requests per replica."""

    replicas: int = 2
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing: float | None = None  # default: the server's --max-batch
    replica_threads: int = 1  # torch threads of a replica, and the Ray CPUs it asks for
    address: str | None = None  # join this cluster ("auto": the one `ray start` made here); None: start one
    router: str = "affinity"  # or "default": Ray's power of two choices

    def __post_init__(self):
        if self.replicas < 1:
            raise SpeculateError(f"--replicas must be >= 1, got {self.replicas}")
        if self.replica_threads < 1:
            raise SpeculateError(f"--replica-threads must be >= 1, got {self.replica_threads}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise SpeculateError("--min-replicas and --max-replicas go together")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas >= 1:
            raise SpeculateError(f"need 0 <= --min-replicas <= --max-replicas, >= 1; got {self.min_replicas} "
                                 f"and {self.max_replicas}")
        if self.target_ongoing is not None and not 0 < self.target_ongoing < float("inf"):
            raise SpeculateError(f"--target-ongoing must be > 0, got {self.target_ongoing}")
        if self.router not in ("affinity", "default"):
            raise SpeculateError(f"--router must be 'affinity' or 'default', got {self.router!r}")

    @classmethod
    def from_cli(cls, args) -> RayOptions:
        return cls(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                   target_ongoing=args.target_ongoing, replica_threads=args.replica_threads,
                   address=args.ray_address, router=args.router)


# --- one request, as a replica receives it ----------------------------------------------------------------------
@dataclass(frozen=True)
class HTTPCall:
    """An HTTP request read whole by the front: what a replica's app needs to answer it, and the prompt's block
    keys for the router."""

    scope: dict  # the ASGI scope's plain fields (server/app.py's middleware reads headers, client, server)
    body: bytes
    prefix_keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, scope: dict, body: bytes) -> HTTPCall:
        plain = {key: scope[key] for key in ("type", "http_version", "method", "scheme", "path", "raw_path",
                                             "query_string", "headers", "client", "server") if key in scope}
        plain["root_path"] = ""
        plain["asgi"] = {"version": "3.0"}
        return cls(plain, body, prefix_keys(prompt_text(body)))


def prompt_text(body: bytes) -> str:
    """The text a request's answer starts from, as far as the body says without the tokenizer: a chat's messages
    (role, then content) in order, or a completion's prompt. Anything else (a GET, a malformed body): "" (the
    replica's app gives malformed bodies their 4xx)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):
        return ""
    if not isinstance(data, dict):
        return ""
    if isinstance(data.get("messages"), list):
        parts = []
        for message in data["messages"]:
            if isinstance(message, dict):
                content = message.get("content")
                if isinstance(content, list):  # content parts: their text
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict)
                                      and isinstance(p.get("text"), str))
                parts.append(f"{message.get('role')}\n{content if isinstance(content, str) else ''}\n")
        return "".join(parts)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch of prompts: the first decides (they are answered by one replica)
    return prompt if isinstance(prompt, str) else json.dumps(prompt) if isinstance(prompt, list) else ""


def prefix_keys(text: str) -> tuple[str, ...]:
    """One key per whole block of ``BLOCK_CHARS`` characters, each naming the text up to the end of its block
    (a chain: a key's digest covers its parent's), for at most ``MAX_BLOCKS`` blocks. Two prompts share key i
    exactly when they share their first i + 1 blocks."""
    keys, parent = [], b""
    for start in range(0, min(len(text), BLOCK_CHARS * MAX_BLOCKS) - BLOCK_CHARS + 1, BLOCK_CHARS):
        parent = hashlib.blake2b(parent + text[start:start + BLOCK_CHARS].encode("utf-8", "surrogatepass"),
                                 digest_size=12).digest()
        keys.append(parent.hex())
    return tuple(keys)


# --- routing ----------------------------------------------------------------------------------------------------
class PrefixAffinityRouter(RequestRouter):
    """Ray Serve request router (the public ``RequestRouter`` interface): a request goes to the replica that was
    last sent its longest known prefix, unless that replica is saturated (Ray's queue-length cache: at its
    ``max_ongoing_requests``, or more than ``imbalance`` requests above the least loaded candidate); otherwise, and
    for a prefix no replica has seen, the power of two choices (two random candidates, the shorter queue wins).

    Ray's own ``PrefixCacheAffinityRouter`` lives in Ray's private LLM package (its public import needs pyarrow),
    keeps its tree in a detached actor that must find a free CPU, and divides by the prompt's length (a GET has
    none); this one keeps an LRU map of block keys in the caller's process."""

    def initialize_state(self, imbalance: int = 8, memory: int = 1 << 16):
        self._owner: OrderedDict[str, ReplicaID] = OrderedDict()  # block key -> the replica last sent it
        self._imbalance, self._memory = imbalance, memory

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        pair = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        by_id = {r.replica_id: r for r in candidate_replicas}
        for key in reversed(_keys_of(pending_request)):  # the deepest shared block first
            owner = by_id.get(self._owner.get(key))
            if owner is not None:
                return [[owner], pair] if not self._saturated(owner, candidate_replicas) else [pair]
        return [pair]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        for key in _keys_of(pending_request):
            self._owner[key] = replica_id
            self._owner.move_to_end(key)
        while len(self._owner) > self._memory:
            self._owner.popitem(last=False)

    def _saturated(self, replica: RunningReplica, candidates: list[RunningReplica]) -> bool:
        queue = self.replica_queue_len_cache.get(replica.replica_id)
        if queue is None:  # not known lately: Ray's rejection protocol still refuses a full replica
            return False
        least = min(self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidates)
        return queue >= replica.max_ongoing_requests or queue - least > self._imbalance


def _keys_of(pending_request: PendingRequest | None) -> tuple[str, ...]:
    # By attribute, not isinstance: Ray ships the ingress class by value, with its own copy of HTTPCall.
    if pending_request is None or not pending_request.args:
        return ()
    return getattr(pending_request.args[0], "prefix_keys", ())


# --- the deployments --------------------------------------------------------------------------------------------
class Engine:
    """One replica: the app of ``speculate serve`` (models loaded on its generation thread) with its lifespan
    entered, so the generation thread runs; Ray's graceful stop waits for its requests, then leaves it."""

    async def __init__(self, config: ServerConfig, threads: int):
        import torch

        from .main import build_app

        torch.set_num_threads(threads)
        self.app = await asyncio.to_thread(build_app, config)
        self.name = serve.get_replica_context().replica_id.unique_id.encode()
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()

    async def http(self, call: HTTPCall):
        """Answer ``call`` through the app, yielding its ASGI messages as the app sends them. A caller that
        leaves (the client went away, so Ray cancels this generator) shows the app a disconnect, which ends the
        generation as it would on the plain server."""
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body = [{"type": "http.request", "body": call.body, "more_body": False}]

        async def receive():
            if body:
                return body.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (REPLICA_HEADER, self.name)]}
            messages.put_nowait(message)

        task = asyncio.create_task(self.app(call.scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while (message := await messages.get()) is not None:
                yield message
            task.result()  # the app's own failure (it answers errors itself: this is a bug's traceback)
        finally:
            gone.set()
            if not task.done():
                await asyncio.wait([task], timeout=5.0)  # the app notices the disconnect between rounds
                task.cancel()

    def check_health(self) -> None:
        """Ray calls this every few seconds; a replica whose generation thread died is replaced."""
        if not self.app.state.scheduler.started:
            raise RuntimeError("the generation thread is not running")

    async def __del__(self):
        if hasattr(self, "_lifespan"):
            await self._lifespan.__aexit__(None, None, None)


# After a drain, the seconds Ray's proxy gets to pass the answers' last bytes on before Serve stops (serve_on_ray).
PROXY_FLUSH_S = 1.0


def _shutting_down() -> APIError:
    return APIError(503, "the server is shutting down", code="shutting_down")  # (the plain server's words)


# What ends a replica's answer from outside it: the replica died or cannot be reached.
_REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


@serve.ingress()
class Front:
    """The ingress: reads each request's body, then relays a replica's answer (module docstring)."""

    def __init__(self, engine, max_body_bytes: int, body_timeout: float):
        self.engine = engine.options(stream=True)
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout
        self.closing = False  # drain(): new requests get 503
        self.running: set[asyncio.Task] = set()  # the relays in flight

    async def drain(self, grace: float) -> tuple[int, int]:
        """A graceful stop, called by ``serve_on_ray`` before Serve stops: answer new requests 503, give the
        answers in flight ``grace`` seconds, then end the rest as the plain server does (a stream: an error
        event, then ``[DONE]``; ended relays cancel their replica's generation). Returns (how many were in
        flight, how many of them were ended)."""
        self.closing = True
        running = set(self.running)
        if running:
            await asyncio.wait(running, timeout=grace)
        late = set(self.running)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=5.0)
        return len(running), len(late)

    def __serve_build_asgi_app__(self):
        async def asgi(scope, receive, send) -> None:  # (a plain function: uvicorn took the bound method for ASGI2)
            await self.answer(scope, receive, send)
        return asgi

    async def answer(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":  # nothing of its own to start or stop
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        from starlette.requests import Request

        from .body import read_body

        try:
            if self.closing:
                raise _shutting_down()
            body = await read_body(Request(scope, receive), self.max_body_bytes, self.body_timeout)
        except APIError as e:
            await e.response()(scope, receive, send)
            return
        task = asyncio.current_task()
        self.running.add(task)
        try:
            await self.relay(HTTPCall.of(scope, body), scope, receive, send)
        finally:
            self.running.discard(task)

    async def relay(self, call: HTTPCall, scope, receive, send) -> None:
        for attempt in (1, 2):
            began = streaming = False
            try:
                async for message in self.engine.http.remote(call):
                    if message["type"] == "http.response.start":
                        began = True
                        streaming = any(k == b"content-type" and v.startswith(b"text/event-stream")
                                        for k, v in message.get("headers", ()))
                    await send(message)
                return
            except _REPLICA_GONE as e:
                if not began and attempt == 1:
                    log.warning("a replica failed before answering (%s); sending the request to another",
                                type(e).__name__)
                    continue
                error = APIError(503, "the replica serving this request stopped; try again",
                                 code="replica_failed")
            except asyncio.CancelledError:
                if not self.closing:  # the client left: Ray cancels this relay, and the replica's generation
                    raise
                error = _shutting_down()  # drain()'s grace ran out
            except Exception:
                log.exception("relaying a replica's answer failed")
                error = APIError(500, "the server failed while answering this request", code="internal_error")
            if not began:
                await error.response()(scope, receive, send)
            else:  # the answer had begun: end it clearly, as the plain server ends a stream it cannot finish
                from .responses import DONE, sse

                tail = sse(error.body()) + DONE if streaming else b""
                await send({"type": "http.response.body", "body": tail, "more_body": False})
            return


# --- building and running ---------------------------------------------------------------------------------------
def build(config: ServerConfig, options: RayOptions):
    """The Serve application: ``Front`` bound to ``options.replicas`` engines (or an autoscaled range)."""
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    engine_options = dict(
        name="Engine",
        # the app answers 429 past its queue itself; Ray must let that many through
        max_ongoing_requests=config.max_batch + config.max_queue,
        ray_actor_options={"num_cpus": options.replica_threads,
                           "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(options.replica_threads)}}},
        graceful_shutdown_timeout_s=config.shutdown_grace + 5,  # running generations finish first
        health_check_period_s=5, health_check_timeout_s=30)
    if options.min_replicas is not None:
        engine_options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=options.min_replicas, max_replicas=options.max_replicas,
            target_ongoing_requests=options.target_ongoing or config.max_batch)
    else:
        engine_options["num_replicas"] = options.replicas
    if options.router == "affinity":
        engine_options["request_router_config"] = RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs={"imbalance": config.max_batch})
    engine = serve.deployment(Engine).options(**engine_options)
    front = serve.deployment(Front).options(name="Front", max_ongoing_requests=config.max_connections,
                                            ray_actor_options={"num_cpus": 0})
    return front.bind(engine.bind(config, options.replica_threads), config.max_body_bytes, config.body_timeout)


def start_ray(options: RayOptions, log_level: str = "warning") -> None:
    """Join ``options.address``, or start a local Ray instance sized for the replicas. Before a local instance
    starts (its processes inherit this environment), Serve's HTTP proxy gets a minute to report ready, not Ray's
    5 s: on 2 busy cores a Ray worker took 15-20 s to import Ray, and Serve killed and restarted the proxy three
    times in a row. Values the user set stay."""
    if options.address is not None:
        ray.init(address=options.address, logging_level=log_level.upper(), log_to_driver=False)
        return
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(name, "60")
    need = (options.max_replicas or options.replicas) * options.replica_threads
    # Ray's CPUs are an account, not cores: the proxy, the controller and the front ask for none of them
    ray.init(address="local", num_cpus=max(need, os.cpu_count() or 1), include_dashboard=False,
             logging_level=log_level.upper(), log_to_driver=log_level == "debug")


def serve_on_ray(config: ServerConfig, options: RayOptions, log_level: str = "info") -> None:
    """``speculate serve --ray``: join ``options.address`` (or start a local Ray instance), run the application
    behind Ray's HTTP proxy on ``config.host:config.port``, and on SIGTERM / Ctrl-C drain it and stop what this
    process started."""
    from ..models.loader import check_model_name
    from .main import _check_address

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    for name in filter(None, (config.model, config.draft_model)):  # here, in one line, not in every replica's log
        check_model_name(name)
    if options.address is None:
        _check_address(config.host, config.port)
    start_ray(options, log_level)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        try:
            serve.run(build(config, options), name=APP_NAME, route_prefix="/", blocking=False)
        except RuntimeError as e:  # a replica's constructor failed (Ray tried it 3 times); its log has the rest
            raise SpeculateError(f"the replicas did not start: {str(e).splitlines()[0]} (see the replica logs "
                                 f"under Ray's session folder, /tmp/ray/session_latest/logs/serve)") from None
        log.info("serving on http://%s:%d through Ray Serve (%s)", config.host, config.port,
                 f"{options.min_replicas}..{options.max_replicas} replicas" if options.min_replicas is not None
                 else f"{options.replicas} replicas")
        while not stop.wait(1.0):
            pass
        log.info("stopping: new requests get 503; running ones get %g s to finish", config.shutdown_grace)
        running, ended = serve.get_app_handle(APP_NAME).drain.remote(config.shutdown_grace).result(
            timeout_s=config.shutdown_grace + 30)
        if ended:
            log.warning("%d requests did not finish within --shutdown-grace and were ended", ended)
        if running:
            # A relay that has returned has handed its last messages to Serve, not yet to the client: Ray's proxy
            # fetches them from the replica, and serve.shutdown() kills the proxy at once (Ray 2.60,
            # ProxyState.shutdown), which likely cut a stream before its [DONE] once in a fresh check. Give the proxy time to
            # write them (it fetches within milliseconds; this is the margin for a loaded machine).
            time.sleep(PROXY_FLUSH_S)
    finally:
        if options.address is None:
            serve.shutdown()
            ray.shutdown()
        else:  # a shared cluster: take this application away, leave Serve and Ray to their owners
            serve.delete(APP_NAME)
            ray.shutdown()
