"""Helpers for tests that run the queue: waiting, broker depth, counting terminal publications."""

from __future__ import annotations

import time
from collections import Counter

from pagedq.config.names import Names
from pagedq.pipeline import Client


def wait_until(predicate, timeout: float = 60, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def broker_depth(client: Client) -> int:
    n = client.names
    lists = [key for q in (n.preprocess_queue, n.results_queue, n.generate_queue(client.settings.model))
             for key in n.broker_lists(q)]
    pipe = client.r.pipeline(transaction=False)
    for key in lists:
        pipe.llen(key)
    return sum(pipe.execute())



class DoneCounter:
    """Counts terminal-state publications per job (a job published twice would count 2)."""

    def __init__(self, r, names: Names) -> None:
        self.r = r  # keep the client alive: collecting it closes the subscription's connection
        self.counts: Counter = Counter()
        self.prefix = names.done_channel("")
        self.pubsub = r.pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe(**{names.done_channel("*"): self._on})
        # A broker error (a test's broker crash) is waited out: the next read reconnects and subscribes again.
        self.thread = self.pubsub.run_in_thread(sleep_time=0.05, daemon=True,
                                                exception_handler=lambda e, pubsub, thread: time.sleep(0.2))

    def _on(self, message) -> None:
        self.counts[message["channel"][len(self.prefix):]] += 1

    def stop(self) -> None:
        self.thread.stop()
        self.thread.join(timeout=5)
        self.pubsub.close()


def completed_once_on(worker, client: Client, counter: DoneCounter, jobs: list[str], running: list[str],
                      tokens: int) -> None:
    """Every job completes whole and is published once; those running at the fault finished on ``worker``."""
    results = [client.result(j, timeout=600) for j in jobs]
    wait_until(lambda: all(counter.counts[j] >= 1 for j in jobs), 30, what="every publication")
    counter.stop()
    assert all(r["usage"]["completion_tokens"] == tokens for r in results)
    assert all(counter.counts[j] == 1 for j in jobs), f"published twice or never: {counter.counts}"
    assert all(client.status(j).worker == worker.hostname for j in running)
