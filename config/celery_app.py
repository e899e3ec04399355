"""Celery's configuration, derived from Settings.

- JSON only on the wire: pickle is never accepted.
- ``acks_late`` + ``worker_prefetch_multiplier=1``: a worker reserves only as
  many messages as it can serve at once, and acknowledges each when its task
  is done, so a worker that dies takes nothing with it.
- Priority: kombu's Redis transport keeps one list per priority step and pops
  the lowest number first (0 = most urgent), the reverse of pagedq's 0-9 scale
  where 9 is most urgent; producers send ``names.broker_priority(p) = 9 - p``.
- Leases: a message a worker took and has not acknowledged is the worker's
  lease on its job.  The hardened transport renews the leases of every
  message a live worker holds every ``lease / 4`` seconds, and every consumer
  puts back on its queue any message whose lease ran out (its worker died):
  within ``lease`` + ``lease / 3`` seconds of a kill, however long the job runs
  on a live worker.  ``lease`` = min(``PAGEDQ_WORKER_TTL_S``,
  ``PAGEDQ_VISIBILITY_TIMEOUT_S``), the same TTL as a worker's heartbeat record.
  Lease times are Redis's ``TIME``, never a host's clock (``store/transport.py``).
- Events on, so Flower sees every task.
- The Redis transport is kombu's, hardened so garbage pushed onto a queue is
  logged and dropped instead of stopping the worker (``pagedq.store.transport``,
  named here by its import path: kombu loads it).
- Routes: ``task_routes`` sends each task to its queue (generate, and the
  fair-dispatch token, by the model named in its message), so no call site
  names a queue.
"""

from __future__ import annotations

import ssl
import time
import uuid
from dataclasses import dataclass

from celery import Celery
from kombu.transport import TRANSPORT_ALIASES

from pagedq.config.messages import PreprocessJob, to_json
from pagedq.config.names import (
    DISPATCH_TASK,
    GENERATE_TASK,
    KOMBU_PRIORITY_SEP,
    POSTPROCESS_TASK,
    PREPROCESS_TASK,
    PRIORITY_STEPS,
    Names,
    broker_priority,
)
from pagedq.config.sentinel import parse_sentinel_url, sentinel_kwargs
from pagedq.config.settings import Settings

TRANSPORT = "pagedq.store.transport:Transport"
SENTINEL_TRANSPORT = "pagedq.store.transport:SentinelTransport"


class TaskRouter:
    """Celery router: each pagedq task to its queue; generate, and dispatch tokens, to their model's queue."""

    def __init__(self, names: Names) -> None:
        self.names = names

    def __call__(self, name, args, kwargs, options, task=None, **kw):
        if name == PREPROCESS_TASK:
            return {"queue": self.names.preprocess_queue}
        if name == POSTPROCESS_TASK:
            return {"queue": self.names.results_queue}
        if name in (GENERATE_TASK, DISPATCH_TASK) and args and isinstance(args[0], dict):
            return {"queue": self.names.generate_queue(str(args[0].get("model", "")))}
        return None


def broker_ssl(settings: Settings) -> dict:
    """kombu's TLS options for a ``rediss://`` broker: the server's certificate is always verified."""
    options: dict = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_check_hostname": True}
    for key, value in (("ssl_ca_certs", settings.redis_ca_file), ("ssl_certfile", settings.redis_cert_file),
                       ("ssl_keyfile", settings.redis_key_file)):
        if value is not None:
            options[key] = str(value)
    return options


def message_lease_s(settings: Settings) -> float:
    return min(settings.worker_ttl_s, settings.visibility_timeout_s)


_REAL_TIME = time.time


def apply_clock_offset(offset_s: float) -> None:
    """Tests only (``PAGEDQ_CLOCK_OFFSET_S``): this process's ``time.time`` runs ``offset_s`` seconds ahead, as
    on a host whose clock is off; modules that import ``time`` from ``time`` afterwards (kombu's Redis transport,
    loaded at the first connection) get the shifted clock too."""
    if offset_s:
        time.time = lambda: _REAL_TIME() + offset_s


