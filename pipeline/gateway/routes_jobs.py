"""Jobs over HTTP: ``POST /v1/jobs`` (202), ``GET /v1/jobs/{id}``, ``DELETE /v1/jobs/{id}``, and
``GET /v1/jobs/{id}/events`` (its text as Server-Sent Events).

A job runs whether or not anyone follows it: closing its event stream does
not cancel it (DELETE does).  Any job the tenant created is visible here,
including those of its chat/completion requests (id without the
``chatcmpl-`` / ``cmpl-`` prefix) and batches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from pagedq.config.names import JobState
from pagedq.pipeline.client import JobNotFoundError
from pagedq.pipeline.gateway import follow
from pagedq.pipeline.gateway.bodies import read_json
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.keys import Tenant
from pagedq.pipeline.gateway.openapi import SSE_EVENT, errors, json_body
from pagedq.pipeline.gateway.requests import check_allowed, split_body
from pagedq.pipeline.gateway.shapes import SSE_DONE, JobObject, job_object, sse
from pagedq.pipeline.gateway.state import Gateway, TenantDep, gateway
from pagedq.pipeline.protocol import CHAT_URL, COMPLETIONS_URL

router = APIRouter()


def _job(gw: Gateway, job_id: str, tenant: Tenant) -> dict:
    status, rec = gw.owned_job(job_id, tenant)
    if status.state == JobState.QUEUED and rec.get("expires_at"):
        gw.expire_if_due(job_id, rec)
        status, _ = gw.owned_job(job_id, tenant)
    result = gw.client.store.result(job_id) if status.state == JobState.COMPLETED else None
    return job_object(status, result)


@router.post("/v1/jobs", status_code=202, openapi_extra=json_body("JobRequest"),
             responses={202: {"model": JobObject, "description": "the job, queued"}, **errors()})
async def create_job(request: Request, tenant: TenantDep) -> JSONResponse:
    gw = gateway(request)
    body = await read_json(request, gw.config.max_request_bytes)
    url = CHAT_URL if "messages" in body else COMPLETIONS_URL
    sub = split_body(url, body, tenant, gw.settings.default_priority)
    req = await run_in_threadpool(gw.client.validate, url, sub.body)
    check_allowed(sub, req, tenant)
    job_id = await run_in_threadpool(gw.submit, tenant, sub.submit_kwargs())
    return JSONResponse(await run_in_threadpool(_job, gw, job_id, tenant), status_code=202)


@router.get("/v1/jobs/{job_id}", response_model=JobObject, responses=errors(401, 404, 429, 503))
def get_job(job_id: str, request: Request, tenant: TenantDep) -> dict:
    return _job(gateway(request), job_id, tenant)


@router.delete("/v1/jobs/{job_id}", response_model=JobObject, responses=errors(401, 404, 429, 503))
def cancel_job(job_id: str, request: Request, tenant: TenantDep) -> dict:
    gw = gateway(request)
    gw.owned_job(job_id, tenant)
    try:
        gw.client.cancel(job_id)
    except JobNotFoundError:
        raise ApiError.not_found("job", job_id) from None
    return _job(gw, job_id, tenant)


@router.get("/v1/jobs/{job_id}/events", responses={
    200: {"description": 'Server-Sent Events: `{"type": "delta", "text": ...}` as the text is generated, then '
                         '`{"type": "end", "job": <job>}` and `[DONE]`',
          "content": {"text/event-stream": SSE_EVENT}},
    **errors(401, 404, 429, 503)})
async def job_events(job_id: str, request: Request, tenant: TenantDep) -> StreamingResponse:
    gw = gateway(request)
    _, rec = await run_in_threadpool(gw.owned_job, job_id, tenant)
    if rec.get("stream") != "1":
        await run_in_threadpool(gw.request_stream, job_id)
    return StreamingResponse(_events(gw, job_id, tenant), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(gw: Gateway, job_id: str, tenant: Tenant) -> AsyncIterator[bytes]:
    tick, follower, sent = gw.expiry_tick(job_id), gw.follower(), ""
    async for text in follower.deltas(job_id, tick):
        sent += text
        yield sse({"type": "delta", "text": text})
    await follower.wait_done(job_id, tick)
    job = await run_in_threadpool(_job, gw, job_id, tenant)
    if job["result"] is not None:
        text = follow.text_of(job["result"])
        if text.startswith(sent) and len(text) > len(sent):  # generated before deltas were published
            yield sse({"type": "delta", "text": text[len(sent):]})
    yield sse({"type": "end", "job": job})
    yield SSE_DONE


