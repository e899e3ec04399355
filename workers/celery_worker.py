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

from pagedq.store.registry import Heartbeat
from pagedq.workers.processes import process_identity


class _NoTracebackForRequeues(logging.Filter):
    """A job handed back to its queue (worker stopping) is one log line, not a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], Reject):
            record.exc_info, record.exc_text = None, None
        return True


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
    app.worker_main(["worker", "--pool", "threads", "--concurrency", str(concurrency), "--queues", ",".join(queues),
                     "--hostname", hostname, "--without-gossip", "--without-mingle", "--loglevel", loglevel])
