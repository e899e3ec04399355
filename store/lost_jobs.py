"""The last safety net: an accepted job whose message was lost is sent again.

Leases (``transport``) return the messages a dead worker *held*.  Two gaps
remain where a job has no message anywhere: kombu pops a message from its
queue (BRPOP) and only then records it in the ``unacked`` hash, so a worker
killed between the two loses it; and a producer killed between writing a job
and sending its message leaves a job nobody will run.  Either would leave the
job queued or in progress forever.

So every accepted job is in the active-jobs set until it ends (the create and
finish scripts of ``jobs``), with its preprocess message kept beside it.  A
sweep, run by one process at a time every ``interval_s`` seconds, compares
the active jobs older than one interval with the jobs named by the messages
in every queue list and in ``unacked``.  A job missing from two sweeps in a
row (a message is between those places for milliseconds, not seconds) is put
back to ``queued`` and its preprocess message sent again; preprocessing and
generation then run as for a new job, and ``finish`` still publishes once.
A job sent again ``max_resends`` times ends failed with code ``lost``.

Counting comes first: while the queues and ``unacked`` hold at least as many
messages as there are active jobs, nothing can be missing and no message is read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable

from pagedq.config.messages import PreprocessJob, RequestError
from pagedq.config.names import JobState
from pagedq.store.jobs import JobStore, now
from pagedq.store.transport import job_id_of

log = logging.getLogger("pagedq.lost_jobs")

# KEYS: job hash, its message. ARGV: now, max resends.
# Returns the message to send, 'gone' (no record), 'ended', 'give_up' or 'no_message'.
_RESEND = """
local st = redis.call('HGET', KEYS[1], 'state')
if not st then return 'gone' end
if st ~= 'queued' and st ~= 'in_progress' and st ~= 'cancelling' then return 'ended' end
local message = redis.call('GET', KEYS[2])
if not message then return 'no_message' end
if redis.call('HINCRBY', KEYS[1], 'resent', 1) > tonumber(ARGV[2]) then return 'give_up' end
if st == 'in_progress' then redis.call('HSET', KEYS[1], 'state', 'queued') end
redis.call('HSET', KEYS[1], 'resent_at', ARGV[1])
return message
"""

Send = Callable[[PreprocessJob, int], None]  # (the job's preprocess message, its pagedq priority)


class LostJobSweep:
    def __init__(self, store: JobStore, send: Send, interval_s: float, owner: str, max_resends: int = 3) -> None:
        self.store, self.r, self.names = store, store.r, store.names
        self.send = send
        self.interval_s = interval_s
        self.owner = owner
        self.max_resends = max_resends
        self._resend = self.r.register_script(_RESEND)

    def sweep(self) -> list[str]:
        """One sweep (if no other process swept within the interval); returns the jobs sent again."""
        if not self.r.set(self.names.sweep_lock, self.owner, nx=True, px=int(self.interval_s * 900)):
            return []
        lists = list(self.r.scan_iter(match=self.names.broker_list_pattern, count=1000, _type="list"))
        if self._message_count(lists) >= self.r.zcard(self.names.active_jobs):
            self.r.delete(self.names.lost_suspects)
            return []
        old = self.r.zrangebyscore(self.names.active_jobs, "-inf", now() - self.interval_s)
        held = self._jobs_with_a_message(lists)
        missing = {job for job in old if job not in held}
        before = self.r.smembers(self.names.lost_suspects)
        confirmed = sorted(missing & before)
        with self.r.pipeline() as pipe:
            pipe.delete(self.names.lost_suspects)
            if missing - before:
                pipe.sadd(self.names.lost_suspects, *(missing - before))
                pipe.expire(self.names.lost_suspects, int(self.interval_s * 3) + 1)
            pipe.execute()
        return [job for job in confirmed if self._send_again(job)]

    def _message_count(self, lists: list[str]) -> int:
        with self.r.pipeline(transaction=True) as pipe:
            for key in lists:
                pipe.llen(key)
            pipe.hlen(self.names.unacked)
            return sum(pipe.execute())

    def _jobs_with_a_message(self, lists: list[str]) -> set[str]:
        held: set[str] = set()
        for raw in self._messages(lists):
            try:
                payload = json.loads(raw)
            except ValueError:
                continue
            if isinstance(payload, list) and payload:  # unacked: [payload, exchange, routing key]
                payload = payload[0]
            job = job_id_of(payload) if isinstance(payload, dict) else None
            if job is not None:
                held.add(job)
        return held

    def _messages(self, lists: list[str]) -> Iterable[str]:
        for key in lists:
            yield from self.r.lrange(key, 0, -1)
        yield from self.r.hvals(self.names.unacked)

    def _send_again(self, job_id: str) -> bool:
        n = self.names
        verdict = self._resend(keys=[n.job(job_id), n.job_message(job_id)], args=[now(), self.max_resends])
        if verdict in ("gone", "ended"):
            self.r.zrem(n.active_jobs, job_id)
            return False
        if verdict in ("give_up", "no_message"):
            why = ("its message was lost and sent again too often" if verdict == "give_up"
                   else "its message was lost and none was kept to send again")
            log.error("job %s: %s; failed", job_id, why)
            self.store.finish(job_id, JobState.FAILED, error=RequestError(why, code="lost").to_dict())
            return False
        priority = int(self.r.hget(n.job(job_id), "priority") or 0)
        log.warning("job %s had no message on any queue or worker; sent again", job_id)
        self.send(PreprocessJob(**json.loads(verdict)), priority)
        return True
