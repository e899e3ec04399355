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
also puts its job back to ``queued`` in the same transaction, once; a restored
fair-dispatch token (``pagedq.dispatch``) does the same to the job bound to its
slot, and puts that job back into its model's fair queue (``FairDispatch.release``),
also in the same transaction: the token returns unbound, its job waits in line.

One clock: every lease time is Redis's ``TIME``, read inside the script that
writes or judges it, never a host's own clock (a host whose clock runs ahead
would otherwise restore everyone's messages).  Invariants:

- A tag is restored only if, inside the restore's transaction (``WATCH`` on the
  index), its lease is still expired by Redis time: a tag renewed meanwhile stays.
- Leases are judged only over time the broker was serving: every lease call
  stamps ``names.lease_clock``; a call that finds no stamp for ``lease / 2``
  seconds (the broker was down or paused, or no consumer ran) records that the
  broker came back (``resumed``), and nothing is restored until a full lease has
  passed since then, long enough for every live worker to renew first.
- A consumer renews its own leases before it looks for expired ones.
- A message goes back on its queue under a new delivery tag.  kombu keeps the
  old one, so a worker that froze past its lease and then woke would ack (or
  renew) the tag of the copy another worker now runs: its ack would delete
  that copy from ``unacked`` while it runs, and the lost-job sweep, finding
  the job's message nowhere, would send it a second time.

Handover: a connection lost (a broker crash, a Sentinel failover) closes the
channel its messages were taken on, while their tasks keep running.  kombu
would put every one of them back on its queue at the close (a second run of
each task still running) or, with the broker gone, leave them to expire (the
running ones redelivered a lease later, the rest waiting as long).  Here the
close puts back only the messages of tasks the process is not running (those
Celery took but had not started, and drops), and hands the rest to the
process's next live channel, which renews their leases until their tasks end.
An acknowledgement (or reject, or restore) that cannot reach the broker is
kept and done by the next renewal that can, on whichever channel.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from queue import Empty

import redis
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from pagedq.config.names import DISPATCH_TASK, GENERATE_TASK, POSTPROCESS_TASK, PREPROCESS_TASK, Names
from pagedq.store.dispatch import _RELEASE

log = logging.getLogger("pagedq.transport")

PAGEDQ_TASKS = (PREPROCESS_TASK, GENERATE_TASK, POSTPROCESS_TASK)
_MALFORMED = (ValueError, KeyError, TypeError, AttributeError, IndexError)

# KEYS: job. A running job whose message goes back on its queue is queued again; ``restored_from`` names the
# worker it was taken from (store/jobs.py ``admit`` counts no attempt while that worker is alive).
_REQUEUE_JOB = """
if redis.call('HGET', KEYS[1], 'state') == 'in_progress' then
  local t = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'state', 'queued', 'requeued_at', string.format('%d.%06d', t[1], t[2]),
             'restored_from', redis.call('HGET', KEYS[1], 'worker') or '')
  redis.call('HINCRBY', KEYS[1], 'redeliveries', 1)
end
return 0
"""

# KEYS: a token's slot. ARGV: the job-key prefix.  _REQUEUE_JOB for the job the slot is bound to, if any.
_REQUEUE_BOUND_JOB = """
local id = redis.call('GET', KEYS[1])
if not id then return 0 end
local job = ARGV[1] .. id
if redis.call('HGET', job, 'state') == 'in_progress' then
  local t = redis.call('TIME')
  redis.call('HSET', job, 'state', 'queued', 'requeued_at', string.format('%d.%06d', t[1], t[2]),
             'restored_from', redis.call('HGET', job, 'worker') or '')
  redis.call('HINCRBY', job, 'redeliveries', 1)
end
return 1
"""

