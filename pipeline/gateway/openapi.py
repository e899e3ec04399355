"""What the OpenAPI schema says about bodies the routes read themselves, and the errors every route may answer.

Request bodies are validated by the one request schema (``pipeline/protocol.py``)
and the gateway's own models, not by FastAPI, so their JSON schemas are added
here from those same pydantic models, with the few fields the gateway reads
itself (``timeout_s``, ``stream_options``).
"""

from __future__ import annotations

import copy

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from pagedq.pipeline.gateway.batches import BatchCreate
from pagedq.pipeline.gateway.responses_input import ResponsesRequest
from pagedq.pipeline.gateway.shapes import ErrorResponse
from pagedq.pipeline.protocol import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"

_GATEWAY_FIELDS = {
    "timeout_s": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "null"}],
                  "description": "a job not started within this many seconds ends expired (HTTP 429)"},
    "stream_options": {"anyOf": [{"type": "object", "additionalProperties": False,
                                  "properties": {"include_usage": {"type": "boolean"},
                                                 "continuous_usage_stats": {"type": "boolean"}}},
                                 {"type": "null"}],
                       "description": "with stream: true; include_usage adds a last chunk with the usage; "
                                      "continuous_usage_stats (vLLM's) with it puts the usage so far on every "
                                      "chunk"},
}

ERROR_STATUSES = {400: "invalid request (the message names the field)", 401: "missing or unknown API key",
                  404: "no such object for this API key, or unknown model", 413: "request too large",
                  429: "rate limit, tenant's queued-job limit or queue full (see Retry-After)",
                  503: "no worker serves the model, or the broker is unreachable"}


# One Server-Sent Event (``data: <JSON or [DONE]>``): the schema of each event of a text/event-stream response.
SSE_EVENT = {"schema": {"type": "object", "required": ["data"],
                        "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}}


def errors(*statuses: int) -> dict[int | str, dict]:
    """The ``responses`` entries of a route's possible errors (all of them if none are named)."""
    return {s: {"model": ErrorResponse, "description": ERROR_STATUSES.get(s, "error")}
            for s in statuses or ERROR_STATUSES}


def _schema_of(model: type[BaseModel], extra: dict) -> tuple[dict, dict]:
    """(the model's JSON schema with ``extra`` properties, the schemas it refers to)."""
    schema = copy.deepcopy(model.model_json_schema(ref_template=_REF))
    defs = schema.pop("$defs", {})
    schema["properties"].update(extra)
    return schema, defs


def request_schemas() -> dict[str, dict]:
    chat, chat_defs = _schema_of(ChatCompletionRequest, _GATEWAY_FIELDS)
    text, text_defs = _schema_of(CompletionRequest, _GATEWAY_FIELDS)
    batch, batch_defs = _schema_of(BatchCreate, {})
    job = {"title": "JobRequest", "description": "a chat (messages) or text (prompt) request to run as a job",
           "oneOf": [{"$ref": _REF.format(model="ChatCompletionRequest")},
                     {"$ref": _REF.format(model="CompletionRequest")}]}
    file_upload = {"title": "FileUpload", "type": "object", "required": ["file", "purpose"],
                   "additionalProperties": False,
                   "properties": {"file": {"type": "string", "format": "binary"},
                                  "purpose": {"type": "string", "enum": ["batch"]}}}
    responses, responses_defs = _schema_of(ResponsesRequest, {})
    return {**chat_defs, **text_defs, **batch_defs, **responses_defs, "ChatCompletionRequest": chat,
            "CompletionRequest": text, "JobRequest": job, "BatchCreate": batch, "FileUpload": file_upload,
            "ResponsesRequest": responses}


def json_body(name: str) -> dict:
    """``openapi_extra`` of a route whose JSON body has the component schema ``name``."""
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": _REF.format(model=name)}}}}}


def form_body(name: str) -> dict:
    return {"requestBody": {"required": True,
                            "content": {"multipart/form-data": {"schema": {"$ref": _REF.format(model=name)}}}}}


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` include the request schemas above."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(request_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
