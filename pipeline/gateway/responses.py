"""OpenAI's Responses API on the queue: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items``, ``POST /v1/responses/{id}/cancel``.

A response is a chat completion job (``responses_input``: the same schema,
tenant, priority and limits as ``/v1/chat/completions``), answered as a
Responses object: blocking, streamed as the Responses events, or with
``background: true`` at once (status ``queued``), to be polled.  Stored
responses (``store``, the default) live in Redis (``responses_store``); their
status, output and usage are read from the job each time, so every gateway
process, and one restarted meanwhile, answers the same.  A client that goes
away cancels the job, unless the response runs in the background.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Literal

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from pagedq.config.messages import RequestError
from pagedq.config.names import TERMINAL_STATES, JobState
from pagedq.pipeline.gateway.bodies import read_json
from pagedq.pipeline.gateway.errors import RETRY_AFTER_S, ApiError
from pagedq.pipeline.gateway.keys import Tenant
from pagedq.pipeline.gateway.openapi import SSE_EVENT, errors, json_body
from pagedq.pipeline.gateway.responses_input import (
    ResponsesRequest,
    as_responses_error,
    call_item,
    chat_body,
    message_item,
    output_items,
    output_text,
    parse_items,
    parse_responses_request,
    stored_items,
    usage_of,
)
from pagedq.pipeline.gateway.responses_store import ResponseStore, StoredResponse
from pagedq.pipeline.gateway.shapes import list_page
from pagedq.pipeline.gateway.state import Gateway, TenantDep, gateway
from pagedq.pipeline.protocol import CHAT_URL

log = logging.getLogger(__name__)
router = APIRouter()

CANCEL_WAIT_S = 5.0  # how long POST .../cancel waits for the job to stop before answering
_TERMINAL = {s.value for s in TERMINAL_STATES}
_OBJECT = {"application/json": {"schema": {"type": "object"}}}
_CREATED = {200: {"description": "the response object, or with stream: true its events as Server-Sent Events",
                  "content": {**_OBJECT, "text/event-stream": SSE_EVENT}}, **errors()}


def store_of(gw: Gateway) -> ResponseStore:
    store = getattr(gw, "_responses", None)
    if store is None:
        store = gw._responses = ResponseStore(gw.r, gw.names, gw.keys, gw.settings.result_ttl_s)
    return store


# --- the response object ----------------------------------------------------------------------------------
def _status(rec: dict[str, str] | None, result: dict | None) -> tuple[str, dict | None, dict | None]:
    """(status, error, incomplete_details) of a response whose job has this record."""
    state = (rec or {}).get("state")
    if state is None:
        return "failed", {"code": "expired", "message": "the response's job is no longer kept"}, None
    if state == JobState.QUEUED:
        return "queued", None, None
    if state in (JobState.IN_PROGRESS, JobState.CANCELLING):
        return "in_progress", None, None
    if state == JobState.CANCELLED:
        return "cancelled", None, None
    if state == JobState.COMPLETED and result is not None:
        if result["choices"][0].get("finish_reason") == "length":
            return "incomplete", None, {"reason": "max_output_tokens"}
        return "completed", None, None
    error = json.loads(rec["error"]) if rec.get("error") else {}
    return "failed", {"code": error.get("code") or state or "server_error",
                      "message": error.get("message") or f"the job ended {state}"}, None


def response_object(stored: StoredResponse, rec: dict[str, str] | None, result: dict | None) -> dict:
    """The Responses object of ``stored`` whose job has record ``rec`` and (once completed) ``result``."""
    found, error, incomplete = _status(rec, result)
    req = stored.request
    fmt = (req.get("text") or {}).get("format") or {"type": "text"}
    return {"id": stored.id, "object": "response", "created_at": stored.created_at, "status": found,
            "background": stored.background, "error": error, "incomplete_details": incomplete,
            "instructions": req.get("instructions"), "max_output_tokens": req.get("max_output_tokens"),
            "model": req["model"], "output": output_items(stored.job_id, result) if result else [],
            "parallel_tool_calls": req.get("parallel_tool_calls") is not False,
            "previous_response_id": req.get("previous_response_id"), "reasoning": None,
            "store": req.get("store", True), "temperature": req.get("temperature", 1.0),
            "text": {"format": fmt}, "tool_choice": req.get("tool_choice") or ("auto" if req.get("tools") else "none"),
            "tools": req.get("tools") or [], "top_p": req.get("top_p", 1.0), "truncation": "disabled",
            "usage": usage_of(result.get("usage")) if result else None, "user": req.get("user"),
            "metadata": req.get("metadata") or {}}


def _read_job(gw: Gateway, job_id: str) -> tuple[dict[str, str], dict | None]:
    rec = gw.client.store.get(job_id) or {}
    if rec.get("state") == JobState.QUEUED and rec.get("expires_at"):
        gw.expire_if_due(job_id, rec)
        rec = gw.client.store.get(job_id) or {}
    result = gw.client.store.result(job_id) if rec.get("state") == JobState.COMPLETED else None
    if result is not None and rec.get("tenant") and not rec.get("result_counted"):
        gw.stored.record_result(rec["tenant"], job_id)  # once: the record is flagged, later polls skip this
    return rec, result


def _current(gw: Gateway, stored: StoredResponse) -> dict:
    return response_object(stored, *_read_job(gw, stored.job_id))


# --- creating ---------------------------------------------------------------------------------------------
def _history(gw: Gateway, req: ResponsesRequest, tenant: Tenant) -> list[dict]:
    """The items of the ``previous_response_id`` chain: its history, its input, its output."""
    if req.previous_response_id is None:
        return []
    prev = store_of(gw).load(req.previous_response_id, tenant, "previous_response_id")
    rec, result = _read_job(gw, prev.job_id)
    if result is None:
        state = rec.get("state", "expired")
        raise RequestError(f"previous_response_id: the response {prev.id!r} is {state}, not completed",
                           "previous_response_id")
    return prev.history + prev.input + output_items(prev.job_id, result)


def _prepare(gw: Gateway, body: dict, tenant: Tenant) -> tuple[ResponsesRequest, StoredResponse, dict]:
    """The request, the response to store (not yet stored, no job yet) and the ``Client.submit`` arguments."""
    req, items = parse_responses_request(body)
    history = _history(gw, req, tenant)
    chat = chat_body(req, parse_items(history, "previous_response_id") + items,
                     min(gw.settings.default_priority, tenant.max_priority))
    try:
        validated = gw.client.validate(CHAT_URL, chat)
    except RequestError as e:
        raise as_responses_error(e) from None
    if validated.priority > tenant.max_priority:
        raise RequestError(f"priority: at most {tenant.max_priority} for this API key", "priority")
    echo = req.model_dump(include={"instructions", "max_output_tokens", "temperature", "top_p", "tools",
                                   "parallel_tool_calls", "previous_response_id", "metadata", "user", "store"},
                          exclude_none=True)
    echo["model"] = validated.model
    if req.tool_choice is not None:
        echo["tool_choice"] = req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()
    if req.text is not None and req.text.format is not None:
        echo["text"] = {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
    stored = StoredResponse("resp_" + uuid.uuid4().hex, tenant.name, "", int(time.time()), echo,
                            stored_items(items), history, req.background)
    messages = chat.pop("messages")
    return req, stored, {"messages": messages, "timeout_s": req.timeout_s, **chat}


def _submit(gw: Gateway, tenant: Tenant, req: ResponsesRequest, stored: StoredResponse, kwargs: dict) -> None:
    """Run the job and, with ``store``, keep the response (within the tenant's storage quota)."""
    store = store_of(gw)
    if req.store:
        store.claim(tenant, stored, gw.files.store_cap())
    try:
        stored.job_id = gw.submit(tenant, kwargs)
    except BaseException:
        if req.store:
            store.release(stored.id)
        raise
    if req.store:
        store.write(stored)


@router.post("/v1/responses", openapi_extra=json_body("ResponsesRequest"), responses=_CREATED)
async def create_response(request: Request, tenant: TenantDep) -> Response:
    gw = gateway(request)
    body = await read_json(request, gw.config.max_request_bytes)
    req, stored, kwargs = await run_in_threadpool(_prepare, gw, body, tenant)
    if req.background and not req.stream:
        await run_in_threadpool(_submit, gw, tenant, req, stored, kwargs)
        return JSONResponse(await run_in_threadpool(_current, gw, stored))
    if not await run_in_threadpool(gw.serves, stored.request["model"]):
        raise ApiError(503, f"No worker serves the model {stored.request['model']!r} right now.", "model",
                       "service_unavailable", RETRY_AFTER_S)
    release = gw.admission.enter()
    try:
        await run_in_threadpool(_submit, gw, tenant, req, stored, kwargs)
        if not req.stream:
            return await _blocking(gw, request, stored)
    except BaseException:
        release()
        raise
    if not req.stream:
        release()
    events = _Events(gw, stored, hold=bool(req.tools and req.tool_choice != "none"),
                     cancel_on_close=not req.background)
    return _Streamed(events.run(), release)


class _ClientGone(Exception):
    pass


async def _blocking(gw: Gateway, request: Request, stored: StoredResponse) -> Response:
    job_id, expire = stored.job_id, gw.expiry_tick(stored.job_id)

    async def tick(rec: dict[str, str]) -> None:
        if await request.is_disconnected():
            await run_in_threadpool(gw.cancel_quietly, job_id)
            raise _ClientGone
        await expire(rec)

    try:
        await gw.follower().wait_done(job_id, tick)
    except _ClientGone:
        return Response(status_code=499)  # nobody reads it
    return JSONResponse(await run_in_threadpool(_current, gw, stored))


class _Streamed(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], on_close) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# --- streaming --------------------------------------------------------------------------------------------
class _Events:
    """The Responses stream of one response: ``response.created``, ``response.in_progress``, the message item
    (``output_item.added``, ``content_part.added``, ``output_text.delta``... ``.done``), each function call
    (``function_call_arguments.delta`` / ``.done``), then ``response.completed`` (or ``.incomplete`` /
    ``.failed``).  Events numbered ``starting_after`` or lower are not sent (a resumed stream)."""

    def __init__(self, gw: Gateway, stored: StoredResponse, hold: bool, cancel_on_close: bool,
                 starting_after: int = -1) -> None:
        self.gw, self.stored, self.hold, self.cancel_on_close = gw, stored, hold, cancel_on_close
        self.skip, self.seq, self.sent, self.opened = starting_after, 0, "", False

    def event(self, kind: str, **fields) -> bytes:
        seq, self.seq = self.seq, self.seq + 1
        if seq <= self.skip:
            return b""
        data = json.dumps({"type": kind, "sequence_number": seq, **fields}, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    @property
    def _msg(self) -> dict:
        return {"item_id": f"msg_{self.stored.job_id}", "output_index": 0, "content_index": 0}

    def _open(self) -> list[bytes]:
        self.opened = True
        return [self.event("response.output_item.added", output_index=0,
                           item=message_item(self.stored.job_id, "", "in_progress")),
                self.event("response.content_part.added", **self._msg, part=output_text(""))]

    def _delta(self, text: str) -> list[bytes]:
        self.sent += text
        return [self.event("response.output_text.delta", **self._msg, delta=text, logprobs=[])]

    async def run(self) -> AsyncIterator[bytes]:
        gw, job_id = self.gw, self.stored.job_id
        tick = gw.expiry_tick(job_id)
        try:
            start = response_object(self.stored, {"state": "in_progress"}, None)
            yield self.event("response.created", response=start)
            yield self.event("response.in_progress", response=start)
            async for text in gw.follower().deltas(job_id, tick):
                if not self.hold and text:
                    for chunk in (self._open() if not self.opened else []) + self._delta(text):
                        yield chunk
            await gw.follower().wait_done(job_id, tick)
            rec, result = await run_in_threadpool(_read_job, gw, job_id)
            for chunk in self._finish(rec, result):
                yield chunk
        except (asyncio.CancelledError, GeneratorExit):  # the client went away
            if self.cancel_on_close:
                with anyio.CancelScope(shield=True):
                    await run_in_threadpool(gw.cancel_quietly, job_id)
            raise
        except Exception as e:  # not the client's doing: say so, and let the job run on
            log.warning("following response %s (job %s) failed: %r", self.stored.id, job_id, e)
            error = ApiError(503, f"lost track of the response: {type(e).__name__}; it goes on, see GET "
                                  f"/v1/responses/{self.stored.id}", None, "service_unavailable").body()
            yield self.event("error", code="service_unavailable", message=error["error"]["message"], param=None,
                             error=error["error"])

    def _finish(self, rec: dict[str, str], result: dict | None) -> list[bytes]:
        final = response_object(self.stored, rec, result)
        out: list[bytes] = []
        if result is not None:
            message = result["choices"][0].get("message", {})
            text = message.get("content") or ""
            if text:
                out += self._open() if not self.opened else []
                if text.startswith(self.sent) and len(text) > len(self.sent):
                    out += self._delta(text[len(self.sent):])
                out += [self.event("response.output_text.done", **self._msg, text=text, logprobs=[]),
                        self.event("response.content_part.done", **self._msg, part=output_text(text)),
                        self.event("response.output_item.done", output_index=0,
                                   item=message_item(self.stored.job_id, text))]
            first = 1 if text else 0
            for i, call in enumerate(message.get("tool_calls") or []):
                out += self._call(first + i, call_item(self.stored.job_id, i, call))
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(final["status"],
                                                                                            "response.failed")
        return out + [self.event(kind, response=final)]

    def _call(self, index: int, item: dict) -> list[bytes]:
        ids = {"item_id": item["id"], "output_index": index}
        return [self.event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                   "status": "in_progress"}),
                self.event("response.function_call_arguments.delta", **ids, delta=item["arguments"]),
                self.event("response.function_call_arguments.done", **ids, name=item["name"],
                           arguments=item["arguments"]),
                self.event("response.output_item.done", output_index=index, item=item)]


