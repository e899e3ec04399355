"""Errors the OpenAI way: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every ``RequestError`` (the one error type of the schema and the queue) maps to
a status here; anything else that escapes a route is answered in the same
shape, so no response is ever an HTML page or a bare traceback.
"""

from __future__ import annotations

import logging

import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedq.pipeline.client import JobNotFoundError
from pagedq.pipeline.protocol import RequestError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 2  # what a 429 / 503 without a better estimate tells the client to wait

# RequestError.code -> HTTP status; every other code is a 400.
_STATUS_OF_CODE = {"queue_full": 429, "expired": 429, "model_not_found": 404, "not_found": 404,
                   "server_error": 503}

_TYPE_OF_STATUS = {401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
                   429: "rate_limit_error", 503: "server_error", 500: "server_error"}


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code
        self.retry_after = retry_after

    @classmethod
    def from_request_error(cls, e: RequestError) -> ApiError:
        status = _STATUS_OF_CODE.get(e.code, 400)
        return cls(status, str(e), e.param, e.code, RETRY_AFTER_S if status in (429, 503) else None)

    @classmethod
    def not_found(cls, what: str, ident: str, param: str | None = None) -> ApiError:
        return cls(404, f"No {what} found with id {ident!r}.", param, "not_found")

    def body(self) -> dict:
        return error_body(self.status, str(self), self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(int(self.retry_after + 0.999))} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPE_OF_STATUS.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return ApiError.from_request_error(e).response()

    @app.exception_handler(JobNotFoundError)
    async def _job_not_found(_: Request, e: JobNotFoundError) -> JSONResponse:
        return ApiError.not_found("job", str(e.args[0]) if e.args else "?").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        field = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header"))
        return ApiError(400, f"{field or 'request'}: {err.get('msg')}", field or None,
                        "invalid_request_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return ApiError(e.status_code, str(e.detail), None, code).response()

    app.add_middleware(CatchAll)


class CatchAll:
    """ASGI middleware: an exception no route handled is answered in OpenAI's shape (503 when the broker is
    unreachable, else 500 and logged), and not raised further, so no server prints a bare 500 page."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:  # a streamed body broke off; nothing more can be said to the client
                log.exception("%s %s failed while streaming", scope.get("method"), scope.get("path"))
                return
            await unexpected_error(scope, e).response()(scope, receive, send)


def unexpected_error(scope, e: Exception) -> ApiError:
    where = f"{scope.get('method')} {scope.get('path')}"
    if isinstance(e, (redis.RedisError, OperationalError, ConnectionError)):
        log.warning("%s: the broker is unreachable: %s", where, e)
        return ApiError(503, f"the broker is unreachable: {type(e).__name__}", None, "service_unavailable",
                        RETRY_AFTER_S)
    log.exception("%s failed", where)
    return ApiError(500, f"internal error: {type(e).__name__}", None, "server_error")
