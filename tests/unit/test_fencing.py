"""Fencing, against a real redis-server: a job's epoch moves on when another worker takes it, and a finish or
requeue fenced with an older epoch (a holder its lease was restored away from) writes and publishes nothing."""

from __future__ import annotations

import logging
import random
import time
import uuid

import pytest

from pagedq.config.messages import Completion, parse_message, to_json
from pagedq.config.names import JobState, Names
from pagedq.store.jobs import Admitted, JobStore
from pagedq.store.transport import _REQUEUE_JOB

QUIET_S = 0.3  # how long a done channel stays silent to count as "nothing published"


@pytest.fixture
def names() -> Names:
    tag = uuid.uuid4().hex[:8]
    return Names(key_prefix=f"f{tag}:", queue_prefix=f"f{tag}.")


@pytest.fixture
def store(redis, names) -> JobStore:
    return JobStore(redis, names, result_ttl_s=60, max_attempts=10)


def record() -> dict:
    return {"state": "queued", "model": "m", "priority": 5, "created_at": time.time(), "attempts": 0}


def create(store: JobStore, job_id: str = "j") -> None:
    store.create([(job_id, record())], max_queued=10, messages={job_id: "{}"})


def everything(redis, names: Names, job_id: str = "j") -> dict:
    """What a finish may write: the job's record, result, message, stream, place in the active set, backlog."""
    return {"job": redis.hgetall(names.job(job_id)), "result": redis.get(names.result(job_id)),
            "message": redis.get(names.job_message(job_id)), "stream": redis.exists(names.stream(job_id)),
            "active": redis.zscore(names.active_jobs, job_id), "backlog": redis.get(names.backlog("m")),
            "ttl": redis.ttl(names.job(job_id))}


def published(ps) -> list[str]:
    """What ``ps``'s channels heard within QUIET_S (subscribe replies skipped)."""
    heard, deadline = [], time.monotonic() + QUIET_S
    while (left := deadline - time.monotonic()) > 0:
        message = ps.get_message(ignore_subscribe_messages=True, timeout=left)
        if message is not None:
            heard.append(message["data"])
    return heard


@pytest.fixture
def done(redis, names):
    ps = redis.pubsub()
    ps.subscribe(names.done_channel("j"))
    ps.get_message(timeout=1)  # the subscribe reply
    yield ps
    ps.close()


def test_a_take_by_another_worker_moves_the_epoch_on_and_the_holders_own_re_admit_keeps_it(store):
    create(store)
    first = store.admit("j", worker="A")
    assert isinstance(first, Admitted) and first == "ok" and first.epoch == 1
    again = store.admit("j", worker="A")  # a redelivered copy on the worker still running it: a duplicate
    assert again == "ok" and again.epoch == 1
    taken = store.admit("j", worker="B")  # A's lease ran out: B runs it
    assert taken == "ok" and taken.epoch == 2 and store.get("j")["epoch"] == "2"
    record = store.get("j")  # the take also tells the worker's metrics what they would read
    assert (taken.attempts, taken.created_at) == (record["attempts"], record["created_at"]) and record["created_at"]
    assert store.admit("j", worker="A").epoch == 3, "A taking it back from B is another take"


def test_the_holders_re_admit_after_a_lease_restore_keeps_the_epoch_an_orderly_hand_back_does_not(redis, store,
                                                                                               names):
    create(store)
    assert store.admit("j", worker="A").epoch == 1
    redis.register_script(_REQUEUE_JOB)(keys=[names.job("j")])  # a lease restore: queued, restored_from A
    assert store.state("j") == "queued" and store.get("j")["restored_from"] == "A"
    back = store.admit("j", worker="A")  # the message came back to A, which still runs the job
    assert back == "ok" and back.epoch == 1
    assert store.finish("j", JobState.COMPLETED, result={"ok": 1}, fence=1), "A's run ends the job"
    create(store, "k")
    assert store.admit("k", worker="A").epoch == 1
    assert store.requeue("k", fence=1)  # A shut down in order: its run is over
    assert store.admit("k", worker="A").epoch == 2


def test_a_stale_holders_finish_writes_nothing_publishes_nothing_and_is_logged(redis, names, store, done, caplog):
    create(store)
    store.update("j", stream=1)
    redis.xadd(names.stream("j"), {"type": "delta", "text": "x"})
    stale = store.admit("j", worker="A")
    store.admit("j", worker="B")
    before = everything(redis, names)
    caplog.set_level(logging.WARNING, logger="pagedq.store.jobs")
    assert store.finish("j", JobState.COMPLETED, result={"answer": "A's"}, fence=stale.epoch) is False
    assert everything(redis, names) == before
    assert published(done) == []
    assert "fenced: finish of job j at epoch 1 refused, the job is at epoch 2" in caplog.text
    assert redis.hgetall(names.fenced) == {"finish": "1"}, "counted (pagedq status, pagedq_fenced_total)"
    assert store.finish("j", JobState.COMPLETED, result={"answer": "B's"}, fence=2) is True
    assert store.state("j") == "completed" and store.result("j") == {"answer": "B's"}
    assert published(done) == ["completed"]