# Shared head of the lease scripts. KEYS[1]: unacked_index, KEYS[2]: the lease clock. ARGV[1]: the lease,
# ARGV[2]: the gap (seconds without any lease call) after which the broker counts as having come back.
# Sets ``now`` (Redis time) and ``resumed`` (when the broker last came back).
_CLOCK = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local seen = tonumber(redis.call('HGET', KEYS[2], 'seen') or '0')
if now - seen > tonumber(ARGV[2]) then redis.call('HSET', KEYS[2], 'resumed', string.format('%.6f', now)) end
redis.call('HSET', KEYS[2], 'seen', string.format('%.6f', now))
local resumed = tonumber(redis.call('HGET', KEYS[2], 'resumed') or '0')
"""

# ARGV[3]: tag, ARGV[4]: the message. A message taken: its lease starts now.
_TAKE = _CLOCK + """
redis.call('ZADD', KEYS[1], string.format('%.6f', now), ARGV[3])
redis.call('HSET', KEYS[3], ARGV[3], ARGV[4])
return 1
"""

# ARGV[3..]: tags. Renews the leases of the tags still held (XX: a restored tag stays restored).
_RENEW = _CLOCK + """
local n = 0
for i = 3, #ARGV do n = n + redis.call('ZADD', KEYS[1], 'XX', 'CH', string.format('%.6f', now), ARGV[i]) end
return n
"""

# ARGV[3]: at most this many tags (0: all). The tags whose lease expired by Redis time, oldest first.
_DUE = _CLOCK + """
if now - resumed < tonumber(ARGV[1]) then return {} end
local limit = tonumber(ARGV[3])
if limit > 0 then
  return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', now - tonumber(ARGV[1])), 'LIMIT', 0, limit)
end
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', now - tonumber(ARGV[1])))
"""

# KEYS[1]: unacked_index, KEYS[2]: the lease clock. ARGV: the lease, the tag. 1 if the tag's lease is expired
# by Redis time now (read-only: run inside the restore's WATCH, so a renewal before EXEC aborts it).
_STILL_DUE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
local resumed = tonumber(redis.call('HGET', KEYS[2], 'resumed') or '0')
local lease = tonumber(ARGV[1])
if score and tonumber(score) <= now - lease and now - resumed >= lease then return 1 end
return 0
"""