def celery_config(settings: Settings, url: str) -> dict:
    names = Names.from_settings(settings)
    lease = message_lease_s(settings)
    return dict(
        broker_url=url,
        **({"broker_use_ssl": broker_ssl(settings)} if url.startswith("rediss://") else {}),
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            "priority_steps": PRIORITY_STEPS,
            "sep": KOMBU_PRIORITY_SEP,
            "queue_order_strategy": "priority",
            "visibility_timeout": lease,
            # Renewals every lease / 4: a live worker renews well within the lease, and a broker pause
            # shorter than lease / 2 (after which leases restart: store/transport.py) cannot expire it.
            "lease_renew_interval": max(lease / 4, 0.5),
            # Sweep for expired leases every few seconds (kombu's default is ~100 s).
            "unacked_restore_interval": max(lease / 3, 0.5),
            "unacked_restore_throttle": 1,
            # The restore pass's lock lasts a lease, not kombu's 300 s: one left by a restorer killed mid-pass
            # (or kept by the append-only file across a broker crash) would stop every restore that long.
            # Two passes at once are safe anyway: each tag is re-checked inside its own transaction.
            "unacked_mutex_expire": max(lease, 1),
            "global_keyprefix": settings.key_prefix,
            **sentinel_options(settings, url),
        },
        accept_content=["json"],
        result_accept_content=["json"],
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # Running tasks go on through a lost broker connection (their messages are handed over to the next
        # one: store/transport.py); Celery 5's default, said explicitly (6.0 plans to cancel them).
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,  # results live in pagedq's own keys, written atomically
        task_default_queue=names.default_queue,
        task_routes=(TaskRouter(names),),
        task_default_priority=broker_priority(settings.default_priority),
        event_exchange=names.event_exchange,
        control_exchange=names.control_exchange,
        worker_send_task_events=True,
        task_send_sent_event=True,
        worker_disable_rate_limits=True,
    )


def sentinel_options(settings: Settings, url: str) -> dict:
    """With a ``sentinel://`` URL: the master's name, how to reach the sentinels, and socket timeouts and
    keepalive on every broker connection, so a master that stops answering without closing its sockets turns
    into a connection error and a new master is asked for (celery/celery#6348)."""
    address = parse_sentinel_url(url)
    if address is None:
        return {}
    return {"master_name": settings.redis_master_name, "sentinel_kwargs": sentinel_kwargs(settings, address),
            "socket_timeout": 30, "socket_connect_timeout": 5, "socket_keepalive": True,
            "health_check_interval": 25}


def use_hardened_transport() -> None:
    """redis://, rediss:// and sentinel:// URLs select the hardened transport in this process.

    Through the URL scheme rather than Celery's ``broker_transport``, so the broker URI keeps its
    ``redis`` scheme for everything that reads it (Flower's Broker page and queue lengths).
    """
    TRANSPORT_ALIASES.update(redis=TRANSPORT, rediss=TRANSPORT, sentinel=SENTINEL_TRANSPORT)


def make_celery(settings: Settings, url: str, main: str = "pagedq") -> Celery:
    use_hardened_transport()
    apply_clock_offset(settings.clock_offset_s)
    app = Celery(main, set_as_current=False)
    app.conf.update(celery_config(settings, url))
    return app


BULK_FIRST_LINES = 16  # a batch's first lines go one broker step below their priority; each x4 more, one step lower


