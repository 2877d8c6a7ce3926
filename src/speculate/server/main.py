"""``speculate serve``: load the models once, check the default settings, then run uvicorn."""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import time

from ..errors import SpeculateError
from .config import ServerConfig
from .errors import APIError


def load_models(config: ServerConfig):
    """The target and the optional draft model; the server's default speculative settings are checked
    here, so a bad flag stops the server before it listens."""
    from ..drafters.model import check_same_tokenizer
    from ..models import load_model
    from ..policy.batch import cap_plannable
    from .generation import build_decoder, request_spec

    target = load_model(config.model, dtype=config.dtype)
    draft = load_model(config.draft_model, dtype=config.dtype) if config.draft_model else None
    if draft is not None:
        check_same_tokenizer(draft.tokenizer, target.tokenizer)
    try:
        drafter = build_decoder(target, draft, request_spec(config, None)).drafter
    except APIError as e:
        raise SpeculateError(e.message) from None
    # k by batch size's cost curve, now, not in the first request: for --k auto in batches, and for the default k as a
    # cap that drafts only where it pays, in a batch or alone (a drafter whose cost is known: not a draft model's,
    # whose fixed k is kept; policy/batch.py, ``cap_plannable``).
    k = config.spec.k
    capped = k != "auto" and cap_plannable(k, drafter.max_nodes(k), drafter.relative_cost())
    if capped or (config.max_batch > 1 and config.spec.k == "auto"):
        from ..policy.auto import profile_for

        profile_for(target, batch=True)
    return target, draft


def build_app(config: ServerConfig):
    """The app of ``speculate serve``: its models loaded (and the default settings checked) on the generation
    thread, not on this one (scheduler.py, Scheduler.call)."""
    from .app import create_app, new_scheduler

    scheduler = new_scheduler(config)
    try:
        target, draft = scheduler.call(lambda: load_models(config))
    except BaseException:  # a load that failed leaves an idle worker; Ctrl-C mid-load, a busy daemon one
        scheduler.stop(timeout=1)
        raise
    return create_app(config, target, draft, scheduler)


def _check_address(host: str, port: int) -> None:
    """Refuse an address this process cannot listen on (taken, or not a local address). A port freed later
    or taken in between is uvicorn's to report, as before."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:  # socket.gaierror: not a host name or address
        raise SpeculateError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    error = None
    for family, kind, proto, _, address in addresses:  # like the server: one that binds is enough
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
                probe.bind(address)
            return
        except OSError as e:
            error = error or e
    raise SpeculateError(f"cannot listen on {host}:{port} ({error.strerror or error})")


def uvicorn_server(app, config: ServerConfig, **options):
    """The uvicorn server ``speculate serve`` runs (tests run the same, on their own sockets): the h11 protocol
    with a header deadline and a connection cap (server/protocol.py), the idle keep-alive timeout, and a stop
    that first lets running generations finish (``app.state.begin_shutdown``) and only then closes."""
    import uvicorn

    from .protocol import guarded_protocol

    class GracefulServer(uvicorn.Server):
        async def startup(self, sockets=None):
            asyncio.get_running_loop().set_exception_handler(_quiet_accept_errors())
            await super().startup(sockets=sockets)

        async def shutdown(self, sockets=None):
            app.state.begin_shutdown()
            await super().shutdown(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            # uvicorn raises a captured SIGTERM again once it has stopped, so the process dies of it (status
            # 143); a stop that went as planned exits 0.
            self._captured_signals.clear()

    # loop="asyncio": the connection limits (server/protocol.py) are built and tested on asyncio's transports;
    # uvicorn's default takes uvloop wherever it is installed (ray[serve] installs it), and under uvloop the
    # connection cap closed a new connection instead of the oldest idle one in 2 of 4 runs of its test.
    options.setdefault("loop", "asyncio")
    protocol = guarded_protocol(config.header_timeout, config.max_connections, config.max_connections_per_client)
    uvicorn_config = uvicorn.Config(app, http=protocol, timeout_keep_alive=config.keep_alive_timeout,
                                    # after the grace period generations end themselves; this is the backstop
                                    timeout_graceful_shutdown=config.shutdown_grace + 5, **options)
    return GracefulServer(uvicorn_config)


def _quiet_accept_errors(every: float = 10.0):
    """An event loop exception handler: asyncio's accept loop failing for want of file descriptors ("Too many open
    files": it retries every second, logging a traceback each time — 1,995 of them, 1.6 MB, for 300 connections at
    ``ulimit -n 256``) becomes one line at most every ``every`` seconds; anything else goes to the default."""
    last = [float("-inf")]

    def handler(loop, context) -> None:
        error = context.get("exception")
        if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENFILE):
            now = time.monotonic()
            if now - last[0] >= every:
                last[0] = now
                logging.getLogger("speculate.server").warning(
                    "cannot accept connections: %s (new connections wait; raise `ulimit -n` or lower "
                    "--max-connections)", error.strerror)
            return
        loop.default_exception_handler(context)

    return handler


def serve(config: ServerConfig, log_level: str = "info") -> None:
    _check_address(config.host, config.port)  # before the models load: a busy port is one line, at once
    app = build_app(config)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if not config.api_keys and config.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("speculate.server").warning(
            "listening on %s without an API key: anyone who can reach this address can use the server "
            "(set --api-key or $SPECULATE_API_KEY)", config.host)
    from .protocol import connection_cap

    cap = connection_cap(config.max_connections)
    if cap < config.max_connections:
        logging.getLogger("speculate.server").warning(
            "--max-connections %d lowered to %d: this process may open few files (ulimit -n)",
            config.max_connections, cap)
    budget = app.state.scheduler.kv_budget
    logging.getLogger("speculate.server").info(
        "KV cache for running requests: %s (--kv-memory)", f"{budget / 2**30:.2f} GiB" if budget else "no limit")
    uvicorn_server(app, config, host=config.host, port=config.port, log_level=log_level).run()
