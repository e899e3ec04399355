"""Running a Celery worker the pagedq way (GPU and CPU workers alike).

The worker's Redis record (``names.worker(hostname)``: role, ready, and who it
is: host, boot id, pid namespace, pid and the pid's start time, ``started_at``)
is kept alive by a heartbeat while the process runs, and marked ``ready`` once
Celery's consumer is up; then Celery's own worker loop runs until shutdown.
A record can outlive its process by up to its TTL (kill -9): ``pagedq up``
reuses a worker only when it can show the process still runs (its pid on this
host, or a fresh heartbeat), see ``pipeline.local.stack``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis
from celery import Celery, signals
from celery.exceptions import Reject
from celery.worker.consumer import Consumer

from pagedq.config.celery_app import BufferedSentEvents
from pagedq.store.registry import Heartbeat
from pagedq.workers.processes import process_identity


class _NoTracebackForRequeues(logging.Filter):
    """A job handed back to its queue (worker stopping) is one log line, not a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], Reject):
            record.exc_info, record.exc_text = None, None
        return True


EVENT_FLUSH_S = 0.25  # a worker's task events wait at most this long to go out, together

_consumer: BatchedEventsConsumer | None = None  # this process's, once Celery has made it


class BatchedEventsConsumer(Consumer):
    """Celery's consumer, its task events published together: at most every ``EVENT_FLUSH_S``.

    Celery buffers a worker's task events (received, started, succeeded, failed, progress) and publishes the
    buffer at the event loop's next turn, or once it holds ``buffer_limit`` (24): with short jobs that is
    nearly one broker message per event, three per task, each a PUBLISH round trip and its encoding on the
    cores the engine computes on.  Here the next turn is ``EVENT_FLUSH_S`` later, so one message carries every
    event of that interval (Flower, like any ``EventReceiver``, unpacks the list; an event that arrives after
    a later state's, such as a ``task-sent`` after the ``task-received``, only fills in fields).  Flower sees
    each event at most that much later, and none is dropped: what is buffered at shutdown goes out first.
    Invariant: while events wait, one flush is scheduled.
    """

    _event_flush_due = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        global _consumer
        _consumer = self

    def on_send_event_buffered(self) -> None:
        # Called by whichever thread sent the event; the hub's timer is touched from the hub's thread only.
        if self.hub and not self._event_flush_due:
            self._event_flush_due = True
            self.hub.call_soon(self._schedule_event_flush)

    def _schedule_event_flush(self) -> None:
        self.hub.call_later(EVENT_FLUSH_S, self._flush_due_events)

    def _flush_due_events(self) -> None:
        self._event_flush_due = False  # first: an event sent during the flush schedules the next one
        self._flush_events()

    def shutdown(self) -> None:
        self._flush_events()
        super().shutdown()


def sent_events() -> BufferedSentEvents | None:
    """``send_task(..., event_dispatcher=sent_events())`` in a worker: the ``task-sent`` event joins the worker's
    buffered task events (``BatchedEventsConsumer``) instead of taking a PUBLISH of its own.  None (Celery's own
    way: published at once) before the consumer exists, or with its events off."""
    dispatcher = _consumer.event_dispatcher if _consumer is not None else None
    return BufferedSentEvents(dispatcher) if dispatcher is not None and dispatcher.enabled else None


def run_celery_worker(app: Celery, r: redis.Redis, record_key: str, record: dict, *, queues: list[str],
                      concurrency: int, hostname: str, loglevel: str = "INFO", ttl_s: int = 15,
                      keep_alive: Sequence[str] = ()) -> None:
    """Run the Celery worker, its record beating every ``ttl_s / 3`` (``keep_alive``: keys that live as long as
    the record)."""
    logging.getLogger("celery.app.trace").addFilter(_NoTracebackForRequeues())
    identity = {**process_identity(), "started_at": time.time()}
    heartbeat = Heartbeat(r, record_key, {**record, **identity, "ready": 0}, ttl_s, also=keep_alive)
    heartbeat.start()
    signals.worker_ready.connect(lambda **_: heartbeat.update(ready=1), weak=False)
    app.conf.worker_consumer = f"{__name__}:{BatchedEventsConsumer.__name__}"
    app.worker_main(["worker", "--pool", "threads", "--concurrency", str(concurrency), "--queues", ",".join(queues),
                     "--hostname", hostname, "--without-gossip", "--without-mingle", "--loglevel", loglevel])