def bulk_step(priority: int, line: int) -> int:
    """kombu step of a batch's line number ``line`` (0-based): lines 0-15 one step below the priority's, 16-63
    two, 64-255 three, 256-1,023 four, the rest five (never past 9).  The CPU worker takes the lowest step
    first, so a batch sent behind another has its first lines tokenized (and claimable: fair dispatch sees
    the tenant) before the other's tail, instead of after all of it; a single request, one step above any
    batch line of its priority, goes before both."""
    depth, bound = 1, BULK_FIRST_LINES
    while line >= bound and depth < 5:
        depth, bound = depth + 1, bound * 4
    return min(broker_priority(priority) + depth, 9)


class BufferedSentEvents:
    """``send_task(..., event_dispatcher=BufferedSentEvents(d))``: the ``task-sent`` event goes into the task
    buffer of the event dispatcher ``d`` (one made with ``buffer_group=["task"]``) and out with the events
    around it, in one broker message, when ``d`` flushes, instead of a PUBLISH of its own (Celery's way).
    Flower, like any ``EventReceiver``, unpacks the list."""

    def __init__(self, dispatcher) -> None:
        self.dispatcher = dispatcher

    def publish(self, type: str, fields: dict, producer, retry: bool = False, retry_policy=None) -> None:
        self.dispatcher.send(type, **fields)


def send_preprocess(app: Celery, msg: PreprocessJob, priority: int, line: int | None = None,
                    event_dispatcher=None, payload: dict | None = None) -> None:
    """Send a job's preprocess message: the producer's send, and the lost-job sweep's resend.  ``line`` (a batch's
    line number): its broker step is ``bulk_step``; the job's band in the fair queue is its
    priority all the same.  ``event_dispatcher``: where its ``task-sent`` event goes (``BufferedSentEvents``;
    None: published at once); ``payload``: ``to_json(msg)`` when the caller has it already."""
    step = broker_priority(priority) if line is None else bulk_step(priority, line)
    args = [payload if payload is not None else to_json(msg)]
    app.send_task(PREPROCESS_TASK, args=args, priority=step, argsrepr=msg.describe(), kwargsrepr="{}",
                  event_dispatcher=event_dispatcher)


@dataclass(frozen=True)
class DispatchToken:
    """A fair-dispatch token: "run a job of ``model``", on the model's generate queue at a job's broker priority.

    It names no job: the GPU worker that runs it claims the next job of the model's fair queue in fleet order
    when its engine has room, binding it to ``slot`` (``store/dispatch.py``).  One token is sent per job pushed;
    a token that finds nothing to claim ends.  ``slot`` is unique per token and survives redelivery, so a token
    restored from a dead worker still names the job it was bound to."""

    model: str
    slot: str
    priority: int
    tenant: str | None = None  # the tenant of the job it was sent for (None: a spare, or an older sender's)

    def describe(self) -> str:
        return f"model={self.model} priority={self.priority} slot={self.slot} (binds a job when it runs)"


def send_dispatch_token(app: Celery, model: str, priority: int, slot: str | None = None,
                        queue: str | None = None, event_dispatcher=None, tenant: str | None = None) -> DispatchToken:
    """Send one token for a job of ``model`` pushed into its fair queue: the preprocess's send, the lost-job
    sweep's top-up, and a worker with no free seat handing an unbound token on (with a fresh slot: a kill between
    that send and the old token's ack must not leave two tokens sharing one slot).  ``queue``: instead of the
    model's queue (placement's nudge to one worker, ``Names.worker_queue``).  ``event_dispatcher``: where its
    ``task-sent`` event goes (as for ``send_preprocess``).  ``tenant``: of the job it is sent for (a full worker
    uses it to skip a claim beyond its seats that job could not win)."""
    token = DispatchToken(model, slot or uuid.uuid4().hex, priority, tenant)
    body = {"model": model, "slot": token.slot, "priority": priority}
    if tenant is not None:
        body["tenant"] = tenant
    app.send_task(DISPATCH_TASK, args=[body],
                  priority=broker_priority(priority), argsrepr=token.describe(), kwargsrepr="{}",
                  event_dispatcher=event_dispatcher, **({"queue": queue} if queue else {}))
    return token
