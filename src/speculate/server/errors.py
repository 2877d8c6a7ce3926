"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure.

A user's mistake gets a 4xx, never a 500: FastAPI's own validation errors (422 by default) become 400,
Starlette's 404/405 get the same shape, and :class:`~speculate.errors.SpeculateError` from the engine
is a 400 (:func:`refused`). Only a failure of the server itself is a 5xx: a 500, or a 507 when its storage fails.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import SpeculateError, StorageError

log = logging.getLogger("speculate.server")

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
         415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answered as an OpenAI error object with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def refused(error: SpeculateError, message: str | None = None, param: str | None = None) -> APIError:
    """What the client is told of a SpeculateError: a 400 (``message``, default the error's; a setting it can fix),
    or for the server's own storage failing (StorageError: a full disk while it wrote a profile or a conversion)
    a 507, a server fault, logged."""
    if isinstance(error, StorageError):
        log.error("storage: %s", error)
        return APIError(507, str(error), None, "insufficient_storage")
    return APIError(400, message if message is not None else str(error), param, "invalid_value")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "invalid_request_error" if status < 500
                                                                  else "server_error"),
                      "param": param, "code": code}}


def validation_error(errors, data=None) -> APIError:
    """The first pydantic error as a 400: ``param`` is the dotted path into the request body."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":  # FastAPI prefixes the body's fields
        loc = loc[1:]
    path = _path_in(data, loc)
    param = ".".join(str(p) for p in path) or None
    msg = first.get("msg", "invalid value")
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return APIError(400, f"{param}: {msg}" if param else msg, param, code)


def _path_in(data, loc: list) -> list:
    """The part of a pydantic location that addresses the input (drops union variant tags like 'str')."""
    if data is None:
        return loc
    path, cur = [], data
    for key in loc:
        if isinstance(cur, dict) and isinstance(key, str):
            path.append(key)
            cur = cur.get(key)
        elif isinstance(cur, list) and isinstance(key, int) and 0 <= key < len(cur):
            path.append(key)
            cur = cur[key]
        else:
            break
    return path


def install_error_handlers(app: FastAPI, authorize=None) -> None:
    """``authorize(request)``: raises the 401 for a client without the key (server/auth.py); an unknown /v1 path
    answers it before its 404, so that no client without the key learns the route map."""
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError):
        return validation_error(exc.errors()).response()

    @app.exception_handler(ValidationError)
    async def _pydantic_validation(request: Request, exc: ValidationError):
        return validation_error(exc.errors()).response()

    @app.exception_handler(SpeculateError)
    async def _speculate_error(request: Request, exc: SpeculateError):
        return APIError(400, str(exc), code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if authorize is not None and request.url.path.startswith("/v1/"):
            try:
                authorize(request)
            except APIError as refused:
                return refused.response()
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, message, code=code, headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error while handling %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {type(exc).__name__}: {exc}", code="internal_error").response()
