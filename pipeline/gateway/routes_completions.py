"""``POST /v1/chat/completions``, ``POST /v1/completions`` (blocking or streamed) and ``GET /v1/models``.

A request is validated, enqueued with ``Client.submit`` and followed in Redis
until its job ends.  A client that goes away (blocking or streaming) cancels
its job; nothing else does (a broker error while following answers an error
and leaves the job running).  A gateway process serves at most
``gateway_limit_concurrency`` of these requests at once: the next is answered
503 with ``Retry-After`` before its job is created.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

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

log = logging.getLogger(__name__)
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
    release = gw.admission.enter()
    try:
        response = await _admitted(gw, request, url, tenant)
    except BaseException:
        release()
        raise
    if isinstance(response, _Streamed):
        response.on_close = release  # the place is held until the stream ends
    else:
        release()
    return response


async def _admitted(gw: Gateway, request: Request, url: str, tenant: Tenant) -> Response:
    sub = split_body(url, await read_json(request, gw.config.max_request_bytes), tenant,
                     gw.settings.default_priority)
    req = await run_in_threadpool(gw.client.validate, url, sub.body)
    check_allowed(sub, req, tenant)
    if not await run_in_threadpool(gw.serves, req.model):
        raise ApiError(503, f"No worker serves the model {req.model!r} right now.", "model",
                       "service_unavailable", RETRY_AFTER_S)
    job_id = await run_in_threadpool(gw.submit, tenant, sub.submit_kwargs())
    shape = ChunkShape(sub.kind, ("chatcmpl-" if sub.kind == "chat" else "cmpl-") + job_id, req.model,
                       int(time.time()), sub.include_usage, sub.continuous_usage)
    if req.stream:
        hold = bool(getattr(req, "tool_parsing", ""))
        return _Streamed(_stream(gw, tenant, job_id, shape, hold), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        return await _blocking(gw, request, tenant, job_id)
    except ClientGone:
        return Response(status_code=499)  # nobody reads it


class _Streamed(StreamingResponse):
    """A streamed response that calls ``on_close`` once it has ended, however it ended."""

    on_close: Callable[[], None] | None = None

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if self.on_close is not None:
                self.on_close()


async def _blocking(gw: Gateway, request: Request, tenant: Tenant, job_id: str) -> Response:
    expire = gw.expiry_tick(job_id)

    async def tick(rec: dict[str, str]) -> None:
        if await request.is_disconnected():
            await run_in_threadpool(gw.cancel_quietly, job_id)
            raise ClientGone
        await expire(rec)

    rec = await gw.follower().wait_done(job_id, tick)
    if rec["state"] != JobState.COMPLETED:
        raise job_error(rec)
    result = await follow.result(gw.aredis(), gw.names, job_id)
    if result is None:
        raise ApiError.not_found("result of job", job_id)
    await run_in_threadpool(gw.stored.record_result, tenant.name, job_id)
    return JSONResponse(result)


async def _stream(gw: Gateway, tenant: Tenant, job_id: str, shape: ChunkShape,
                  hold: bool = False) -> AsyncIterator[bytes]:
    """The job's chunks.  The job is cancelled only if the client goes away first (this generator is cancelled
    or closed); a broker error ends the stream with an error chunk and leaves the job running.  ``hold``
    (a request with tools): the text is held back until the end, then sent in one chunk as content and
    tool calls, since whether it is a call is known only once the answer is complete."""
    tick, follower = gw.expiry_tick(job_id), gw.follower()
    try:
        opening = shape.opening()
        if opening is not None and not shape.continuous_usage:  # else sent with the first usage known
            yield sse(opening)
        sent, prompt_tokens = "", None
        async for text, tokens in follower.counted_deltas(job_id, tick):
            if shape.continuous_usage:
                if prompt_tokens is None:
                    prompt_tokens = int(await gw.aredis().hget(gw.names.job(job_id), "prompt_tokens") or 0)
                    shape.running_usage = _usage(prompt_tokens, 0)
                    if opening is not None:
                        yield sse(shape.opening())
                        opening = None
                shape.running_usage = _usage(prompt_tokens, tokens or 0)
            if not hold:
                sent += text
                yield sse(shape.delta(text))
        rec = await follower.wait_done(job_id, tick)
        result = await follow.result(gw.aredis(), gw.names, job_id) if rec["state"] == JobState.COMPLETED else None
        if result is None:
            yield sse(job_error(rec).body())
        else:
            choice = result["choices"][0]
            shape.running_usage = result.get("usage")
            if opening is not None and shape.continuous_usage:
                yield sse(shape.opening())
            calls = choice.get("message", {}).get("tool_calls")
            text = follow.text_of(result) or ""
            if calls:
                yield sse(shape.tool_calls(text, calls))
            elif text.startswith(sent) and len(text) > len(sent):  # held, or generated before deltas were published
                yield sse(shape.delta(text[len(sent):]))
            yield sse(shape.finish(choice.get("finish_reason"), choice.get("stop_reason")))
            if shape.include_usage:
                yield sse(shape.usage(result["usage"]))
            await run_in_threadpool(gw.stored.record_result, tenant.name, job_id)
    except (asyncio.CancelledError, GeneratorExit):  # the client went away
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(gw.cancel_quietly, job_id)
        raise
    except Exception as e:  # not the client's doing: say so, and let the job run on
        log.warning("following job %s failed: %r", job_id, e)
        yield sse(ApiError(503, f"lost track of the job: {type(e).__name__}; it goes on, see GET /v1/jobs/"
                                f"{job_id}", None, "service_unavailable").body())
    yield SSE_DONE


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# --- models ----------------------------------------------------------------------------------------------
def _model_object(gw: Gateway, name: str) -> dict | None:
    info = lookup_model(gw.r, gw.names, name)
    if info is None:
        return None
    # id: the name asked for, an alias too (each of a model's served names is listed)
    return ModelObject(id=name, created=int(info.updated_at), max_model_len=info.max_model_len).model_dump()


@router.get("/v1/models", response_model=ModelList, responses=errors(401, 429, 503))
def list_models(request: Request, tenant: TenantDep) -> dict:
    gw = gateway(request)
    models = [m for name in gw.served_models() if (m := _model_object(gw, name)) is not None]
    return ModelList(data=models).model_dump()


@router.get("/v1/models/{model:path}", response_model=ModelObject, responses=errors(401, 404, 429, 503))
def get_model(model: str, request: Request, tenant: TenantDep) -> dict:
    found = _model_object(gateway(request), model)
    if found is None:
        raise ApiError(404, f"The model {model!r} does not exist.", "model", "model_not_found")
    return found