# --- reading, deleting, cancelling ------------------------------------------------------------------------
@router.get("/v1/responses/{response_id}", responses={200: {"description": "the response object, or with "
                                                                           "stream=true its events",
                                                            "content": {**_OBJECT, "text/event-stream": SSE_EVENT}},
                                                      **errors(400, 401, 404, 429, 503)})
async def get_response(response_id: str, request: Request, tenant: TenantDep, stream: bool = False,
                       starting_after: Annotated[int, Query(ge=0, le=2**31)] | None = None) -> Response:
    gw = gateway(request)
    stored = await run_in_threadpool(store_of(gw).load, response_id, tenant)
    if not stream:
        return JSONResponse(await run_in_threadpool(_current, gw, stored))
    rec = await run_in_threadpool(gw.client.store.get, stored.job_id)
    if rec and rec.get("state") not in _TERMINAL:
        await run_in_threadpool(gw.request_stream, stored.job_id)
    hold = bool(stored.request.get("tools")) and stored.request.get("tool_choice") != "none"
    events = _Events(gw, stored, hold, cancel_on_close=False,
                     starting_after=starting_after if starting_after is not None else -1)
    return _Streamed(events.run(), lambda: None)


@router.get("/v1/responses/{response_id}/input_items", responses={200: {"description": "a list page of items",
                                                                        "content": _OBJECT},
                                                                  **errors(400, 401, 404, 429, 503)})
