"""The GPU worker's re-check behind a lost control message (``ProgressReporter.recheck_cancels``), over real Redis
and the real cancel / stream writes (``JobStore.request_cancel``, ``JobStore.request_stream``) and the real
``EngineService`` (scripted engine core, no model): the records of the jobs a worker holds are read again only when
``names.job_flags_epoch`` moved, and then a cancel or a stream flag whose control message was never heard lands."""

from __future__ import annotations

import random
import uuid
from types import SimpleNamespace

import pytest
from test_step_hold import add, new_service

from pagedq.config.names import JobState, Names
from pagedq.store.jobs import JobStore
from pagedq.workers.gpu_worker import ProgressReporter
from pagedq.workers.service import Handle


@pytest.fixture
def names() -> Names:
    tag = uuid.uuid4().hex[:8]
    return Names(key_prefix=f"rc{tag}:", queue_prefix=f"rc{tag}.")


def hmgets(redis) -> int:
    return redis.info("commandstats").get("cmdstat_hmget", {}).get("calls", 0)


def test_a_worker_reads_its_jobs_again_only_after_a_flag_moved_the_epoch(redis, names):
    store = JobStore(redis, names, result_ttl_s=60)
    jobs = [f"j{uuid.uuid4().hex[:8]}" for _ in range(random.randint(4, 7))]
    store.create([(j, {"state": JobState.QUEUED.value}) for j in jobs], max_queued=100)
    svc, engine = new_service(redis, names, hold_s=0.05, last_prefill_s=None)
    svc.engine = SimpleNamespace(engine=engine, abort_request=engine.abort_request, stats=engine.stats)
    for j in jobs:
        assert store.admit(j, worker="w") == "ok"
        add(svc, engine, j, random.randint(3, 20), max_tokens=50)
        svc.handles[j] = Handle(job=SimpleNamespace(job_id=j), params=None, task_id=f"t-{j}", detokenizer=None)
    reporter = ProgressReporter(None, svc, redis, names, "w", interval_s=60)

    def recheck() -> int:
        """One re-check as ``report`` makes it (the epoch read before the snapshot); the HMGETs it sent."""
        before = hmgets(redis)
        epoch = redis.get(names.job_flags_epoch)
        reporter.recheck_cancels(svc.snapshot(), epoch)
        return hmgets(redis) - before

    assert recheck() == len(jobs)  # the first one reads every record
    assert recheck() == 0 and recheck() == 0  # nothing moved: nothing read

    queued = f"q{uuid.uuid4().hex[:8]}"  # cancelling a job no worker holds moves nothing
    store.create([(queued, {"state": JobState.QUEUED.value})], max_queued=100)
    assert store.request_cancel(queued) == JobState.QUEUED
    assert recheck() == 0

    cancelled, streamed = random.sample(jobs, 2)
    assert store.request_cancel(cancelled) == JobState.IN_PROGRESS  # no control message sent
    assert recheck() == len(jobs)
    assert [h.job.job_id for h in svc.snapshot() if h.cancel_requested] == [cancelled]
    assert [o.request_id for o in engine.step() if o.finish_reason == "abort"] == [cancelled]  # in the engine too
    assert recheck() == 0

    store.request_stream(streamed)  # no control message sent
    assert recheck() == len(jobs) - 1  # the cancelled one is not read again
    assert [h.job.job_id for h in svc.snapshot() if h.stream] == [streamed]
    assert store.request_cancel(cancelled) == JobState.CANCELLING  # a second cancel moves nothing
    assert recheck() == 0

    redis.delete(names.job_flags_epoch)  # a Redis that lost the counter: read again, once
    assert recheck() == len(jobs) - 1
    assert recheck() == 0
