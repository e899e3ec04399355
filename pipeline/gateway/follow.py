"""Following jobs from the event loop: waiting for their end, reading their text deltas.

The same Redis keys ``Client.wait`` and ``Client.stream`` read (the job hash,
its done channel, its delta stream ``names.stream(id)`` of
``{"type": "delta", "text": ...}`` entries ended by ``{"type": "end"}``), read
with ``redis.asyncio`` so a waiting request holds no thread.

One ``Follower`` per gateway process serves every waiting request over two
connections, however many requests wait:

- one pub/sub connection, subscribed once to the pattern of every job's done
  channel, wakes the waiters of the job that ended;
- one stream reader: a single ``XREAD BLOCK`` over the delta streams of every
  followed job hands each follower the entries after the last it got.  A new
  follower wakes it at once through the process's own wake stream
  (``names.follow_wake``), so its stream joins the read without waiting for
  the block to time out.

Everything else (a job's record, its result) is a short call on the pooled
connections.  Neither shared connection is trusted alone: a waiter also reads
its job's record about once a second (``poll_s``), so a publish missed while
the pub/sub reconnects still ends its wait, and a job that ended without an
end entry still ends its stream.

While following, ``tick`` is awaited about once a second with the job's
record; it may end the job (a deadline passed, the client went away).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field

import redis.asyncio as aredis
from redis.exceptions import RedisError

from pagedq.config.names import TERMINAL_STATES, Names
from pagedq.pipeline.client import JobNotFoundError

log = logging.getLogger(__name__)

_TERMINAL = {s.value for s in TERMINAL_STATES}
BLOCK_MS = 1000  # the shared XREAD's block; below the connections' socket timeout
RECONNECT_S = 1.0  # pause before a shared connection that failed is tried again
WAKE_TTL_MS = 60_000  # the wake stream outlives a process that died without deleting it by this much

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


def _entry_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _tokens(item: dict[str, str]) -> int | None:
    return int(item["tokens"]) if item.get("tokens", "").isdigit() else None


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` was set within ``timeout_s``."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
        return True
    except TimeoutError:
        return False


@dataclass(eq=False)
class _StreamFollower:
    """One reader of one delta stream.  Invariant: ``last`` is the id of the last entry put in ``entries`` (or
    the position it started from), so the shared reader never hands it an entry twice."""

    key: str
    last: str = "0-0"
    entries: list[tuple[str, dict[str, str]]] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def give(self, items: list[tuple[str, dict[str, str]]]) -> None:
        after = _entry_id(self.last)
        new = [(i, item) for i, item in items if _entry_id(i) > after]
        if new:
            self.entries.extend(new)
            self.last = new[-1][0]
            self.ready.set()


class Follower:
    """Every waiting request of one gateway process (one event loop), over one pub/sub and one stream reader.

    Its two tasks start with the first wait and run until ``close``; an error on either is logged and the
    connection tried again after ``RECONNECT_S``, while the waiters go on reading their records."""

    def __init__(self, r: aredis.Redis, names: Names, poll_s: float = 1.0) -> None:
        self.r, self.names, self.poll_s = r, names, poll_s
        self._done: dict[str, set[asyncio.Event]] = {}  # job id -> its waiters' events
        self._streams: dict[str, set[_StreamFollower]] = {}  # stream key -> its followers
        self._wake_key = names.follow_wake(uuid.uuid4().hex)
        self._wake_last = "0-0"
        self._wake_sent = False  # a wake is on its way and the reader has not yet rebuilt its read since
        self._tasks: set[asyncio.Task] = set()
        self._started = False

    @property
    def waiting(self) -> int:
        """Waiters and stream followers now served (for tests and logs)."""
        return sum(map(len, self._done.values())) + sum(map(len, self._streams.values()))

    def _spawn(self, coro: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self._spawn(self._listen())
            self._spawn(self._read())

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._started:
            try:
                await self.r.delete(self._wake_key)
            except RedisError:
                pass  # it expires

    # --- the job's end ----------------------------------------------------------------------------------
    async def wait_done(self, job_id: str, tick: Tick) -> dict[str, str]:
        """The job's record once it is in a terminal state."""
        self._start()
        event = asyncio.Event()
        self._done.setdefault(job_id, set()).add(event)
        try:
            while True:
                event.clear()  # before reading the record: an end published from now on is not missed
                rec = await _record(self.r, self.names, job_id)
                if rec.get("state") in _TERMINAL:
                    return rec
                await tick(rec)
                await _wait(event, _next_look_s(rec, self.poll_s))
        finally:
            waiters = self._done.get(job_id)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._done[job_id]

    async def _listen(self) -> None:
        """Wake the waiters of each job whose done channel hears its end."""
        pattern = _glob_escape(self.names.done_channel("")) + "*"
        skip = len(self.names.done_channel(""))
        while True:
            try:
                async with self.r.pubsub(ignore_subscribe_messages=True) as ps:
                    await ps.psubscribe(pattern)
                    while True:
                        message = await ps.get_message(ignore_subscribe_messages=True, timeout=1.0)
                        if message is not None:
                            for event in self._done.get(message["channel"][skip:], ()):
                                event.set()
            except Exception as e:  # the broker, or anything else: waiters poll meanwhile
                log.warning("the gateway's done-channel subscription failed (%s); again in %.0f s", e, RECONNECT_S)
                for waiters in list(self._done.values()):  # each reads its record now
                    for event in waiters:
                        event.set()
                await asyncio.sleep(RECONNECT_S)

    # --- the job's text ---------------------------------------------------------------------------------
    async def deltas(self, job_id: str, tick: Tick) -> AsyncIterator[str]:
        """The job's text as it is generated, until its stream ends or the job does."""
        async with aclosing(self.counted_deltas(job_id, tick)) as counted:
            async for text, _ in counted:
                yield text

    async def counted_deltas(self, job_id: str, tick: Tick) -> AsyncIterator[tuple[str, int | None]]:
        """``deltas`` with the number of tokens generated so far at each (None from a writer that does not say)."""
        self._start()
        follower = self._follow(self.names.stream(job_id))
        try:
            wait_s = self.poll_s
            while True:
                if not follower.entries:
                    follower.ready.clear()
                    if not await _wait(follower.ready, wait_s):
                        rec = await _record(self.r, self.names, job_id)
                        wait_s = _next_look_s(rec, self.poll_s)
                        if rec.get("state") in _TERMINAL:  # ended without (or before) an end entry
                            for _, item in await self._rest(follower):
                                if item.get("type") == "delta":
                                    yield item["text"], _tokens(item)
                            return
                        await tick(rec)
                        continue
                entries, follower.entries = follower.entries, []
                for _, item in entries:
                    if item.get("type") == "end":
                        return
                    if item.get("type") == "delta":
                        yield item["text"], _tokens(item)
        finally:
            self._unfollow(follower)

    def _follow(self, key: str) -> _StreamFollower:
        follower = _StreamFollower(key)
        self._streams.setdefault(key, set()).add(follower)
        if not self._wake_sent:
            self._wake_sent = True
            self._spawn(self._wake())
        return follower

    def _unfollow(self, follower: _StreamFollower) -> None:
        followers = self._streams.get(follower.key)
        if followers is not None:
            followers.discard(follower)
            if not followers:
                del self._streams[follower.key]

    async def _rest(self, follower: _StreamFollower) -> list[tuple[str, dict[str, str]]]:
        """What the follower has not read yet, read directly: the shared reader no longer feeds it."""
        self._unfollow(follower)
        rest = follower.entries
        for _, items in await self.r.xread({follower.key: follower.last}, count=100_000) or []:
            rest += items
        return rest

    async def _wake(self) -> None:
        try:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1)
                pipe.pexpire(self._wake_key, WAKE_TTL_MS)
                await pipe.execute()
        except RedisError as e:  # the reader's next read (within BLOCK_MS) takes the new stream in anyway
            log.warning("could not wake the gateway's stream reader: %s", e)

    async def _read(self) -> None:
        """Hand every followed stream's new entries to its followers, one XREAD for all of them."""
        while True:
            self._wake_sent = False  # from here on a new follower wakes the read built next
            streams = {key: min((f.last for f in followers), key=_entry_id)
                       for key, followers in self._streams.items()}
            streams[self._wake_key] = self._wake_last
            try:
                replies = await self.r.xread(streams, count=256, block=BLOCK_MS) or []
            except Exception as e:  # the broker, or anything else: followers poll meanwhile
                log.warning("the gateway's stream reader failed (%s); again in %.0f s", e, RECONNECT_S)
                await asyncio.sleep(RECONNECT_S)
                continue
            for key, items in replies:
                if key == self._wake_key:
                    self._wake_last = items[-1][0]
                    continue
                for follower in list(self._streams.get(key, ())):
                    follower.give(items)


async def result(r: aredis.Redis, names: Names, job_id: str) -> dict | None:
    raw = await r.get(names.result(job_id))
    return json.loads(raw) if raw else None


def text_of(result: dict) -> str:
    choice = result["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]
