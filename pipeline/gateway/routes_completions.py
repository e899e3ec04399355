"""``POST /v1/chat/completions``, ``POST /v1/completions`` (blocking or streamed) and ``GET /v1/models``.

A request is validated, enqueued with ``Client.submit`` and followed in Redis
until its job ends.  A client that goes away (blocking or streaming) cancels
its job.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from pagedq.config.names import JobState
from pagedq.pipeline.gateway import follow
from pagedq.pipeline.gateway.bodies import read_json
from pagedq.pipeline.gateway.errors import RETRY_AFTER_S, ApiError
from pagedq.pipeline.gateway.keys import Tenant
from pagedq.pipeline.gateway.openapi import SSE_EVENT, errors, json_body
from pagedq.pipeline.gateway.requests import check_allowed, split_body
from pagedq.pipeline.gateway.shapes import SSE_DONE, ChunkShape, ModelList, ModelObject, sse
from pagedq.pipeline.gateway.state import Gateway, TenantDep, gateway
from pagedq.pipeline.protocol import CHAT_URL, COMPLETIONS_URL, RequestError
from pagedq.store.registry import lookup_model

router = APIRouter()

_COMPLETION_RESPONSES = {200: {"description": "the completion object, or with stream: true its chunks as "
                                              "Server-Sent Events ending in `data: [DONE]`",
                               "content": {"application/json": {"schema": {"type": "object"}},
                                           "text/event-stream": SSE_EVENT}},
                         409: {"description": "the job was cancelled meanwhile"}, **errors()}


class ClientGone(Exception):
    pass


def job_error(rec: dict[str, str]) -> ApiError:
    """The HTTP error for a job that ended other than completed."""
    if rec.get("state") == JobState.CANCELLED:
        return ApiError(409, "The job was cancelled.", None, "cancelled")
    error = json.loads(rec["error"]) if rec.get("error") else {"message": f"the job ended {rec.get('state')}",
                                                                "code": rec.get("state")}
    return ApiError.from_request_error(RequestError.from_dict(error))


@router.post("/v1/chat/completions", openapi_extra=json_body("ChatCompletionRequest"),
             responses=_COMPLETION_RESPONSES)
async def chat_completions(request: Request, tenant: TenantDep) -> Response:
    return await _complete(request, CHAT_URL, tenant)


@router.post("/v1/completions", openapi_extra=json_body("CompletionRequest"), responses=_COMPLETION_RESPONSES)
async def completions(request: Request, tenant: TenantDep) -> Response:
    return await _complete(request, COMPLETIONS_URL, tenant)


async def _complete(request: Request, url: str, tenant: Tenant) -> Response:
    gw = gateway(request)
    sub = split_body(url, await read_json(request, gw.config.max_request_bytes), tenant,
                     gw.settings.default_priority)
    req = await run_in_threadpool(gw.client.validate, url, sub.body)
    check_allowed(sub, req, tenant)
    if not await run_in_threadpool(gw.serves, req.model):
        raise ApiError(503, f"No worker serves the model {req.model!r} right now.", "model",
                       "service_unavailable", RETRY_AFTER_S)
    job_id = await run_in_threadpool(gw.submit, tenant, sub.submit_kwargs())
    shape = ChunkShape(sub.kind, ("chatcmpl-" if sub.kind == "chat" else "cmpl-") + job_id, req.model,
                       int(time.time()), sub.include_usage)
    if req.stream:
        return StreamingResponse(_stream(gw, job_id, shape), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return await _blocking(gw, request, job_id)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it


async def _blocking(gw: Gateway, request: Request, job_id: str) -> Response:
    async def tick(rec: dict[str, str]) -> None:
        if await request.is_disconnected():
            await run_in_threadpool(gw.cancel_quietly, job_id)
            raise ClientGone
        await run_in_threadpool(gw.expire_if_due, job_id, rec)

    r = gw.aredis()
    rec = await follow.wait_done(r, gw.names, job_id, tick)
    if rec["state"] != JobState.COMPLETED:
        raise job_error(rec)
    result = await follow.result(r, gw.names, job_id)
    if result is None:
        raise ApiError.not_found("result of job", job_id)
    return JSONResponse(result)


async def _stream(gw: Gateway, job_id: str, shape: ChunkShape) -> AsyncIterator[bytes]:
    """The job's chunks; if the client goes away first (this generator is cancelled), the job is cancelled."""
    async def tick(rec: dict[str, str]) -> None:
        await run_in_threadpool(gw.expire_if_due, job_id, rec)

    r, finished = gw.aredis(), False
    try:
        opening = shape.opening()
        if opening is not None:
            yield sse(opening)
        sent = ""
        async for text in follow.deltas(r, gw.names, job_id, tick):
            sent += text
            yield sse(shape.delta(text))
        rec = await follow.wait_done(r, gw.names, job_id, tick)
        result = await follow.result(r, gw.names, job_id) if rec["state"] == JobState.COMPLETED else None
        if result is None:
            yield sse(job_error(rec).body())
        else:
            text = follow.text_of(result)
            if text.startswith(sent) and len(text) > len(sent):  # generated before deltas were published
                yield sse(shape.delta(text[len(sent):]))
            choice = result["choices"][0]
            yield sse(shape.finish(choice.get("finish_reason"), choice.get("stop_reason")))
            if shape.include_usage:
                yield sse(shape.usage(result["usage"]))
        yield SSE_DONE
        finished = True
    finally:
        if not finished:
            with anyio.CancelScope(shield=True):
                await run_in_threadpool(gw.cancel_quietly, job_id)


# --- models ----------------------------------------------------------------------------------------------
def _model_object(gw: Gateway, name: str) -> dict | None:
    info = lookup_model(gw.r, gw.names, name)
    if info is None:
        return None
    return ModelObject(id=info.name, created=int(info.updated_at), max_model_len=info.max_model_len).model_dump()


@router.get("/v1/models", response_model=ModelList, responses=errors(401, 429, 503))
def list_models(request: Request, tenant: TenantDep) -> dict:
    gw = gateway(request)
    models = [m for name in gw.client.served_models() if (m := _model_object(gw, name)) is not None]
    return ModelList(data=models).model_dump()


@router.get("/v1/models/{model:path}", response_model=ModelObject, responses=errors(401, 404, 429, 503))
def get_model(model: str, request: Request, tenant: TenantDep) -> dict:
    found = _model_object(gateway(request), model)
    if found is None:
        raise ApiError(404, f"The model {model!r} does not exist.", "model", "model_not_found")
    return found
