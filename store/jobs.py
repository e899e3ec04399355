"""Job records in Redis, and their state changes as atomic Lua scripts.

A job is a hash (``names.job(id)``): state, priority, kind, model,
created_at / preprocessed_at / started_at / completed_at (or failed_at, cancelled_at,
expired_at), attempts, epoch, error, and batch fields.  Its lifecycle::

    queued -> in_progress -> completed | failed
       |            |
       +-------> cancelling -> cancelled        queued -> expired (not started in time)

``finish`` is the only way into a terminal state.  In one script it writes the
result key (TTL ``result_ttl_s``; a batch's jobs keep theirs until the batch is
finalized) and the job's state, counts the job into its batch (queueing the batch
to be finalized when it was the last), ends its delta stream and publishes on its
done channel.  It does
nothing if the job is already terminal, so a redelivered task publishes once.

Fencing: ``epoch`` counts the takes of a job by a different worker (``admit``).  ``finish`` and ``requeue`` given
the epoch their worker took the job at (``fence``) do nothing when the job has been taken since: only its latest
holder ends it or hands it back; a stale one (its lease restored to another worker) writes and publishes nothing.
Without a fence (cancel, expiry, the lost-job sweep, preprocess) they act whoever holds the job.

Batch keys are read from the job hash inside the scripts; that is fine on a
single Redis, which is what a Celery broker is.
"""

from __future__ import annotations

import json
import logging
import math
import time

import redis

from pagedq.config.messages import RequestError
from pagedq.config.names import JobState, Names
from pagedq.config.settings import Settings
from pagedq.store.connection import NotReplicated
from pagedq.store.dispatch import FairDispatch

log = logging.getLogger(__name__)

# KEYS: job. ARGV: now, '1' to take the job, the taking worker, max attempts, the worker-record key prefix.
# The deadline is judged on Redis's clock.  An attempt is counted unless the previous holder is alive and did
# not hand the job back (the job is still in_progress, or a lease restore took it from that holder:
# ``restored_from``): then this is a second copy, not a restart.  A holder is alive while its record
# (names.worker) was refreshed within the last half of its TTL (``ttl_s``, written by its heartbeat): a dead
# worker's record goes stale before its leases can run out.
# Taking returns 'ok:<epoch>:<attempts>:<created_at>' (the last two for the worker's metrics).  The epoch goes up
# unless the taker is the holder and the job is still its own (in_progress, or restored from it): that copy is a
# duplicate of the run the worker still has, which ends the job under the epoch it holds.  A restarted worker has
# a new name, so it is another holder.
_ADMIT = """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 'missing' end
if st ~= 'queued' and st ~= 'in_progress' then return st end
local expires = redis.call('HGET', KEYS[1], 'expires_at')
local started = redis.call('HGET', KEYS[1], 'started_at')
local t = redis.call('TIME')
local clock = tonumber(t[1]) + tonumber(t[2]) / 1000000
if st == 'queued' and not started and expires and tonumber(expires) <= clock then return 'expired' end
if ARGV[2] == '1' then
  local holder = redis.call('HGET', KEYS[1], 'worker')
  local spared = false
  if holder and holder ~= '' and (st == 'in_progress' or redis.call('HGET', KEYS[1], 'restored_from') == holder) then
    local record = ARGV[5] .. holder
    local pttl = redis.call('PTTL', record)
    local ttl = tonumber(redis.call('HGET', record, 'ttl_s') or '0')
    spared = pttl > 0 and (ttl == 0 or pttl > ttl * 500)  -- no TTL: not a heartbeat, no proof of life
  end
  if not spared then
    if tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0') >= tonumber(ARGV[4]) then return 'poison' end
    redis.call('HINCRBY', KEYS[1], 'attempts', 1)
  end
  redis.call('HSET', KEYS[1], 'attempt_counted', spared and '0' or '1')
  local epoch
  if holder == ARGV[3] and (st == 'in_progress' or redis.call('HGET', KEYS[1], 'restored_from') == holder) then
    epoch = tonumber(redis.call('HGET', KEYS[1], 'epoch') or '0')
  else
    epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
  end
  if not started then redis.call('HSET', KEYS[1], 'started_at', ARGV[1]) end
  redis.call('HSET', KEYS[1], 'state', 'in_progress', 'worker', ARGV[3])
  redis.call('HDEL', KEYS[1], 'restored_from')
  local attempts = redis.call('HGET', KEYS[1], 'attempts') or '0'
  return 'ok:' .. epoch .. ':' .. attempts .. ':' .. (redis.call('HGET', KEYS[1], 'created_at') or '')
end
return 'ok'
"""

