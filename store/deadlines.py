"""Start deadlines: a waiting job whose ``timeout_s`` passed ends ``expired`` even when no worker takes it.

The create script adds every job created with an ``expires_at`` to
``names.deadlines`` (job id -> expires_at, Redis clock); ``finish`` takes it
out.  ``DeadlineWatch.tick`` (every ``interval_s`` in a CPU worker's thread)
reads the jobs past due by Redis's clock and, for each one still not started,
ends it through ``JobStore.admit`` / ``settle`` (the one Lua path into
terminal states, which judges the deadline itself) and takes it out of its fair
queue.  A job past due that did start (or ended) just leaves the set.

One process ticks at a time: the watch holds ``names.deadline_lock`` under
its own token (compare-and-extend on each tick), so a second CPU worker ticks
only once the first stopped renewing it, within ``lock_s``.
"""

from __future__ import annotations

import logging
import threading

from pagedq.config.names import JobState
from pagedq.store.dispatch import FairDispatch
from pagedq.store.jobs import JobStore
from pagedq.store.locks import OwnedLock

log = logging.getLogger(__name__)

class DeadlineWatch:
    """Ends waiting jobs past their start deadline; ``batch`` bounds the jobs one tick handles."""

    def __init__(self, store: JobStore, owner: str, interval_s: float = 0.5, lock_s: float = 3.0,
                 batch: int = 500) -> None:
        self.store = store
        self.r = store.r
        self.names = store.names
        self.interval_s = interval_s
        self.batch = batch
        self.lock = OwnedLock(self.r, self.names.deadline_lock, owner)
        self._lock_ms = max(int(lock_s * 1000), int(interval_s * 2000))
        self._dispatch = FairDispatch(self.r, self.names)

    def tick(self) -> list[str]:
        """Expire the jobs past due that never started; returns their ids ([] when another process ticks)."""
        if not self.lock.hold(self._lock_ms):
            return []
        seconds, micros = self.r.time()
        due = self.r.zrangebyscore(self.names.deadlines, "-inf", seconds + micros / 1e6, start=0, num=self.batch)
        expired = []
        for job_id in due:
            verdict = self.store.admit(job_id)  # without a worker: only judges (Redis clock)
            if verdict == JobState.EXPIRED:
                self.store.settle(job_id, verdict)  # finish takes it out of names.deadlines
                self._dispatch.remove(job_id)
                expired.append(job_id)
            else:  # started, ended, cancelling or gone: no start deadline to watch any more
                self.r.zrem(self.names.deadlines, job_id)
        return expired

    def release(self) -> bool:
        """Give the lock back, if this watch holds it."""
        return self.lock.release()

    def run(self, stop: threading.Event) -> None:
        """Tick every ``interval_s`` until ``stop`` is set; a failed tick is logged and the next one runs."""
        while not stop.wait(self.interval_s):
            try:
                while len(self.tick()) == self.batch and not stop.is_set():
                    pass  # more past due than one tick takes: go on at once
            except Exception as e:  # Redis away for a moment: the next tick retries
                log.warning("deadline watch failed: %s: %s", type(e).__name__, e)
        self.release()


def start_watching(watch: DeadlineWatch, stop: threading.Event | None = None) -> threading.Thread:
    """``watch.run`` in a daemon thread."""
    thread = threading.Thread(target=watch.run, args=(stop or threading.Event(),), name="deadline-watch",
                              daemon=True)
    thread.start()
    return thread
