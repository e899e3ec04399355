"""Following a job from the event loop: waiting for its end, reading its text deltas.

The same Redis keys ``Client.wait`` and ``Client.stream`` read (the job hash,
its done channel, its delta stream ``names.stream(id)`` of
``{"type": "delta", "text": ...}`` entries ended by ``{"type": "end"}``), read
with ``redis.asyncio`` so a waiting request holds no thread.

While following, ``tick`` is awaited about once a second with the job's
record; it may end the job (a deadline passed, the client went away).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import redis.asyncio as aredis

from pagedq.config.names import TERMINAL_STATES, Names
from pagedq.pipeline.client import JobNotFoundError

_TERMINAL = {s.value for s in TERMINAL_STATES}

Tick = Callable[[dict[str, str]], Awaitable[None]]


async def _record(r: aredis.Redis, names: Names, job_id: str) -> dict[str, str]:
    rec = await r.hgetall(names.job(job_id))
    if not rec:
        raise JobNotFoundError(job_id)
    return rec


def _next_look_s(rec: dict[str, str], poll_s: float) -> float:
    """How long to wait before looking again: ``poll_s``, or less if a queued job's deadline comes sooner."""
    expires = rec.get("expires_at")
    if rec.get("state") == "queued" and expires:
        return max(0.01, min(poll_s, float(expires) - time.time() + 0.01))
    return poll_s


async def wait_done(r: aredis.Redis, names: Names, job_id: str, tick: Tick, poll_s: float = 1.0) -> dict[str, str]:
    """The job's record once it is in a terminal state."""
    async with r.pubsub(ignore_subscribe_messages=True) as ps:
        await ps.subscribe(names.done_channel(job_id))
        while True:
            rec = await _record(r, names, job_id)
            if rec.get("state") in _TERMINAL:
                return rec
            await tick(rec)
            await ps.get_message(timeout=_next_look_s(rec, poll_s))


async def deltas(r: aredis.Redis, names: Names, job_id: str, tick: Tick) -> AsyncIterator[str]:
    """The job's text as it is generated, until its stream ends or the job does."""
    key, last, wait_s = names.stream(job_id), "0-0", 1.0
    while True:
        entries = await r.xread({key: last}, count=256, block=int(wait_s * 1000)) or []
        if not entries:
            rec = await _record(r, names, job_id)
            wait_s = _next_look_s(rec, 1.0)
            if rec.get("state") in _TERMINAL:  # ended without (or before) an end entry: read what is left
                for _, items in await r.xread({key: last}, count=100_000) or []:
                    for _, item in items:
                        if item.get("type") == "delta":
                            yield item["text"]
                return
            await tick(rec)
        for _, items in entries:
            for entry_id, item in items:
                last = entry_id
                if item.get("type") == "end":
                    return
                if item.get("type") == "delta":
                    yield item["text"]


async def result(r: aredis.Redis, names: Names, job_id: str) -> dict | None:
    raw = await r.get(names.result(job_id))
    return json.loads(raw) if raw else None


def text_of(result: dict) -> str:
    choice = result["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]