# KEYS: the active-jobs set, the backlog counters (one per model, one per (model, tenant)), the job hashes, then
# [batch hash, batch job list].
# ARGV: max queued jobs per model, number of counters, JSON {"now": time, "need": [jobs per counter],
#       "bounds": [the bound of each counter] (absent: ARGV[1] for all),
#       "jobs": [[k, v, ...], ...], "ids": [job ids], "messages": [[key, message], ...],
#       "batch": [k, v, ...] or null, "batch_jobs": [job ids], "grace": send grace in seconds,
#       "queues": [the generate queues of the jobs' models]}; the job-queues set is the last key.
# All or nothing: nothing is written when a counter would pass the bound (returns that counter's key).
# A job joins the active set with its send pending: watched from Redis's now + grace (``JobStore.mark_sent``).
_CREATE = """
local max, ncounters = tonumber(ARGV[1]), tonumber(ARGV[2])
local plan = cjson.decode(ARGV[3])
for i = 1, ncounters do
  local bound = plan.bounds and plan.bounds[i] or max
  if tonumber(redis.call('GET', KEYS[1 + i]) or '0') + plan.need[i] > bound then return KEYS[1 + i] end
end
for i = 1, ncounters do redis.call('INCRBY', KEYS[1 + i], plan.need[i]) end
local t = redis.call('TIME')
local watch_from = tonumber(t[1]) + tonumber(t[2]) / 1e6 + plan.grace
for j, fields in ipairs(plan.jobs) do
  redis.call('HSET', KEYS[1 + ncounters + j], unpack(fields))
  redis.call('ZADD', KEYS[1], watch_from, plan.ids[j])
  for k = 1, #fields, 2 do if fields[k] == 'expires_at' then redis.call('ZADD', plan.deadlines, fields[k + 1], plan.ids[j]) end end
end
for _, kv in ipairs(plan.messages) do redis.call('SET', kv[1], kv[2]) end
for _, queue in ipairs(plan.queues) do redis.call('SADD', KEYS[#KEYS], queue) end
if plan.batch ~= cjson.null then
  local b, ids = 1 + ncounters + #plan.jobs, plan.batch_jobs
  redis.call('HSET', KEYS[b + 1], unpack(plan.batch))
  for i = 1, #ids, 1000 do  -- unpack() takes a few thousand values at most
    redis.call('RPUSH', KEYS[b + 2], unpack(ids, i, math.min(i + 999, #ids)))
  end
end
return 'ok'
"""

# KEYS: job hash, its message, the active-jobs set. ARGV: job id.
# Removes a job that was never sent (the send failed), with its place in the backlog.
_DISCARD = """
for _, field in ipairs({'backlog_key', 'tenant_backlog_key'}) do
  local backlog = redis.call('HGET', KEYS[1], field)
  if backlog then redis.call('DECR', backlog) end
end
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[2])
return redis.call('DEL', KEYS[1])
"""

# KEYS: the active-jobs set. ARGV: seconds from Redis's now, 'later' (only ever move a job's time later) or '',
# job ids.  Sets when the lost-job sweep starts looking for these jobs' messages; an ended job stays out.
_WATCH = """
local t = redis.call('TIME')
local at = tonumber(t[1]) + tonumber(t[2]) / 1e6 + tonumber(ARGV[1])
for i = 3, #ARGV do
  if ARGV[2] == 'later' then redis.call('ZADD', KEYS[1], 'XX', 'GT', at, ARGV[i])
  else redis.call('ZADD', KEYS[1], 'XX', at, ARGV[i]) end
end
return 0
"""

