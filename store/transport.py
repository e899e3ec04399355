"""kombu's Redis transport, hardened: garbage on a queue is dropped, and unacked messages are leases.

Garbage: stock kombu decodes each popped list item inside the worker's event
loop; an item that is not JSON, or JSON without a message envelope's fields,
raises there and takes the whole worker down.  This channel logs such an item
and drops it (it was already popped), and the worker carries on.  Envelopes
that are well formed but carry a bad body (wrong content type, pickle,
unknown task, wrong arguments) are Celery's to reject, and it logs them too.

Leases: kombu keeps every message a consumer took and has not acknowledged in
the ``unacked`` hash, with the time it was taken in ``unacked_index``; every
consumer periodically puts back on its queue any message older than the
visibility timeout.  Here a live consumer renews the time of every message it
holds every ``lease_renew_interval`` seconds, so the visibility timeout is a
*lease*: a message is redelivered only when the worker holding it stopped
renewing (it died), however long its job runs.  A restored generate message
also puts its job back to ``queued`` in the same transaction, once.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from queue import Empty

from kombu.transport import redis as kombu_redis

from pagedq.config.names import GENERATE_TASK, POSTPROCESS_TASK, PREPROCESS_TASK, Names

log = logging.getLogger("pagedq.transport")

PAGEDQ_TASKS = (PREPROCESS_TASK, GENERATE_TASK, POSTPROCESS_TASK)
_MALFORMED = (ValueError, KeyError, TypeError, AttributeError, IndexError)

# KEYS: job. A running job whose message goes back on its queue is queued again.
_REQUEUE_JOB = """
if redis.call('HGET', KEYS[1], 'state') == 'in_progress' then
  redis.call('HSET', KEYS[1], 'state', 'queued', 'requeued_at', ARGV[1])
  redis.call('HINCRBY', KEYS[1], 'redeliveries', 1)
end
return 0
"""


def job_id_of(payload: dict, tasks: tuple[str, ...] = PAGEDQ_TASKS) -> str | None:
    """The job id in the body of a pagedq message of one of ``tasks``, or None for any other message."""
    try:
        if payload["headers"]["task"] not in tasks:
            return None
        body = payload["body"]
        if payload["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        message = json.loads(body)[0][0]
        return str(message["request_id"] if payload["headers"]["task"] == POSTPROCESS_TASK else message["job_id"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None


class Channel(kombu_redis.Channel):
    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except _MALFORMED as e:
            log.error("dropped a malformed message (not a kombu JSON envelope): %s: %s", type(e).__name__, e)
            return True

    def _get(self, queue):
        try:
            return super()._get(queue)
        except _MALFORMED as e:
            log.error("dropped a malformed message from %s: %s: %s", queue, type(e).__name__, e)
            raise Empty() from None

    def _do_restore_message(self, payload, exchange, routing_key, pipe, leftmost=False):
        super()._do_restore_message(payload, exchange, routing_key, pipe, leftmost)
        job_id = job_id_of(payload, (GENERATE_TASK,))
        if job_id is not None:  # EVAL is not key-prefixed by kombu: the key is given whole
            pipe.eval(_REQUEUE_JOB, 1, Names(key_prefix=self.global_keyprefix).job(job_id), repr(time.time()))

    def renew_leases(self) -> int:
        """Mark every message this channel holds as taken now; returns how many."""
        tags = list(self.qos._delivered)
        if not tags:
            return 0
        now = time.time()
        with self.conn_or_acquire() as client:
            client.zadd(self.unacked_index_key, {tag: now for tag in tags}, xx=True)
        return len(tags)


class Transport(kombu_redis.Transport):
    Channel = Channel

    def register_with_event_loop(self, connection, loop):
        super().register_with_event_loop(connection, loop)
        cycle = self.cycle
        old = getattr(cycle, "_lease_tref", None)
        if old is not None:
            old.cancel()
        interval = connection.client.transport_options.get("lease_renew_interval", 5)
        cycle._lease_tref = loop.call_repeatedly(interval, self._renew_leases)

    def _renew_leases(self) -> None:
        for channel in self.cycle._channels:
            try:
                channel.renew_leases()
            except channel.connection_errors as e:
                log.warning("could not renew message leases: %s", e)  # the next tick tries again