def test_a_stale_holders_finish_after_the_new_holder_ended_the_job_is_refused_and_counted(redis, names, store,
                                                                                          done):
    """The woken worker often finishes late, after the worker its job was taken by: still a refused write.  A
    finish repeated by the holder that ended the job (a retry after a broker error) is no fencing."""
    create(store)
    stale = store.admit("j", worker="A")
    taken = store.admit("j", worker="B")
    assert store.finish("j", JobState.COMPLETED, result={"answer": "B's"}, fence=taken.epoch) is True
    assert published(done) == ["completed"]
    before = everything(redis, names)
    assert store.finish("j", JobState.COMPLETED, result={"answer": "A's"}, fence=stale.epoch) is False
    assert redis.hgetall(names.fenced) == {"finish": "1"}
    assert store.finish("j", JobState.COMPLETED, result={"answer": "B's"}, fence=taken.epoch) is False
    assert store.finish("j", JobState.CANCELLED) is False
    assert redis.hgetall(names.fenced) == {"finish": "1"}, "only the stale holder's write counts"
    assert everything(redis, names) == before and published(done) == []
    assert store.result("j") == {"answer": "B's"}


def test_a_stale_holders_finish_does_not_count_into_its_batch(redis, names, store):
    batch = names.batch("b")
    fields = {**record(), "batch_key": batch, "batch_id": "b"}
    store.create([("j", fields)], max_queued=10,
                 batch=(batch, {"state": "in_progress", "total": 1, "jobs_key": names.batch_jobs("b"),
                                   "done_channel": names.done_channel("b")}, ["j"]))
    store.admit("j", worker="A")
    store.admit("j", worker="B")
    before = redis.hgetall(batch)
    assert not store.finish("j", JobState.FAILED, error={"message": "x"}, fence=1)
    assert redis.hgetall(batch) == before and not redis.zscore(names.batches_to_finalize, "b")
    assert store.finish("j", JobState.COMPLETED, result={"ok": 1}, fence=2)
    assert redis.hget(batch, "done") == "1" and redis.hget(batch, "state") == "completed"


def test_a_stale_finish_is_refused_when_ends_wait_for_replicas_too(redis, names, done):
    """With ``min_replicas_ack`` the script defers its publishes to the caller: a refusal must not read as an end."""
    store = JobStore(redis, names, result_ttl_s=60, max_attempts=10, min_replicas_ack=1, replica_ack_timeout_s=0.05)
    create(store)
    store.admit("j", worker="A")
    store.admit("j", worker="B")
    before = everything(redis, names)
    assert store.finish("j", JobState.COMPLETED, result={"answer": "A's"}, fence=1) is False
    assert everything(redis, names) == before and published(done) == []
    assert store.finish("j", JobState.COMPLETED, result={"answer": "B's"}, fence=2) is True  # no replica: unannounced
    assert store.state("j") == "completed"


def test_a_stale_requeue_leaves_the_new_holders_job_alone(redis, names, store):
    create(store)
    store.admit("j", worker="A")
    store.admit("j", worker="B")
    before = store.get("j")
    assert store.requeue("j", fence=1) is False  # A drains: the job is B's now
    assert redis.hgetall(names.fenced) == {"requeue": "1"}
    assert store.get("j") == before and before["state"] == "in_progress" and before["worker"] == "B"
    assert store.requeue("j", fence=2) is True
    assert store.state("j") == "queued" and store.get("j")["attempts"] == str(int(before["attempts"]) - 1)


def test_an_unfenced_finish_ends_the_job_whatever_its_epoch(redis, names, store, done):
    create(store)
    store.admit("j", worker="A")
    store.admit("j", worker="B")
    assert store.request_cancel("j") == "in_progress"
    verdict = store.admit("j")  # a peek: takes nothing, has no epoch to give
    assert verdict == JobState.CANCELLING and verdict.epoch == 0
    store.settle("j", verdict)
    assert store.state("j") == "cancelled" and published(done) == ["cancelled"]
    assert store.get("j")["epoch"] == "2"


def test_a_completion_without_an_epoch_parses_as_unfenced():
    fields = {"request_id": "j", "kind": "text", "model": "m", "text": "hi", "output_token_ids": [1],
              "num_prompt_tokens": 3, "finish_reason": "stop"}
    assert parse_message(Completion, fields).epoch == 0  # from a worker older than fencing
    fenced = parse_message(Completion, to_json(Completion(**fields, epoch=7)))
    assert fenced.epoch == 7


def test_pagedq_status_and_the_exporter_count_the_refused_writes(redis, names, store):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pagedq.pipeline.exporter import deployment_registry
    from pagedq.pipeline.status import render, snapshot

    stale_finishes = random.randint(2, 6)
    for i in range(stale_finishes + 1):
        create(store, f"j{i}")
        store.admit(f"j{i}", worker="A")
        store.admit(f"j{i}", worker="B")
    for i in range(stale_finishes):
        assert not store.finish(f"j{i}", JobState.COMPLETED, result={"x": i}, fence=1)
    assert not store.requeue(f"j{stale_finishes}", fence=1)
    assert store.finish("j0", JobState.COMPLETED, result={"x": 0}, fence=2)  # the holder's: not counted
    snap = snapshot(redis, names)
    assert snap.fenced == {"finish": stale_finishes, "requeue": 1}
    assert f"FENCED (writes refused to a worker whose job another worker had taken)  finish {stale_finishes}" \
        in render(snap)
    text = generate_latest(deployment_registry(redis, names)).decode()
    samples = {(s.name, tuple(s.labels.items())): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("pagedq_fenced_total", (("op", "finish"),))] == stale_finishes
    assert samples[("pagedq_fenced_total", (("op", "requeue"),))] == 1