# KEYS: job hash, result, delta stream, message, active-jobs set, batches-to-finalize set, deadlines.
# ARGV: state, now, ttl, result JSON or '', error JSON or '', done channel, job id, the delta stream's TTL,
# 'defer' or '' ('defer': publish nothing, return {1, the batch's done channel if it completed, else ''}, for the
# caller to publish once replicas confirmed the end), the fence: the epoch the caller took the job at, or ''.
# Fenced, and the job was taken since (another epoch): returns {-1, the job's epoch} having written nothing,
# whether or not the new holder ended it already (the stale holder's write is refused either way).  Otherwise 0
# if the job had ended (a repeated finish of the same take, or a cancel's).
# A batch's job keeps its record and result (no TTL) until the batch is finalized: the finalizer gives them
# their TTL once the batch's output is written (pipeline/gateway/batches.py), so no line is lost to a batch
# that outlives result_ttl_s or is read late.
_FINISH = """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 0 end
local epoch = redis.call('HGET', KEYS[1], 'epoch') or '0'
if ARGV[10] ~= '' and tonumber(epoch) ~= tonumber(ARGV[10]) then return {-1, epoch} end
if st == 'completed' or st == 'failed' or st == 'cancelled' or st == 'expired' then return 0 end
local state, now, ttl = ARGV[1], ARGV[2], ARGV[3]
local defer, batch_channel = ARGV[9] == 'defer', ''
redis.call('ZREM', KEYS[5], ARGV[7])
redis.call('ZREM', KEYS[7], ARGV[7])  -- names.deadlines
redis.call('DEL', KEYS[4])
if ARGV[4] ~= '' then redis.call('SET', KEYS[2], ARGV[4], 'EX', ttl) end
redis.call('HSET', KEYS[1], 'state', state, state .. '_at', now)
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[5]) end
redis.call('EXPIRE', KEYS[1], ttl)
for _, field in ipairs({'backlog_key', 'tenant_backlog_key'}) do
  local backlog = redis.call('HGET', KEYS[1], field)
  if backlog then redis.call('DECR', backlog) end
end
local batch = redis.call('HGET', KEYS[1], 'batch_key')
if batch then
  redis.call('HINCRBY', batch, state, 1)
  local done = redis.call('HINCRBY', batch, 'done', 1)
  redis.call('PERSIST', KEYS[1])
  redis.call('PERSIST', KEYS[2])
  if done >= tonumber(redis.call('HGET', batch, 'total') or '0') then
    redis.call('HSET', batch, 'state', 'completed', 'completed_at', now)
    redis.call('ZADD', KEYS[6], now, redis.call('HGET', KEYS[1], 'batch_id') or '')
    batch_channel = redis.call('HGET', batch, 'done_channel')
    if not defer then redis.call('PUBLISH', batch_channel, 'completed') end
  end
end
if redis.call('HGET', KEYS[1], 'stream') == '1' then
  redis.call('XADD', KEYS[3], '*', 'type', 'end', 'state', state)
end
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('EXPIRE', KEYS[3], ARGV[8]) end  -- read by now: gone soon
if defer then return {1, batch_channel} end
redis.call('PUBLISH', ARGV[6], state)
return 1
"""

_CANCEL = """
local st = redis.call('HGET', KEYS[1], 'state')
if st == 'queued' or st == 'in_progress' then
  redis.call('HSET', KEYS[1], 'state', 'cancelling', 'cancel_requested_at', ARGV[1])
end
if st == 'in_progress' then redis.call('INCR', KEYS[2]) end  -- names.job_flags_epoch: its worker re-checks
return st or 'missing'
"""

# KEYS: job. ARGV: '1' to count the attempt, the fence (as _FINISH's).  Returns 1 if the job went back to queued,
# 0 if it was not in progress, {-1, the job's epoch} if it was taken since the fence (nothing written).
_REQUEUE = """
if redis.call('HGET', KEYS[1], 'state') ~= 'in_progress' then return 0 end
local epoch = redis.call('HGET', KEYS[1], 'epoch') or '0'
if ARGV[2] ~= '' and tonumber(epoch) ~= tonumber(ARGV[2]) then return {-1, epoch} end
redis.call('HSET', KEYS[1], 'state', 'queued')
-- an orderly hand-back takes back the attempt its admit counted (none if the admit spared it)
if ARGV[1] == '0' and redis.call('HGET', KEYS[1], 'attempt_counted') ~= '0' then
  redis.call('HINCRBY', KEYS[1], 'attempts', -1)
end
return 1
"""


