"""The last safety net: an accepted job whose message was lost is sent again.

Leases (``transport``) return the messages a dead worker *held*.  Other gaps
leave a job with no message anywhere: kombu pops a message from its queue
(BRPOP) and only then records it in the ``unacked`` hash, so a worker killed
between the two loses it; a producer killed between writing a job and sending
its message leaves a job nobody will run; a task that fails on a broker
error is acknowledged once the broker answers again, its job unfinished; and a
broker that crashes loses its last second of writes (AOF ``everysec``), which
can keep a job's record while dropping the message sent right after it.

So every accepted job is in the active-jobs set until it ends (the create and
finish scripts of ``jobs``), with its preprocess message kept beside it.  Its
score is the time (on Redis's clock) from which it must have a message
somewhere: the producer sets it when its send is done (``JobStore.mark_sent``);
until then the job is *pending* for ``send_grace_s`` after it was written, so
neither a long ``submit_batch`` send loop (which keeps its unsent jobs
pending) nor a producer killed mid-send is mistaken: the first is left alone,
the second is found once the grace has passed.

A sweep, run by one process at a time every ``interval_s`` seconds, compares
*ids*: the active jobs due to have a message, against the jobs named by the
messages on the known queue lists (preprocess, results and each job model's
generate queue, every priority; read in pages) and in ``unacked`` (read with
HSCAN).  Messages of jobs that already ended (a job cancelled or expired while
queued leaves its message behind) name no active job and so hide nothing.
A job missing from two sweeps in a row (a message is between those places for
milliseconds, not seconds) is put back to ``queued`` and its preprocess message
sent again; preprocessing and generation then run as for a new job, and
``finish`` still publishes once.  A job sent again ``max_resends`` times ends
failed with code ``lost``.

A generated job (``store/dispatch``) has no message of
its own: it waits in its model's fair queue, which is durable (held), or is
bound to a token's slot, and is held iff that token's message is on a queue or
in ``unacked``.  A bound job missing twice goes back into its fair queue
(``FairDispatch.release``; fenced and counted as a resend).  And since a token
runs whichever job is next, what must not fall short is their number: a model
whose fair queue holds more jobs than there are unbound tokens on its queue
and in ``unacked`` in two sweeps in a row gets the missing tokens (*top-up*;
a spare token finds nothing to claim and ends).

The lock is owner-checked: held under a token, renewed while the sweep reads
(compare-and-extend; taken back if it lapsed with nobody else holding it),
kept for the rest of the interval once done, released only by its owner.  Resending is fenced inside Lua: the script sends nothing
unless the caller still holds the lock and removes the job from the suspects,
so two sweepers never resend one job.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable

from pagedq.config.messages import PreprocessJob, RequestError
from pagedq.config.names import JobState, model_slug
from pagedq.store.dispatch import FairDispatch
from pagedq.store.jobs import JobStore, now
from pagedq.store.locks import OwnedLock
from pagedq.store.transport import job_id_of, slot_of

log = logging.getLogger("pagedq.lost_jobs")

PAGE = 1000  # list items (LRANGE) or hash fields (HSCAN COUNT) read per call

# KEYS: job hash, its message, active-jobs set, sweep lock, lost suspects.
# ARGV: now, max resends, lock token, job id, send grace (s).
# Returns the message to send, 'not_owner', 'not_suspect', 'gone' (no record), 'ended', 'give_up' or 'no_message'.
_RESEND = """
if redis.call('GET', KEYS[4]) ~= ARGV[3] then return 'not_owner' end
if redis.call('SREM', KEYS[5], ARGV[4]) == 0 then return 'not_suspect' end
local st = redis.call('HGET', KEYS[1], 'state')
if not st then redis.call('ZREM', KEYS[3], ARGV[4]) return 'gone' end
if st ~= 'queued' and st ~= 'in_progress' and st ~= 'cancelling' then
  redis.call('ZREM', KEYS[3], ARGV[4])
  return 'ended'
end
local message = redis.call('GET', KEYS[2])
if not message then return 'no_message' end
if redis.call('HINCRBY', KEYS[1], 'resent', 1) > tonumber(ARGV[2]) then return 'give_up' end
if st == 'in_progress' then redis.call('HSET', KEYS[1], 'state', 'queued') end
redis.call('HSET', KEYS[1], 'resent_at', ARGV[1])
local t = redis.call('TIME')
redis.call('ZADD', KEYS[3], 'XX', tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[5]), ARGV[4])
return message
"""

# KEYS: lock, lost suspects. ARGV: token, TTL (s), job ids.  This sweep's suspects replace the last ones.
_SUSPECT = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[2])
for i = 3, #ARGV, 1000 do redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV))) end
if #ARGV > 2 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
return 1
"""

Send = Callable[[PreprocessJob, int], None]  # (the job's preprocess message, its pagedq priority)
SendToken = Callable[[str, int], None]  # (a model, the pagedq priority of a token for a job of it)


