"""ASGI middleware against DNS rebinding and cross-site requests, run before anything else.

DNS rebinding: a page on ``attacker.example`` makes its name resolve to 127.0.0.1 and then talks to a
loopback server as a same-origin page — the browser sends ``Host: attacker.example:PORT``. A server bound
to loopback therefore answers only requests whose Host is a loopback name or address (or one given with
``--allowed-host``). Cross-site: a request with an ``Origin`` header from any other host is refused on a
server without an API key (with a key, the key is what protects it).
"""

from __future__ import annotations

import ipaddress
import json
from urllib.parse import urlsplit

from .errors import error_body

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


def is_loopback(host: str) -> bool:
    """A loopback name or address (127.0.0.0/8, ::1), brackets and a trailing dot allowed."""
    host = host.strip("[]").rstrip(".").lower()
    if host in LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def hostname(authority: str) -> str:
    """The host of a Host header value or an Origin URL's authority, without port or brackets."""
    if authority.startswith("["):
        return authority[1: authority.find("]")] if "]" in authority else authority
    return authority.rsplit(":", 1)[0] if authority.count(":") == 1 else authority


class HostGuard:
    """Refuse (400) a Host that is not allowed, and (403) a foreign Origin on a keyless server."""

    def __init__(self, app, bound_host: str, allowed_hosts: tuple[str, ...] = (), keyless: bool = True):
        self.app = app
        self.loopback_only = is_loopback(bound_host)
        self.allowed = {h.lower().rstrip(".") for h in allowed_hosts}
        self.keyless = keyless

    def allowed_host(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        if host in self.allowed or is_loopback(host):
            return True
        return not self.loopback_only and not self.allowed  # an open bind with no list: any Host

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        host = hostname(headers.get("host", ""))
        if not host or not self.allowed_host(host):
            return await _refuse(send, 400, "the Host header names a host this server does not serve (set "
                                            "--allowed-host to allow it)", "invalid_host")
        origin = headers.get("origin")
        if origin is not None and self.keyless:
            # Same origin, a loopback page or an allowed host; "null" (sandboxed frames, file:// pages) is not.
            origin_host = hostname(urlsplit(origin).netloc).lower().rstrip(".")
            if not origin_host or not (origin_host == host.lower().rstrip(".") or is_loopback(origin_host)
                                       or origin_host in self.allowed):
                return await _refuse(send, 403, "cross-origin requests are refused", "forbidden_origin")
        return await self.app(scope, receive, send)


async def _refuse(send, status: int, message: str, code: str) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