SEND_GRACE_S = 30.0  # default of settings.send_grace_s


def now() -> float:
    return round(time.time(), 6)


class Admitted(str):
    """An ``admit`` verdict: 'ok' or why not, compared as the plain string it is.  ``epoch``: the job's epoch as
    this take left it (the ``fence`` its worker passes to ``finish`` and ``requeue``); 0 when nothing was taken.
    ``attempts`` and ``created_at``: the record's, as the take left them (None when nothing was taken)."""

    epoch: int
    attempts: str | None
    created_at: str | None

    def __new__(cls, verdict: str, epoch: int = 0, attempts: str | None = None,
                created_at: str | None = None) -> Admitted:
        admitted = super().__new__(cls, verdict)
        admitted.epoch, admitted.attempts, admitted.created_at = epoch, attempts, created_at
        return admitted

    @classmethod
    def of(cls, reply: str) -> Admitted:
        """From _ADMIT's reply: 'ok:<epoch>:<attempts>:<created_at>' when it took the job, else the verdict
        alone."""
        verdict, epoch, attempts, created_at = (reply.split(":", 3) + ["", "", ""])[:4]
        return cls(verdict, int(epoch or 0), attempts or None, created_at or None)


def read_backlog(r: redis.Redis, names: Names, model: str, tenant: str | None = None) -> int:
    """Jobs of ``model`` (of ``tenant``'s, when given) accepted and not yet ended: the counters ``create`` and
    ``finish`` keep (``names.backlog``, ``names.tenant_backlog``)."""
    key = names.backlog(model) if tenant is None else names.tenant_backlog(model, tenant)
    return int(r.get(key) or 0)


