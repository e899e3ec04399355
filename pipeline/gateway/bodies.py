"""Reading request bodies: size-limited (413 beyond the limit), JSON objects only."""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.protocol import validation_to_request_error

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ApiError(400, "the client went away before sending the whole body") from None
    return b"".join(chunks)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than {limit} bytes.", None, "request_too_large")


def parse_json_object(raw: bytes) -> dict:
    """A JSON object from a body; 400 naming what is wrong otherwise."""
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise ApiError(400, "body: not UTF-8", None, "invalid_request_error") from None
    except json.JSONDecodeError as e:
        raise ApiError(400, f"body: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", None,
                       "invalid_request_error") from None
    except RecursionError:
        raise ApiError(400, "body: nested too deeply", None, "invalid_request_error") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise ApiError(400, f"body: {e}", None, "invalid_request_error") from None
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object", None, "invalid_request_error")
    return body


async def read_json(request: Request, limit: int) -> dict:
    return parse_json_object(await read_body(request, limit))


def validate_model(model: type[M], body: dict) -> M:
    """``body`` as ``model``; 400 naming the field otherwise (the same wording as the request schema's)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise ApiError.from_request_error(validation_to_request_error(e)) from None