def input_items(response_id: str, request: Request, tenant: TenantDep, after: str | None = None,
                limit: Annotated[int, Query(ge=1, le=100)] = 20, order: Literal["asc", "desc"] = "desc") -> dict:
    items = store_of(gateway(request)).load(response_id, tenant).input
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [i["id"] for i in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    return list_page(items[:limit], len(items) > limit)


@router.delete("/v1/responses/{response_id}", responses={200: {"description": "deleted", "content": _OBJECT},
                                                         **errors(401, 404, 429, 503)})
def delete_response(response_id: str, request: Request, tenant: TenantDep) -> dict:
    store = store_of(gateway(request))
    store.load(response_id, tenant)
    store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel", responses={200: {"description": "the response object",
                                                                    "content": _OBJECT},
                                                              **errors(400, 401, 404, 429, 503)})
async def cancel_response(response_id: str, request: Request, tenant: TenantDep) -> dict:
    gw = gateway(request)
    stored = await run_in_threadpool(store_of(gw).load, response_id, tenant)
    if not stored.background:
        raise ApiError(400, "Only a background response can be cancelled.", None, "invalid_request_error")
    await run_in_threadpool(gw.cancel_quietly, stored.job_id)
    deadline = time.monotonic() + CANCEL_WAIT_S
    while True:
        current = await run_in_threadpool(_current, gw, stored)
        if current["status"] not in ("queued", "in_progress") or time.monotonic() > deadline:
            return current
        await asyncio.sleep(0.1)