class JobStore:
    def __init__(self, client: redis.Redis, names: Names, result_ttl_s: int, max_attempts: int = 3,
                 send_grace_s: float = SEND_GRACE_S, min_replicas_ack: int = 0,
                 replica_ack_timeout_s: float = 5.0) -> None:
        self.r = client
        self.names = names
        self.ttl = result_ttl_s
        self.max_attempts = max_attempts
        self.send_grace_s = send_grace_s
        self.min_replicas_ack = min_replicas_ack
        self.replica_ack_timeout_s = replica_ack_timeout_s
        self._create = client.register_script(_CREATE)
        self._watch = client.register_script(_WATCH)
        self._discard = client.register_script(_DISCARD)
        self._admit = client.register_script(_ADMIT)
        self._finish = client.register_script(_FINISH)
        self._cancel = client.register_script(_CANCEL)
        self._requeue = client.register_script(_REQUEUE)

    @classmethod
    def from_settings(cls, client: redis.Redis, names: Names, settings: Settings) -> JobStore:
        return cls(client, names, settings.result_ttl_s, settings.max_attempts, settings.send_grace_s,
                   settings.redis_min_replicas_ack, settings.redis_replica_ack_timeout_s)

    def create(self, jobs: list[tuple[str, dict]], max_queued: int,
               batch: tuple[str, dict, list[str]] | None = None, messages: dict[str, str] | None = None,
               tenant_share: float = 1.0) -> None:
        """Write job records ``(job_id, fields)`` and, for a batch, its hash and job list: all, or none.

        Every job joins the active-jobs set until it ends; ``messages`` (job id -> its preprocess message)
        are kept beside the records so that a message lost on its way can be sent again (``store.lost_jobs``).
        Its send is pending: the sweep looks for its message only after ``mark_sent``, or ``send_grace_s``
        from now (the producer died before sending it).

        A record whose fields name a ``model`` takes a place in that model's backlog until the job ends;
        when a model's backlog would pass ``max_queued``, nothing is written and RequestError
        ``queue_full`` is raised.  A record that also names a ``tenant`` takes a place in that tenant's share
        of the model's backlog, at most ``ceil(tenant_share x max_queued)`` (the same all-or-nothing refusal):
        one tenant's flood is refused before it fills the backlog every tenant shares.
        """
        counters: dict[str, int] = {}
        bounds: dict[str, int] = {}
        tenant_max = math.ceil(tenant_share * max_queued)
        for _, fields in jobs:
            if fields.get("model"):
                key = self.names.backlog(fields["model"])
                fields["backlog_key"] = key
                counters[key] = counters.get(key, 0) + 1
                bounds[key] = max_queued
                if fields.get("tenant"):
                    key = self.names.tenant_backlog(fields["model"], fields["tenant"])
                    fields["tenant_backlog_key"] = key
                    counters[key] = counters.get(key, 0) + 1
                    bounds[key] = tenant_max
        keys = [self.names.active_jobs, *counters, *(self.names.job(job_id) for job_id, _ in jobs)]
        plan = {"now": now(), "need": list(counters.values()), "bounds": list(bounds.values()),
                "jobs": [_flat(fields) for _, fields in jobs],
                "ids": [job_id for job_id, _ in jobs],
                "messages": [[self.names.job_message(j), m] for j, m in (messages or {}).items()],
                "batch": None, "batch_jobs": [], "grace": self.send_grace_s, "deadlines": self.names.deadlines,
                "queues": sorted({self.names.generate_queue(f["model"]) for _, f in jobs if f.get("model")})}
        if batch is not None:
            batch_key, fields, job_ids = batch
            keys += [batch_key, fields["jobs_key"]]
            plan["batch"], plan["batch_jobs"] = _flat(fields), job_ids
        keys.append(self.names.job_queues)
        verdict = self._create(keys=keys, args=[max_queued, len(counters), json.dumps(plan)])
        if verdict != "ok":
            tenant_job = next((f for _, f in jobs if f.get("tenant_backlog_key") == verdict), None)
            if tenant_job is not None:
                raise RequestError(
                    f"model: tenant {tenant_job['tenant']!r} has its share of the queue of {tenant_job['model']!r} "
                    f"({tenant_max} jobs waiting or running: {tenant_share:g} of {max_queued}); retry later",
                    "model", code="queue_full")
            model = next(f["model"] for _, f in jobs if f.get("backlog_key") == verdict)
            raise RequestError(f"model: the queue of {model!r} is full ({max_queued} jobs waiting or running); "
                               "retry later", "model", code="queue_full")

    def discard(self, job_id: str) -> None:
        """Remove a job that was never sent, and its place in the backlog."""
        self._discard(keys=[self.names.job(job_id), self.names.job_message(job_id), self.names.active_jobs],
                      args=[job_id])

    def mark_sent(self, job_ids: list[str]) -> None:
        """These jobs' messages are on their queue: from now on the lost-job sweep looks for them."""
        self._watch_from(job_ids, 0.0, later_only=False)

    def replicated(self, job_ids: list[str]) -> None:
        """With ``min_replicas_ack``: return once that many replicas hold every write the master had made when this
        is called (the jobs' records and messages included); raise ``NotReplicated`` naming ``job_ids`` after
        ``replica_ack_timeout_s``.  Without it: at once."""
        if self.min_replicas_ack:
            pipe = self.r.pipeline(transaction=False)
            pipe.time()  # WAIT covers what the master had written when its connection's previous command ran
            acked = self._wait_behind(pipe)[-1]
            if acked < self.min_replicas_ack:
                raise NotReplicated(f"{acked} of the {self.min_replicas_ack} replicas PAGEDQ_REDIS_MIN_REPLICAS_ACK "
                                    f"asks for confirmed within {self.replica_ack_timeout_s:g} s; {len(job_ids)} "
                                    f"job(s) are written on the master, from {job_ids[0] if job_ids else '-'}",
                                    job_ids)

    def _wait_behind(self, pipe: redis.client.Pipeline) -> list:
        """Execute ``pipe`` (one connection, not a transaction: WAIT does not block inside MULTI) with a WAIT for
        ``min_replicas_ack`` replicas behind it; the replies, the last one the number of replicas that confirmed."""
        pipe.wait(self.min_replicas_ack, max(1, int(self.replica_ack_timeout_s * 1000)))
        return pipe.execute()

    def keep_pending(self, job_ids: list[str]) -> None:
        """These jobs' sends are still coming (a long send loop): the sweep leaves them ``send_grace_s`` more."""
        self._watch_from(job_ids, self.send_grace_s, later_only=True)

    def _watch_from(self, job_ids: list[str], delay_s: float, later_only: bool) -> None:
        for i in range(0, len(job_ids), 1000):
            self._watch(keys=[self.names.active_jobs],
                        args=[delay_s, "later" if later_only else "", *job_ids[i:i + 1000]])

    def backlog(self, model: str, tenant: str | None = None) -> int:
        """Jobs of ``model`` (of ``tenant``'s, when given) accepted and not yet ended."""
        return read_backlog(self.r, self.names, model, tenant)

    def get(self, job_id: str) -> dict[str, str]:
        return self.r.hgetall(self.names.job(job_id))

    def state(self, job_id: str) -> str | None:
        return self.r.hget(self.names.job(job_id), "state")

    def update(self, job_id: str, **fields) -> None:
        self.r.hset(self.names.job(job_id), mapping={k: _field(v) for k, v in fields.items()})

    def admit(self, job_id: str, worker: str | None = None) -> Admitted:
        """'ok' if the job may proceed (with ``worker``: mark it in_progress, count an attempt unless its previous
        worker is alive and did not hand it back), else its state, or 'poison' when it was started
        ``max_attempts`` times already (each of its workers died).

        Taking the job from another holder (or a job not in progress) moves its epoch on, which fences the
        previous holder's ``finish``/``requeue``; ``worker`` taking its own running job again keeps it."""
        return Admitted.of(self._admit(keys=[self.names.job(job_id)],
                                       args=[now(), "1" if worker else "0", worker or "", self.max_attempts,
                                             self.names.worker("")]))

    def finish(self, job_id: str, state: JobState, result: dict | None = None, error: dict | None = None,
               fence: int | None = None) -> bool:
        """Move a job to a terminal state, once. Returns False if it already was in one.  With
        ``min_replicas_ack`` the end is announced (its done channel, its batch's) only once that many replicas
        confirmed it: a waiter never hears of an end a failover then erases (one not confirmed in time is not
        announced at all; waiters find it by polling).

        ``fence``: the epoch the caller's worker took the job at (``Admitted.epoch``); when the job has another
        epoch (another worker took it since) nothing is written or published and False is returned.  None: the
        end is not a holder's (cancel, expiry, a lost job), whoever holds the job."""
        assert state.is_terminal
        if not self.min_replicas_ack:
            ended = self._finish_script(job_id, state, result, error, fence)
            return not self._fenced(job_id, ended, fence, "finish") and bool(ended)
        n = self.names
        pipe = self.r.pipeline(transaction=False)
        self._finish_script(job_id, state, result, error, fence, client=pipe)
        ended, acked = self._wait_behind(pipe)
        if not ended or self._fenced(job_id, ended, fence, "finish"):
            return False
        if acked < self.min_replicas_ack:
            log.warning("job %s ended %s, but %d of %d replicas confirmed it within %g s: not announced",
                        job_id, state.value, acked, self.min_replicas_ack, self.replica_ack_timeout_s)
            return True
        pipe = self.r.pipeline(transaction=False)
        pipe.publish(n.done_channel(job_id), state.value)
        if ended[1]:
            pipe.publish(ended[1], "completed")
        pipe.execute()
        return True

    def _finish_script(self, job_id: str, state: JobState, result: dict | None, error: dict | None,
                       fence: int | None, client: redis.Redis | None = None):
        n = self.names
        keys = [n.job(job_id), n.result(job_id), n.stream(job_id), n.job_message(job_id), n.active_jobs,
                n.batches_to_finalize, n.deadlines]
        args = [state.value, now(), self.ttl, json.dumps(result) if result is not None else "",
                json.dumps(error) if error is not None else "", n.done_channel(job_id), job_id,
                n.stream_ttl_after_end_s, "defer" if self.min_replicas_ack else "", _fence_arg(fence)]
        return self._finish(keys=keys, args=args, client=client)

    def expire_if_due(self, job_id: str) -> bool:
        """End a job never started and past its ``expires_at``, as a worker taking it would; True if it did."""
        verdict = self.admit(job_id)  # without a worker: only looks
        if verdict == JobState.EXPIRED:
            self.settle(job_id, verdict)
            return True
        return False

    def request_cancel(self, job_id: str) -> str:
        """Mark a queued or running job 'cancelling'. Returns the state it was in ('missing' if unknown).
        A queued job waiting in a fair queue leaves it (a claim would skip it anyway: ``store/dispatch``)."""
        previous = self._cancel(keys=[self.names.job(job_id), self.names.job_flags_epoch], args=[now()])
        if previous == JobState.QUEUED:
            FairDispatch(self.r, self.names).remove(job_id)
        return previous

    def cancel_many(self, job_ids: list[str]) -> list[str]:
        """``request_cancel`` for many jobs (a batch's cancel) in a few round trips, ending the queued ones
        ``cancelled`` here.  Running ones are marked and ``names.job_flags_epoch`` moved, so their workers end
        them at their next re-check (``PAGEDQ_PROGRESS_INTERVAL_S``): no control message each.  Returns each
        job's previous state ('missing' if unknown)."""
        n = self.names
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            self._cancel(keys=[n.job(job_id), n.job_flags_epoch], args=[now()], client=pipe)
        previous = pipe.execute() if job_ids else []
        queued = [j for j, p in zip(job_ids, previous, strict=True) if p == JobState.QUEUED]
        FairDispatch(self.r, n).remove_many(queued)
        if self.min_replicas_ack:  # each end waits for its replicas before it is announced
            for job_id in queued:
                self.finish(job_id, JobState.CANCELLED)
        elif queued:
            pipe = self.r.pipeline(transaction=False)
            for job_id in queued:
                self._finish_script(job_id, JobState.CANCELLED, None, None, None, client=pipe)
            pipe.execute()
        return previous

    def request_stream(self, job_id: str) -> None:
        """Mark the job streamed: its GPU worker publishes text deltas once it hears the control message, or
        finds the flag when it re-checks (``names.job_flags_epoch`` moves after the flag, in one transaction)."""
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(self.names.job(job_id), "stream", 1)
        pipe.incr(self.names.job_flags_epoch)
        pipe.execute()

    def settle(self, job_id: str, verdict: str) -> None:
        """Act on an ``admit`` verdict other than 'ok': a job that cannot proceed ends here."""
        if verdict == JobState.CANCELLING:
            self.finish(job_id, JobState.CANCELLED)
        elif verdict == JobState.EXPIRED:
            error = RequestError("the job was not started before it expired", code="expired")
            self.finish(job_id, JobState.EXPIRED, error=error.to_dict())
        elif verdict == "poison":
            error = RequestError(f"the job was started {self.max_attempts} times and its worker was lost each "
                                 "time; not retried again", code="poison")
            self.finish(job_id, JobState.FAILED, error=error.to_dict())

    def requeue(self, job_id: str, count_attempt: bool = False, fence: int | None = None) -> bool:
        """A running job handed back to the queue is 'queued' again; True if it was.  A worker's orderly shutdown
        does not count as an attempt; losing a process of its replica does (the job may be what killed it).
        ``fence`` as in ``finish``: a worker the job was taken from since does not hand it back."""
        handed = self._requeue(keys=[self.names.job(job_id)], args=["1" if count_attempt else "0", _fence_arg(fence)])
        return not self._fenced(job_id, handed, fence, "requeue") and bool(handed)

    def result(self, job_id: str) -> dict | None:
        raw = self.r.get(self.names.result(job_id))
        return json.loads(raw) if raw else None

    def _fenced(self, job_id: str, reply, fence: int | None, op: str) -> bool:
        """True (logged, counted in ``names.fenced``) when a script refused a fenced write: its reply is {-1, the
        job's epoch}."""
        if isinstance(reply, list) and reply[0] == -1:
            log.warning("fenced: %s of job %s at epoch %s refused, the job is at epoch %s", op, job_id, fence,
                        reply[1])
            self.r.hincrby(self.names.fenced, op, 1)
            return True
        return False


def _fence_arg(fence: int | None) -> str:
    """A fence as the scripts take it: '' for none."""
    return "" if fence is None else str(int(fence))


def _flat(fields: dict) -> list:
    """A hash's fields as the flat [name, value, ...] list HSET takes, values as strings (Lua would round floats)."""
    return [x for k, v in fields.items() for x in (k, str(_field(v)))]


def _field(value) -> str | int | float:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return value