class LockLost(RuntimeError):
    """Another sweeper holds the lock now: this sweep stops without resending anything more."""


class LostJobSweep:
    def __init__(self, store: JobStore, send: Send, interval_s: float, owner: str, max_resends: int = 3,
                 page: int = PAGE, send_token: SendToken | None = None) -> None:
        self.store, self.r, self.names = store, store.r, store.names
        self.send = send
        self.send_token = send_token  # fair dispatch's tokens (None: no top-up)
        self.fair = FairDispatch(store.r, store.names)
        self._bound: dict[str, str] = {}  # this sweep's bound jobs -> their slots
        self._short: dict[str, int] = {}  # generate queue -> tokens short at the last sweep
        self.interval_s = interval_s
        self.owner = owner
        self.lock = OwnedLock(self.r, self.names.sweep_lock, owner)
        self.token = self.lock.token  # the resend and suspect scripts check it holds the lock
        self.max_resends = max_resends
        self.page = page
        self._lock_ms = max(int(interval_s * 900), 100)  # the lock outlives a sweep by most of an interval
        self._renewed_at = 0.0
        self._resend = self.r.register_script(_RESEND)
        self._suspect = self.r.register_script(_SUSPECT)

    def sweep(self) -> list[str]:
        """One sweep (unless another process swept within the interval); returns the jobs sent again."""
        if not self.lock.take(self._lock_ms):
            return []
        started = self._renewed_at = time.monotonic()
        resent: list[str] = []
        try:
            self._sweep(resent)
        except LockLost:
            log.warning("lost-job sweep: another sweeper took the lock; stopped after sending %d again", len(resent))
            return resent
        except BaseException:
            self.release()
            raise
        # Kept until most of an interval has passed since this sweep began: one sweep per interval, whichever process.
        left_ms = self._lock_ms - int((time.monotonic() - started) * 1000)
        if left_ms < 1 or not self.lock.hold(left_ms):  # a lapsed lock nobody took is taken back
            self.release()
        return resent

    def release(self) -> bool:
        """Give the lock back, if this sweeper still holds it."""
        return self.lock.release()

    def renew(self) -> None:
        """Extend the lock by its whole TTL, unless another sweeper holds it now (then raise LockLost)."""
        if not self.lock.hold(self._lock_ms):
            raise LockLost(self.names.sweep_lock)
        self._renewed_at = time.monotonic()

    def _renew_if_due(self) -> None:
        if time.monotonic() - self._renewed_at > self._lock_ms / 3000:
            self.renew()

    def _sweep(self, resent: list[str]) -> None:
        """Resend the jobs missing now and at the last sweep (appended to ``resent``); suspect the newly missing."""
        due = set(self.r.zrangebyscore(self.names.active_jobs, "-inf", _server_now(self.r)))
        held = self._jobs_with_a_message(due) if due else set()
        missing = due - held
        before = self.r.smembers(self.names.lost_suspects)
        if missing & before:
            self.renew()
        for job in sorted(missing & before):
            if self._send_again(job):
                resent.append(job)
        self._suspect(keys=[self.names.sweep_lock, self.names.lost_suspects],
                      args=[self.token, int(self.interval_s * 3) + 1, *sorted(missing - before)])
        if self.send_token is not None:
            self._top_up()

    def queues(self) -> list[str]:
        """The queues job messages live on: preprocess, results and every generate queue a job was created for."""
        n = self.names
        return [n.preprocess_queue, n.results_queue, *sorted(self.r.smembers(n.job_queues))]

    def _jobs_with_a_message(self, wanted: set[str]) -> set[str]:
        """The jobs named by a message on a known queue or in ``unacked``, or waiting in a fair queue, or bound
        to a token whose message is on a queue or in ``unacked``; stops early once all of ``wanted`` are found.
        Lists first, then ``unacked``: a message moving on (list -> unacked) is seen once either way."""
        held, slots = self._in_fair_queues(wanted)
        for raws in self._pages():
            for raw in raws:
                job, slot = _ref_of(raw)
                if job is not None:
                    held.add(job)
                elif slot in slots:
                    held.add(slots[slot])
            if wanted <= held:
                break
            self._renew_if_due()
        return held

    def _in_fair_queues(self, jobs: set[str]) -> tuple[set[str], dict[str, str]]:
        """(the jobs waiting in a fair queue, {slot: job} for those bound to a token's slot)."""
        self._bound = {}
        if not jobs:
            return set(), {}
        ids = sorted(jobs)
        waiting: set[str] = set()
        for i in range(0, len(ids), self.page):
            page = ids[i:i + self.page]
            for job, raw in zip(page, self.r.hmget(self.names.fair_index, page), strict=True):
                if raw is None:
                    continue
                slot = json.loads(raw).get("slot")
                if slot:
                    self._bound[job] = slot
                else:
                    waiting.add(job)
        return waiting, {slot: job for job, slot in self._bound.items()}

    def _top_up(self) -> None:
        """Send the tokens a model's fair queue is short of, when it was short at the last sweep too (the
        preprocess pushes a job a moment before it sends its token)."""
        short: dict[str, int] = {}
        for queue in sorted(self.r.smembers(self.names.job_queues)):
            model = model_slug(queue.removeprefix(f"{self.names.queue_prefix}generate."))  # fair keys take a slug
            waiting = self.fair.waiting(model)
            if not waiting:
                continue
            lists = self.names.broker_lists(queue)
            with self.r.pipeline(transaction=False) as pipe:
                for key in lists:
                    pipe.llen(key)
                queued = sum(pipe.execute())  # at most this many unbound tokens wait on the lists
            if queued >= waiting:
                continue
            need = waiting - queued - self._unbound_tokens_held(queue)
            if need > 0:
                short[queue] = need
                if queue in self._short:
                    self._send_tokens(model, min(need, self._short[queue]))
        self._short = short

    def _unbound_tokens_held(self, queue: str) -> int:
        """Tokens of ``queue`` in ``unacked`` bound to no job (waiting for a free seat)."""
        slots: list[str] = []
        cursor = 0
        while True:
            cursor, fields = self.r.hscan(self.names.unacked, cursor, count=self.page)
            for raw in fields.values():
                try:
                    payload, _, routing_key = json.loads(raw)
                except (ValueError, TypeError):
                    continue
                slot = slot_of(payload) if isinstance(payload, dict) and routing_key == queue else None
                if slot is not None:
                    slots.append(slot)
            if cursor == 0:
                break
        if not slots:
            return 0
        return sum(bound is None for bound in self.r.mget([self.names.slot(s) for s in slots]))

    def _send_tokens(self, model: str, n: int) -> None:
        bands = [p for p in range(9, -1, -1) if self.r.scard(self.names.fair_tenants(model, p))]
        priority = bands[0] if bands else 5
        log.warning("fair queue of %s: %d job(s) waiting without a token; sent %d", model, n, n)
        for _ in range(n):
            self.send_token(model, priority)

    def _pages(self) -> Iterable[list[str]]:
        lists = [key for q in self.queues() for key in self.names.broker_lists(q)]
        with self.r.pipeline(transaction=False) as pipe:
            for key in lists:
                pipe.llen(key)
            lengths = pipe.execute()
        for key, length in zip(lists, lengths, strict=True):
            # kombu pushes on the left and pops on the right: pages from the left never skip a message that stays
            for start in range(0, length, self.page):
                page = self.r.lrange(key, start, start + self.page - 1)
                if not page:
                    break
                yield page
        cursor = 0
        while True:
            cursor, fields = self.r.hscan(self.names.unacked, cursor, count=self.page)
            yield list(fields.values())
            if cursor == 0:
                break

    def _send_again(self, job_id: str) -> bool:
        n = self.names
        verdict = self._resend(
            keys=[n.job(job_id), n.job_message(job_id), n.active_jobs, n.sweep_lock, n.lost_suspects],
            args=[now(), self.max_resends, self.token, job_id, self.store.send_grace_s])
        if verdict == "not_owner":
            raise LockLost(n.sweep_lock)
        if verdict in ("not_suspect", "gone", "ended"):
            return False
        if verdict in ("give_up", "no_message"):
            why = ("its message was lost and sent again too often" if verdict == "give_up"
                   else "its message was lost and none was kept to send again")
            log.error("job %s: %s; failed", job_id, why)
            self.store.finish(job_id, JobState.FAILED, error=RequestError(why, code="lost").to_dict())
            return False
        slot = self._bound.get(job_id)
        if slot is not None:  # bound to a token that is gone: back in its fair queue, where it is held
            self.fair.release(slot)
            log.warning("job %s was bound to a token found on no queue or worker; back in its fair queue", job_id)
            self.store.mark_sent([job_id])
            return True
        priority = int(self.r.hget(n.job(job_id), "priority") or 0)
        log.warning("job %s had no message on any queue or worker; sent again", job_id)
        try:
            self.send(PreprocessJob(**json.loads(verdict)), priority)
        except Exception as e:  # noqa: BLE001 - still pending: sent again once its grace has passed
            log.warning("job %s: could not send it again (%s: %s); tried again later", job_id, type(e).__name__, e)
            return False
        self.store.mark_sent([job_id])
        return True


def _server_now(r) -> float:
    """Redis's clock: the one the active set's scores are on (every host's own clock may be off)."""
    seconds, micros = r.time()
    return seconds + micros / 1e6


def _ref_of(raw: str) -> tuple[str | None, str | None]:
    """(the job, the token slot) a raw queue item or ``unacked`` value (``[payload, exchange, routing key]``)
    names; (None, None) for any other message."""
    try:
        payload = json.loads(raw)
    except ValueError:
        return None, None
    if isinstance(payload, list) and payload:
        payload = payload[0]
    if not isinstance(payload, dict):
        return None, None
    return job_id_of(payload), slot_of(payload)
