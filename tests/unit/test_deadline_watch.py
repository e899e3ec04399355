"""Start deadlines (store/deadlines.py) against a real redis-server: a waiting job past its deadline ends expired
within a tick or two with no worker at all; a started job is left alone; one watch ticks at a time."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid

import pytest
from queue_helpers import wait_until

from pagedq.config.messages import GenerateJob, RequestError
from pagedq.config.names import JobState, Names
from pagedq.config.sampling_params import SamplingParams
from pagedq.config.scheduling import SchedulingMeta
from pagedq.store.deadlines import DeadlineWatch, start_watching
from pagedq.store.dispatch import FairDispatch
from pagedq.store.jobs import JobStore

MODEL = "test/deadline-model"


@pytest.fixture
def names() -> Names:
    return Names(key_prefix=f"d-{uuid.uuid4().hex[:8]}:", queue_prefix="d.")


@pytest.fixture
def store(redis, names) -> JobStore:
    return JobStore(redis, names, result_ttl_s=60)


def _create(store: JobStore, timeout_s: float | None) -> tuple[str, float | None]:
    """A job written by the real create script, as the Client writes it (expires_at = created + timeout_s)."""
    job_id, created = uuid.uuid4().hex, time.time()
    fields = {"state": "queued", "model": MODEL, "priority": 5, "created_at": created, "attempts": 0}
    if timeout_s is not None:
        fields["expires_at"] = created + timeout_s
    store.create([(job_id, fields)], max_queued=1000)
    return job_id, fields.get("expires_at")


def _push(dispatch: FairDispatch, job_id: str, deadline: float | None) -> None:
    dispatch.push(GenerateJob(job_id, MODEL, "text", [random.randrange(100) for _ in range(5)], SamplingParams(),
                              5, meta=SchedulingMeta("t", 5, deadline, time.time())))


def test_waiting_jobs_past_their_deadline_expire_within_two_seconds_with_no_worker(redis, names, store):
    dispatch = FairDispatch(redis, names)
    due = [_create(store, random.uniform(0.2, 1.5)) for _ in range(random.randint(5, 12))]
    later = [_create(store, 600) for _ in range(2)]
    never = [_create(store, None) for _ in range(2)]
    for job_id, deadline in due[::2] + later[:1] + never[:1]:  # some already generated: in the fair queue
        _push(dispatch, job_id, deadline)
    assert redis.zcard(names.deadlines) == len(due) + len(later)
    stop = threading.Event()
    thread = start_watching(DeadlineWatch(store, owner="test"), stop)
    try:
        wait_until(lambda: all(store.state(j) == JobState.EXPIRED for j, _ in due), timeout=10, what="expired")
    finally:
        stop.set()
        thread.join(5)
    lateness = [float(store.get(j)["expired_at"]) - expires for j, expires in due]
    print(f"expired after the deadline by: max {max(lateness):.3f} s")
    assert max(lateness) <= 2.0
    assert all(RequestError.from_dict(json.loads(store.get(j)["error"])).code == "expired" for j, _ in due)
    assert all(store.state(j) == JobState.QUEUED for j, _ in later + never)
    assert dispatch.waiting(MODEL) == 2  # the expired ones left the fair queue; the later and deadline-less stay
    assert set(redis.zrange(names.deadlines, 0, -1)) == {j for j, _ in later}
    assert redis.get(names.deadline_lock) is None  # given back when the watch stopped


def test_a_started_job_past_its_deadline_is_left_alone_and_finish_forgets_the_deadline(redis, names, store):
    started, _ = _create(store, 0.05)
    assert store.admit(started, worker="gpu-1") == "ok"
    done, _ = _create(store, 600)
    store.finish(done, JobState.COMPLETED, result={"ok": True})
    assert redis.zscore(names.deadlines, done) is None
    time.sleep(0.1)
    watch = DeadlineWatch(store, owner="test")
    assert watch.tick() == []
    assert store.state(started) == JobState.IN_PROGRESS
    assert redis.zcard(names.deadlines) == 0


def test_one_watch_ticks_at_a_time(redis, names, store):
    first, second = DeadlineWatch(store, owner="cpu-1"), DeadlineWatch(store, owner="cpu-2")
    assert first.tick() == []  # nothing due, but it holds the lock now
    job_id, _ = _create(store, 0.0)
    time.sleep(0.01)
    assert second.tick() == []  # the lock is the first watch's
    assert store.state(job_id) == JobState.QUEUED
    assert first.release()
    assert second.tick() == [job_id]
    assert store.state(job_id) == JobState.EXPIRED


def test_a_job_claimed_but_not_started_expires_and_stays_bound_until_its_worker_unbinds(redis, names, store):
    dispatch = FairDispatch(redis, names)
    job_id, deadline = _create(store, 0.05)
    _push(dispatch, job_id, deadline)
    assert dispatch.claim(MODEL, "gpu-1", "gpu-1:0").job_id == job_id  # bound, not admitted yet
    time.sleep(0.1)
    assert DeadlineWatch(store, owner="test").tick() == [job_id]
    assert store.state(job_id) == JobState.EXPIRED
    assert store.admit(job_id, worker="gpu-1") == JobState.EXPIRED  # what the worker then sees: it does not run
    assert dispatch.bound_job("gpu-1:0") == job_id
    dispatch.unbind("gpu-1:0")
    assert dispatch.bound_job("gpu-1:0") is None and redis.hget(names.fair_index, job_id) is None
