"""uvicorn's HTTP/1.1 protocol (h11) with the limits it lacks: a deadline for a request's headers, a cap on
open connections, and no request whose body is framed twice.

Why: uvicorn closes an idle keep-alive connection after a response (``timeout_keep_alive``), but a connection
that never sends a request, sends half a request line, or trickles headers at a byte every few seconds is held
forever (seen: 300 such sockets under ``ulimit -n 256`` made /health time out and the accept loop fail with
"Too many open files"). Here every connection must complete its request headers within ``header_timeout``
seconds of opening (and of its previous response); past ``max_connections`` (kept below the open-file limit) the
connection idle the longest is closed, or the new one where none is idle; and past ``per_client`` connections
from one address, that address's connection idle the longest (or the new one), so that one client cannot take the
whole cap from the others.
A body that stops arriving is the request handler's to time out (server/body.py).
"""

from __future__ import annotations

from functools import partial

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


FD_RESERVE = 64  # open files the process needs besides connections: the model's files, the kernels, logs, pipes


def connection_cap(max_connections: int) -> int:
    """``max_connections``, lowered to stay below the process's open-file limit (less :data:`FD_RESERVE`): past
    that limit the accept loop itself fails ("Too many open files") instead of the cap closing connections."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return max_connections
    if soft == resource.RLIM_INFINITY:
        return max_connections
    return max(1, min(max_connections, soft - FD_RESERVE))


def guarded_protocol(header_timeout: float, max_connections: int, per_client: int = 0) -> type[H11Protocol]:
    """The protocol class to hand uvicorn (``Config(http=...)``), with these limits (``max_connections`` as
    :func:`connection_cap` lowers it; ``per_client`` 0: no limit per address)."""
    cap = connection_cap(max_connections)

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.conn.next_event = partial(_framed_once, self.conn.next_event)

        def connection_made(self, transport) -> None:
            self.idle_since = self.loop.time()  # (before uvicorn counts it among the connections _idle reads)
            super().connection_made(transport)
            self._headers_timer = None
            peer = transport.get_extra_info("peername")
            self.client_host = peer[0] if isinstance(peer, (tuple, list)) and peer else None
            others = [c for c in self.connections if c is not self]  # (this one is counted already)
            own = [c for c in others if getattr(c, "client_host", None) == self.client_host]
            # Past a limit, the connection that has waited longest without a request goes, not the new one: a
            # client holding idle sockets (reopening any that drop) locked everyone out, /health too. One address
            # first: its own idle connections, so it cannot crowd the others out of the global cap.
            for pool, limit in ((own, per_client), (others, cap)):
                if limit and len(pool) + 1 > limit:  # (+ 1: this connection)
                    idle = [c for c in pool if _idle(c)]
                    if not idle:
                        transport.close()
                        return
                    oldest = min(idle, key=lambda c: c.idle_since)
                    oldest.transport.close()
                    others.remove(oldest)
                    if oldest in own:
                        own.remove(oldest)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._headers_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _disarm(self) -> None:
            if getattr(self, "_headers_timer", None) is not None:
                self._headers_timer.cancel()
                self._headers_timer = None

        def _headers_late(self) -> None:
            self._headers_timer = None
            # Still waiting for (the rest of) a request line and headers: drop the connection.
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # the headers are complete: the handler owns the body
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.idle_since = self.loop.time()
            if not self.transport.is_closing():
                self._arm()  # the next request's headers get the same deadline

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11Protocol


def _idle(protocol) -> bool:
    """Whether a connection is between requests (or before its first): nothing of a request read, no response
    under way."""
    conn = protocol.conn
    return conn.their_state is h11.IDLE and conn.our_state is h11.IDLE and not protocol.transport.is_closing()


def _framed_once(next_event):
    """h11's next event, refusing a request that frames its body twice (Content-Length and Transfer-Encoding).

    h11 lets Transfer-Encoding win and keeps the connection open, so bytes that a proxy in front took for the
    body by Content-Length were read here as a second, smuggled request. RFC 9112 §6.3: such a message must be
    treated as an error and the connection closed; raised as h11's protocol error, it gets uvicorn's 400 with
    ``Connection: close``, as any malformed request does."""
    event = next_event()
    if isinstance(event, h11.Request):
        names = {name.lower() for name, _ in event.headers}
        if b"content-length" in names and b"transfer-encoding" in names:
            raise h11.RemoteProtocolError("both Content-Length and Transfer-Encoding: the body's length is ambiguous")
    return event
