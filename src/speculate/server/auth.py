"""The API key: ``Authorization: Bearer KEY`` on every /v1 route when the server has one."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from .errors import APIError


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raise a 401 unless the request carries ``api_key`` (compared in constant time)."""
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}  # RFC 6750: say which scheme a 401 wants
    if not header:
        raise APIError(401, "missing API key: send 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key",
                       headers=challenge)
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise APIError(401, "incorrect API key provided", code="invalid_api_key", headers=challenge)
