"""Job records in Redis, and their state changes as atomic Lua scripts.

A job is a hash (``names.job(id)``): state, priority, kind, model,
created_at / started_at / completed_at (or failed_at, cancelled_at,
expired_at), attempts, error, and batch fields.  Its lifecycle::

    queued -> in_progress -> completed | failed
       |            |
       +-------> cancelling -> cancelled        queued -> expired (not started in time)

``finish`` is the only way into a terminal state.  In one script it writes the
result key (TTL ``result_ttl_s``) and the job's state, counts the job into its
batch, ends its delta stream and publishes on its done channel.  It does
nothing if the job is already terminal, so a redelivered task publishes once.

Batch keys are read from the job hash inside the scripts; that is fine on a
single Redis, which is what a Celery broker is.
"""

from __future__ import annotations

import json
import time

import redis

from pagedq.config.messages import RequestError
from pagedq.config.names import JobState, Names

_ADMIT = """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 'missing' end
if st ~= 'queued' and st ~= 'in_progress' then return st end
local expires = redis.call('HGET', KEYS[1], 'expires_at')
if st == 'queued' and expires and tonumber(expires) < tonumber(ARGV[1]) then return 'expired' end
if ARGV[2] == '1' then
  if not redis.call('HGET', KEYS[1], 'started_at') then redis.call('HSET', KEYS[1], 'started_at', ARGV[1]) end
  redis.call('HSET', KEYS[1], 'state', 'in_progress', 'worker', ARGV[3])
  redis.call('HINCRBY', KEYS[1], 'attempts', 1)
end
return 'ok'
"""

_FINISH = """
local st = redis.call('HGET', KEYS[1], 'state')
if not st or st == 'completed' or st == 'failed' or st == 'cancelled' or st == 'expired' then return 0 end
local state, now, ttl = ARGV[1], ARGV[2], ARGV[3]
if ARGV[4] ~= '' then redis.call('SET', KEYS[2], ARGV[4], 'EX', ttl) end
redis.call('HSET', KEYS[1], 'state', state, state .. '_at', now)
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[5]) end
redis.call('EXPIRE', KEYS[1], ttl)
local batch = redis.call('HGET', KEYS[1], 'batch_key')
if batch then
  redis.call('HINCRBY', batch, state, 1)
  local done = redis.call('HINCRBY', batch, 'done', 1)
  if done >= tonumber(redis.call('HGET', batch, 'total')) then
    redis.call('HSET', batch, 'state', 'completed', 'completed_at', now)
    redis.call('EXPIRE', batch, ttl)
    redis.call('EXPIRE', redis.call('HGET', batch, 'jobs_key'), ttl)
    redis.call('PUBLISH', redis.call('HGET', batch, 'done_channel'), 'completed')
  end
end
if redis.call('HGET', KEYS[1], 'stream') == '1' then
  redis.call('XADD', KEYS[3], '*', 'type', 'end', 'state', state)
  redis.call('EXPIRE', KEYS[3], ttl)
end
redis.call('PUBLISH', ARGV[6], state)
return 1
"""

_CANCEL = """
local st = redis.call('HGET', KEYS[1], 'state')
if st == 'queued' or st == 'in_progress' then
  redis.call('HSET', KEYS[1], 'state', 'cancelling', 'cancel_requested_at', ARGV[1])
end
return st or 'missing'
"""


_REQUEUE = """
if redis.call('HGET', KEYS[1], 'state') == 'in_progress' then
  redis.call('HSET', KEYS[1], 'state', 'queued')
  return 1
end
return 0
"""


def now() -> float:
    return round(time.time(), 6)


class JobStore:
    def __init__(self, client: redis.Redis, names: Names, result_ttl_s: int) -> None:
        self.r = client
        self.names = names
        self.ttl = result_ttl_s
        self._admit = client.register_script(_ADMIT)
        self._finish = client.register_script(_FINISH)
        self._cancel = client.register_script(_CANCEL)
        self._requeue = client.register_script(_REQUEUE)

    def get(self, job_id: str) -> dict[str, str]:
        return self.r.hgetall(self.names.job(job_id))

    def state(self, job_id: str) -> str | None:
        return self.r.hget(self.names.job(job_id), "state")

    def update(self, job_id: str, **fields) -> None:
        self.r.hset(self.names.job(job_id), mapping={k: _field(v) for k, v in fields.items()})

    def admit(self, job_id: str, worker: str | None = None) -> str:
        """'ok' if the job may proceed (with ``worker``: mark it in_progress, count an attempt), else its state."""
        return self._admit(keys=[self.names.job(job_id)], args=[now(), "1" if worker else "0", worker or ""])

    def finish(self, job_id: str, state: JobState, result: dict | None = None, error: dict | None = None) -> bool:
        """Move a job to a terminal state, once. Returns False if it already was in one."""
        assert state.is_terminal
        n = self.names
        return bool(self._finish(
            keys=[n.job(job_id), n.result(job_id), n.stream(job_id)],
            args=[state.value, now(), self.ttl, json.dumps(result) if result is not None else "",
                  json.dumps(error) if error is not None else "", n.done_channel(job_id)]))

    def request_cancel(self, job_id: str) -> str:
        """Mark a queued or running job 'cancelling'. Returns the state it was in ('missing' if unknown)."""
        return self._cancel(keys=[self.names.job(job_id)], args=[now()])

    def settle(self, job_id: str, verdict: str) -> None:
        """Act on an ``admit`` verdict other than 'ok': a job that cannot proceed ends here."""
        if verdict == JobState.CANCELLING:
            self.finish(job_id, JobState.CANCELLED)
        elif verdict == JobState.EXPIRED:
            error = RequestError("the job was not started before it expired", code="expired")
            self.finish(job_id, JobState.EXPIRED, error=error.to_dict())

    def requeue(self, job_id: str) -> None:
        """A running job handed back to the queue (worker shutting down) is 'queued' again."""
        self._requeue(keys=[self.names.job(job_id)])

    def result(self, job_id: str) -> dict | None:
        raw = self.r.get(self.names.result(job_id))
        return json.loads(raw) if raw else None


def _field(value) -> str | int | float:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return value