def body_of(payload: dict) -> dict | None:
    """The first argument of a task message (pagedq's tasks take one dict), or None."""
    try:
        body = payload["body"]
        if payload["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        message = json.loads(body)[0][0]
        return message if isinstance(message, dict) else None
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def slot_of(payload: dict) -> str | None:
    """The slot a fair-dispatch token names, or None for any other message."""
    try:
        if payload["headers"]["task"] != DISPATCH_TASK:
            return None
    except (KeyError, TypeError):
        return None
    body = body_of(payload)
    return str(body["slot"]) if body and body.get("slot") else None


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


def running_tags() -> set[str]:
    """The delivery tags of the tasks this process runs now and goes on running (Celery's active requests; none
    outside a worker, none once it is stopping: kombu's restore at the close then puts them all back)."""
    from celery.worker import state  # imported when first needed: producers use this transport too

    if any(flag is not None and flag is not False for flag in (state.should_stop, state.should_terminate)):
        return set()  # (a warm stop sets 0)
    for _ in range(10):
        try:
            return {r.message.delivery_tag for r in list(state.active_requests)}
        except RuntimeError:  # the set changed while it was copied (a task started or ended): read again
            continue
    return {r.message.delivery_tag for r in list(state.active_requests)}


class Handover:
    """What a process's channels could not settle with the broker, until one of its live channels does.

    Two kinds: *deferred* settlements (an ack, reject or restore that hit a broker error, with the channel that
    took the message), and the messages of a *closed* channel whose tasks were still running at its close.
    Invariant: a message is in ``unacked`` until a settlement reaches the broker; the running ones' leases are
    renewed by every live renewal until their tasks end (their ack is then deferred, and done at the next one).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deferred: dict[str, str] = {}  # tag -> "ack" | "requeue" | "restore"
        self._closed: set[LeaseQoS] = set()  # QoS of closed channels still holding running tasks' messages

    def defer(self, tag: str, how: str) -> None:
        with self._lock:
            self._deferred[tag] = how

    def hold(self, qos: LeaseQoS) -> None:
        with self._lock:
            self._closed.add(qos)

    def take_over(self, live: LeaseQoS, client) -> list[str]:
        """Through ``client`` (a live channel's, whose ``live`` QoS does the work): do the deferred settlements,
        put back the closed channels' messages whose tasks ended without an ack; returns the tags still held by
        running tasks, for renewal.  A broker error leaves the rest for the next call."""
        with self._lock:
            deferred, self._deferred = self._deferred, {}
            closed = list(self._closed)
        try:
            while deferred:
                tag, how = next(iter(deferred.items()))
                live.settle(tag, how, client)
                del deferred[tag]
        finally:
            with self._lock:
                self._deferred.update(deferred)
        running, held = running_tags(), []
        for qos in closed:
            qos._flush()  # acknowledged tags out of ``_delivered``
            for tag in list(qos._delivered):
                if tag in running:
                    held.append(tag)
                else:
                    live.settle(tag, "restore", client)
                    qos._delivered.pop(tag, None)
            if not qos._delivered:
                with self._lock:
                    self._closed.discard(qos)
        return held


HANDOVER = Handover()


class LeaseQoS(kombu_redis.QoS):
    """kombu's ack emulation with leases on Redis's clock, and the handover (see the module's docstring)."""

    def ack(self, delivery_tag):
        self._settle_or_defer(delivery_tag, "ack")

    def reject(self, delivery_tag, requeue=False):
        self._settle_or_defer(delivery_tag, "requeue" if requeue else "ack")

    def settle(self, tag: str, how: str, client) -> None:
        """Through ``client``: ``ack`` drops the message ``tag`` from ``unacked``; ``requeue`` puts it back at the
        head of its queue, ``restore`` at its tail (this QoS's channel finds the queue: it must be live)."""
        if how == "ack":
            self._remove_from_indices(tag, client.pipeline()).execute()
        else:
            self.restore_by_tag(tag, client=client, leftmost=how == "requeue")

    def _settle_or_defer(self, tag: str, how: str) -> None:
        if self.channel.closed and tag in self._delivered:  # handed over: the next live renewal settles it
            HANDOVER.defer(tag, how)
        else:
            try:
                with self.channel.conn_or_acquire() as client:
                    self.settle(tag, how, client)
            except self.channel.connection_errors as e:
                log.warning("message %s: %s deferred until the broker answers (%s)", tag, how, e)
                HANDOVER.defer(tag, how)
        virtual.QoS.ack(self, tag)  # no longer this channel's

    def restore_unacked(self, client=None):
        """The channel closes: its messages go back on their queues, but those of tasks this process still runs
        are handed over (see the module's docstring), and with the broker unreachable the rest are deferred."""
        running, reachable = running_tags(), True
        for tag in list(self._delivered):
            if tag in running:
                continue
            if reachable:
                try:
                    with self.channel.conn_or_acquire(client) as c:
                        self.settle(tag, "restore", c)
                except self.channel.connection_errors as e:
                    log.warning("the broker is unreachable: messages not running here are put back later (%s)", e)
                    reachable = False
            if not reachable:
                HANDOVER.defer(tag, "restore")
            self._delivered.pop(tag, None)
        if self._delivered:
            log.info("%d messages of running tasks handed over to the next connection", len(self._delivered))
            HANDOVER.hold(self)

    def append(self, message, delivery_tag):
        delivery = message.delivery_info
        raw = dumps([message._raw, delivery["exchange"], delivery["routing_key"]])
        with self.channel.conn_or_acquire() as client:
            self.channel.lease_call(client, _TAKE, [delivery_tag, raw], extra_keys=[self.channel.unacked_key])
        virtual.QoS.append(self, message, delivery_tag)  # kombu's own bookkeeping, without its local-clock ZADD

    def restore_visible(self, start=0, num=10, interval=10):
        self._vrestore_count += 1
        if (self._vrestore_count - 1) % (interval or 1):
            return
        self.channel.renew_leases()  # this consumer's own messages are never among the expired
        with self.channel.conn_or_acquire() as client:
            try:
                with kombu_redis.Mutex(client, self.unacked_mutex_key, self.unacked_mutex_expire):
                    for tag in self.channel.lease_call(client, _DUE, [num or 0]):
                        self.restore_if_expired(tag, client)
            except kombu_redis.MutexHeld:
                pass

    def restore_if_expired(self, tag: str, client) -> bool:
        """Put the message ``tag`` back on its queue if its lease is expired, checked inside the transaction."""
        channel, restored = self.channel, False

        def restore_transaction(pipe):
            nonlocal restored
            restored = False
            raw = pipe.hget(self.unacked_key, tag)
            keys = [channel.full_key(self.unacked_index_key), channel.lease_clock_key]
            if not raw or not pipe.eval(_STILL_DUE, len(keys), *keys, channel.visibility_timeout, tag):
                return  # acknowledged, restored by another consumer, or renewed: nothing to do
            pipe.multi()
            self._remove_from_indices(tag, pipe)
            payload, exchange, routing_key = json.loads(raw)
            channel._do_restore_message(payload, exchange, routing_key, pipe)
            restored = True

        client.transaction(restore_transaction, self.unacked_key, self.unacked_index_key)
        return restored


class Channel(kombu_redis.Channel):
    QoS = LeaseQoS

    def _brpop_read(self, **options):
        try:
            return super()._brpop_read(**options)
        except _MALFORMED as e:
            log.error("dropped a malformed message (not a kombu JSON envelope): %s: %s", type(e).__name__, e)
            return True

    def _connparams(self, asynchronous=False):
        """A channel whose connection is gone raises a connection error, as any other use of a dead broker.

        After a broker error Celery collects the consumer's connection (the transport's client is dropped,
        a closed channel's connection too) and opens a new one; a channel closed then, or a task delivered on
        it that ends later, restores or acknowledges its messages through a pool rebuilt from that connection.
        kombu raised AttributeError there, which Celery takes as unrecoverable: the worker stopped consuming
        for good (its jobs sat ``queued`` once their leases ran out).  As a connection error it is logged
        and passed over; the messages stay in ``unacked``, no longer renewed, and a live consumer restores them
        when their lease runs out (a copy of a job that already ended is skipped).
        """
        if self.connection is None or self.connection.client is None:
            raise redis.exceptions.ConnectionError("this channel's broker connection was closed")
        return super()._connparams(asynchronous=asynchronous)

    def _get(self, queue):
        try:
            return super()._get(queue)
        except _MALFORMED as e:
            log.error("dropped a malformed message from %s: %s: %s", queue, type(e).__name__, e)
            raise Empty() from None

    def _create_client(self, asynchronous=False):
        """One synchronous client per connection pool, reused: kombu built a new ``redis.Redis`` (and its
        ~170-entry callback table) for every publish, ack and lease call.  A client is thread-safe (each
        command takes a connection from the pool); a new pool (after a broker error) gets a new client."""
        if asynchronous:
            return super()._create_client(asynchronous=True)
        pool = self.pool
        cached = getattr(self, "_sync_client", None)
        if cached is None or cached[0] is not pool:
            cached = self._sync_client = (pool, super()._create_client())
        return cached[1]

    def full_key(self, key: str) -> str:
        """``key`` with the deployment's prefix: EVAL is not key-prefixed by kombu, so its keys are given whole."""
        return f"{self.global_keyprefix or ''}{key}"

    @property
    def lease_clock_key(self) -> str:
        return Names(key_prefix=self.global_keyprefix or "").lease_clock

    def lease_call(self, client, script: str, args: list, extra_keys: list[str] = ()):
        """Run a lease script (``_CLOCK`` + ...) with this channel's keys, lease and resume gap."""
        keys = [self.full_key(self.unacked_index_key), self.lease_clock_key, *map(self.full_key, extra_keys)]
        lease = float(self.visibility_timeout)
        return client.eval(script, len(keys), *keys, lease, lease / 2, *args)

    def _do_restore_message(self, payload, exchange, routing_key, pipe, leftmost=False):
        payload["properties"]["delivery_tag"] = self._next_delivery_tag()  # the old tag is its last holder's
        super()._do_restore_message(payload, exchange, routing_key, pipe, leftmost)
        names = Names(key_prefix=self.global_keyprefix or "")
        job_id = job_id_of(payload, (GENERATE_TASK,))
        if job_id is not None:
            pipe.eval(_REQUEUE_JOB, 1, names.job(job_id))
        slot = slot_of(payload)
        if slot is not None:  # its job: queued (counted as a redelivery), then back in its fair queue, unbound
            pipe.eval(_REQUEUE_BOUND_JOB, 1, names.slot(slot), names.job(""))
            pipe.eval(_RELEASE, 2, names.slot(slot), names.fair_index, slot, names.job(""), names.fair_message(""))

    def renew_leases(self) -> int:
        """Mark every message this channel holds, and every message handed over to it, as taken now (Redis
        time); returns how many.  Does what the handover waits for first.  Also stamps the lease clock when it
        holds none, so the broker's being reachable is recorded."""
        with self.conn_or_acquire() as client:
            tags = list(self.qos._delivered) + HANDOVER.take_over(self.qos, client)
            return int(self.lease_call(client, _RENEW, tags))


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


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The hardened channel over Redis Sentinel: kombu's Sentinel channel finds the master the sentinels name
    (``master_name``, ``sentinel_kwargs`` from the transport options) for every new connection; this module's
    channel adds what it adds to any (garbage dropped, leases, restores that requeue their jobs).  None of the
    methods ours overrides is one kombu's Sentinel channel defines, so the two combine."""

    QoS = LeaseQoS


class SentinelTransport(Transport):
    """``sentinel://`` URLs (Celery's form: one per sentinel, joined with ``;``)."""

    Channel = SentinelChannel
    default_port = 26379

