"""Running a Celery worker the pagedq way (GPU and CPU workers alike).

The worker's Redis record (``names.worker(hostname)``: role, pid, ready) is
kept alive by a heartbeat while the process runs, and marked ``ready`` once
Celery's consumer is up; then Celery's own worker loop runs until shutdown.
"""

from __future__ import annotations

import logging
import os

import redis
from celery import Celery, signals
from celery.exceptions import Reject

from pagedq.store.registry import Heartbeat


class _NoTracebackForRequeues(logging.Filter):
    """A job handed back to its queue (worker stopping) is one log line, not a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], Reject):
            record.exc_info, record.exc_text = None, None
        return True


def run_celery_worker(app: Celery, r: redis.Redis, record_key: str, record: dict, *, queues: list[str],
                      concurrency: int, hostname: str, loglevel: str = "INFO", ttl_s: int = 15) -> None:
    logging.getLogger("celery.app.trace").addFilter(_NoTracebackForRequeues())
    Heartbeat(r, record_key, {**record, "pid": os.getpid(), "ready": 0}, ttl_s).start()
    signals.worker_ready.connect(lambda **_: r.hset(record_key, "ready", 1), weak=False)
    app.worker_main(["worker", "--pool", "threads", "--concurrency", str(concurrency), "--queues", ",".join(queues),
                     "--hostname", hostname, "--without-gossip", "--without-mingle", "--loglevel", loglevel])
