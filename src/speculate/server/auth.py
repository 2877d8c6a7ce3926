"""API keys: ``Authorization: Bearer KEY`` on every /v1 route when the server has any, and the tenant a key names."""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import Request

from .errors import APIError


def check_api_key(request: Request, api_keys: tuple[str, ...]) -> str:
    """The tenant of the key the request carries (:func:`tenant`); '' on a server without keys. A 401 unless it
    carries one of ``api_keys``. Every key is compared, each in constant time, so the time taken does not say which
    key (or how much of one) matched."""
    if not api_keys:
        return ""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}  # RFC 6750: say which scheme a 401 wants
    if not header:
        raise APIError(401, "missing API key: send 'Authorization: Bearer YOUR_KEY'", code="invalid_api_key",
                       headers=challenge)
    given, matched = token.strip().encode(), None
    for key in api_keys:
        if hmac.compare_digest(given, key.encode()):
            matched = key
    if scheme.lower() != "bearer" or matched is None:
        raise APIError(401, "incorrect API key provided", code="invalid_api_key", headers=challenge)
    return tenant(matched)


def tenant(key: str) -> str:
    """The tenant an API key names: a digest of it, so that what is kept per tenant (the ``suffix`` drafter's index of
    served answers) is keyed without holding the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
