"""Reading a request's JSON body with a size limit: an oversized body is a 413 and is never held in memory."""

from __future__ import annotations

import asyncio
import json

from starlette.requests import ClientDisconnect, Request

from .errors import APIError

DRAIN_FACTOR = 8  # an oversized body is read and dropped up to this many limits, so the client sees the 413


async def read_json(request: Request, limit: int, timeout: float = 30.0) -> dict:
    """The body as a JSON object, or an :class:`APIError` (400 malformed, 408 not all there within ``timeout``
    seconds, 413 too large, 415 not JSON).

    ``Content-Type: application/json`` is required: a browser page may POST text/plain to a loopback
    server without a CORS preflight, but not JSON."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json" and not (media_type.startswith("application/") and
                                                  media_type.endswith("+json")):
        raise APIError(415, f"the request body must be JSON, sent with 'Content-Type: application/json' "
                            f"(got {media_type or 'no Content-Type'})", code="unsupported_media_type")
    body = await read_body(request, limit, timeout)
    if not body.strip():
        raise APIError(400, "the request body is empty; expected a JSON object", code="invalid_json")
    try:
        # UTF-8 only (RFC 8259): json.loads would also guess UTF-16 and UTF-32 from bytes.
        data = json.loads(body.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # arrays or objects nested deeper than the parser goes
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return data


async def read_body(request: Request, limit: int, timeout: float = 30.0) -> bytes:
    """The body's bytes, or an :class:`APIError` (400 the client left or sent a bad Content-Length, 408 not all
    there within ``timeout`` seconds, 413 larger than ``limit`` bytes, which is never held in memory). Also the
    Ray front's (serve_ray.py), which hands the bytes to a replica's app."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            declared_size = int(declared)
        except ValueError:
            raise APIError(400, "invalid Content-Length header", code="invalid_request") from None
        if declared_size > limit:
            await _drain(request, limit * DRAIN_FACTOR)
            raise _too_large(limit)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout):  # a body that never comes, or a chunked one gone silent
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    await _drain(request, limit * DRAIN_FACTOR)
                    raise _too_large(limit)
                chunks.append(chunk)
    except ClientDisconnect:
        raise APIError(400, "the client disconnected while sending the body", code="client_disconnected") from None
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout",
                       headers={"Connection": "close"}) from None
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")


async def _drain(request: Request, cap: int) -> None:
    """Read and drop the rest of the body (up to ``cap`` bytes) so that the 413 reaches a client that is
    still sending; past the cap the connection is simply closed after the response."""
    seen = 0
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            if seen > cap:
                return
    except (ClientDisconnect, RuntimeError):  # RuntimeError: the stream was already consumed
        return
