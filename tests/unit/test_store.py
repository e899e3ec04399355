"""What lives in Redis, against a real redis-server: job state scripts, the backlog bound, signed control messages."""

from __future__ import annotations

import base64
import json
import logging
import time
import uuid
from types import SimpleNamespace

import pytest
from queue_helpers import wait_until

from pagedq.config.messages import PreprocessJob, RequestError, to_json
from pagedq.config.names import GENERATE_TASK, POSTPROCESS_TASK, PREPROCESS_TASK, JobState, Names
from pagedq.store import control
from pagedq.store.jobs import JobStore
from pagedq.store.lost_jobs import LostJobSweep
from pagedq.workers.gpu_worker import ControlListener


@pytest.fixture
def names() -> Names:
    tag = uuid.uuid4().hex[:8]
    return Names(key_prefix=f"u{tag}:", queue_prefix=f"u{tag}.")


def record(model: str = "m") -> dict:
    return {"state": "queued", "model": model, "priority": 5, "created_at": time.time(), "attempts": 0}


def test_admit_counts_attempts_and_a_job_that_keeps_losing_its_worker_is_poison(redis, names):
    store = JobStore(redis, names, result_ttl_s=60, max_attempts=2)
    store.create([("j", record())], max_queued=10)
    assert store.admit("j", worker="w1") == "ok"
    assert store.admit("j", worker="w2") == "ok"  # w1 died: redelivered
    assert store.admit("j", worker="w3") == "poison"
    store.settle("j", "poison")
    job = store.get("j")
    assert job["state"] == "failed" and json.loads(job["error"])["code"] == "poison"
    assert store.backlog("m") == 0


def test_an_orderly_requeue_is_not_an_attempt_a_lost_replica_is(redis, names):
    store = JobStore(redis, names, result_ttl_s=60, max_attempts=3)
    store.create([("j", record())], max_queued=10)
    store.admit("j", worker="w1")
    store.requeue("j")  # worker shutting down
    assert store.get("j")["attempts"] == "0" and store.state("j") == "queued"
    store.admit("j", worker="w2")
    store.requeue("j", count_attempt=True)  # its replica lost a process
    assert store.get("j")["attempts"] == "1"


def test_the_backlog_is_bounded_per_model_and_all_or_nothing(redis, names):
    store = JobStore(redis, names, result_ttl_s=60)
    store.create([(f"a{i}", record("a")) for i in range(3)], max_queued=3)
    before = set(redis.scan_iter(match=f"{names.key_prefix}*"))
    with pytest.raises(RequestError) as e:
        store.create([("b0", record("b")), ("a3", record("a"))], max_queued=3)
    assert e.value.code == "queue_full" and "'a'" in str(e.value)
    assert set(redis.scan_iter(match=f"{names.key_prefix}*")) == before, "a refused create writes nothing"
    store.create([("b0", record("b"))], max_queued=3)  # another model has its own bound
    assert store.finish("a0", JobState.COMPLETED, result={"ok": 1})
    assert not store.finish("a0", JobState.FAILED), "a terminal job ends once"
    assert (store.backlog("a"), store.backlog("b")) == (2, 1)
    store.discard("b0")  # never sent
    assert store.backlog("b") == 0 and not redis.exists(names.job("b0"))


class RecordingService:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.engine = SimpleNamespace(model_name="m")

    def cancel(self, job_id: str) -> None:
        self.calls.append(("cancel", job_id))

    def enable_stream(self, job_id: str) -> None:
        self.calls.append(("stream", job_id))

    def reload(self) -> None:
        self.calls.append(("reload",))


def test_forged_control_messages_change_nothing_and_are_logged(redis, names, caplog):
    secret = b"s" * 32
    service = RecordingService()
    listener = ControlListener(redis, names, secret, service)
    listener.start()
    try:
        caplog.set_level(logging.ERROR, logger="pagedq.workers.gpu_worker")
        forged = [
            json.dumps({"op": "reload", "model": "m"}),  # unsigned
            control.sign(b"wrong key" * 4, "reload", model="m"),  # someone else's key
            json.dumps({**json.loads(control.sign(secret, "reload", model="m")), "model": "other"}),  # altered
            control.sign(secret, "reload", model="m").replace('"ts": ', '"ts": 1'),  # tampered timestamp
        ]
        for raw in forged:
            redis.publish(names.control_channel, raw)
        wait_until(lambda: len([r for r in caplog.records if "ignoring a control message" in r.message]) == 4,
                   10, what="four rejections logged")
        assert service.calls == []
        channel = control.ControlChannel(redis, names, secret)
        channel.publish("cancel", job_id="j1")
        channel.publish("reload", model="m")
        wait_until(lambda: len(service.calls) == 2, 10, what="the signed messages")
        assert service.calls == [("cancel", "j1"), ("reload",)]
    finally:
        listener.thread.stop()


def test_a_batch_larger_than_luas_unpack_limit_is_written_whole(redis, names):
    store = JobStore(redis, names, result_ttl_s=60)
    ids = [f"j{i}" for i in range(9000)]
    batch = (names.batch("b"), {"state": "in_progress", "total": len(ids), "jobs_key": names.batch_jobs("b")}, ids)
    store.create([(i, record()) for i in ids], max_queued=10_000, batch=batch)
    assert redis.lrange(names.batch_jobs("b"), 0, -1) == ids and store.backlog("m") == 9000


def test_a_job_that_started_is_not_expired_when_it_comes_back(redis, names):
    store = JobStore(redis, names, result_ttl_s=60)
    store.create([("j", {**record(), "expires_at": time.time() + 0.2})], max_queued=10)
    assert store.admit("j", worker="w1") == "ok"
    store.requeue("j")  # its worker stopped
    time.sleep(0.3)  # past its deadline: it had started in time, so it must not expire now
    assert not store.expire_if_due("j")
    assert store.admit("j", worker="w2") == "ok"
    store.create([("k", {**record(), "expires_at": time.time() - 1})], max_queued=10)
    assert store.expire_if_due("k") and store.state("k") == "expired"


def test_an_empty_or_short_control_key_file_is_refused(tmp_path):
    from pagedq.config import Settings

    settings = Settings(state_dir=tmp_path)
    key = control.control_secret(settings)
    assert len(key) >= 32 and control.control_secret(settings) == key  # made once, then read
    (tmp_path / control.KEY_FILE).write_bytes(b"")
    with pytest.raises(ValueError, match="shorter than"):
        control.control_secret(settings)


# --- the lost-job sweep ------------------------------------------------------------------------------------
def envelope(task: str, message: dict) -> str:
    """A message as kombu stores it on a queue list: JSON, its body base64-encoded JSON [args, kwargs, embed]."""
    body = base64.b64encode(json.dumps([[message], {}, {}]).encode()).decode()
    return json.dumps({"body": body, "headers": {"task": task, "id": uuid.uuid4().hex},
                       "properties": {"body_encoding": "base64", "delivery_tag": uuid.uuid4().hex},
                       "content-type": "application/json"})


def preprocess_message(job_id: str) -> PreprocessJob:
    return PreprocessJob(job_id, "/v1/completions", {"model": "m", "prompt": f"p {uuid.uuid4().hex}"})


def test_a_job_with_no_message_anywhere_is_sent_again_once_two_sweeps_agree(redis, names):
    store = JobStore(redis, names, result_ttl_s=60, send_grace_s=0.2)  # written, never confirmed sent
    ids = ["queued", "unacked", "generating", "lost"]
    messages = {j: preprocess_message(j) for j in ids}
    store.create([(j, record()) for j in ids], max_queued=10,
                 messages={j: json.dumps(to_json(m)) for j, m in messages.items()})
    redis.rpush(names.broker_list(names.preprocess_queue, 3), envelope(PREPROCESS_TASK, to_json(messages["queued"])))
    redis.hset(names.unacked, "tag1", json.dumps([json.loads(envelope(POSTPROCESS_TASK, {"request_id": "unacked"})),
                                                   "", names.results_queue]))
    redis.rpush(names.broker_list(names.generate_queue("m")), envelope(GENERATE_TASK, {"job_id": "generating"}))
    assert store.admit("lost", worker="w1") == "ok"  # it was running when its message was lost
    sent: list = []
    sweep = LostJobSweep(store, lambda msg, priority: sent.append((msg, priority)), interval_s=0.2, owner="t")
    assert sweep.sweep() == []  # its send may still be coming: not looked for within the grace
    time.sleep(0.25)
    assert sweep.sweep() == [] and redis.smembers(names.lost_suspects) == {"lost"}
    assert sweep.sweep() == []  # another sweep within the interval does nothing
    time.sleep(0.25)
    assert sweep.sweep() == ["lost"]
    assert sent == [(messages["lost"], 5)]
    assert store.state("lost") == "queued" and store.get("lost")["resent"] == "1"
    assert all(store.state(j) == "queued" for j in ids[:3]) and not any("resent" in store.get(j) for j in ids[:3])


def test_messages_naming_no_active_job_hide_nothing_and_a_job_lost_again_after_max_resends_fails(redis, names):
    store = JobStore(redis, names, result_ttl_s=60)
    store.create([("a", record()), ("b", record())], max_queued=10,
                 messages={j: json.dumps(to_json(preprocess_message(j))) for j in "ab"})
    store.mark_sent(["a", "b"])
    # As many messages as jobs, none of theirs: garbage, and a message of a job that ended (the old count fooled)
    redis.rpush(names.broker_list(names.preprocess_queue), "not JSON",
                envelope(PREPROCESS_TASK, to_json(preprocess_message("ended-long-ago"))))
    sent: list = []
    sweep = LostJobSweep(store, lambda msg, priority: sent.append(msg.job_id), interval_s=0.1, owner="t",
                         max_resends=1)
    for _ in range(2):  # suspected by the first sweep, sent again by the second
        time.sleep(0.12)
        sweep.sweep()
    assert sorted(sent) == ["a", "b"]
    for _ in range(4):  # lost again (nothing consumes the queue here; the resends were not really sent)
        time.sleep(0.12)
        sweep.sweep()
    assert sorted(sent) == ["a", "b"]  # once each: the second time they are lost, they fail
    for j in "ab":
        job = store.get(j)
        assert job["state"] == "failed" and json.loads(job["error"])["code"] == "lost"
        assert not redis.exists(names.job_message(j))
    assert redis.zcard(names.active_jobs) == 0 and store.backlog("m") == 0


def test_ending_or_discarding_a_job_removes_it_from_the_active_set_with_its_message(redis, names):
    store = JobStore(redis, names, result_ttl_s=60)
    store.create([("a", record()), ("b", record())], max_queued=10, messages={"a": "{}", "b": "{}"})
    assert redis.zrange(names.active_jobs, 0, -1) == ["a", "b"]
    store.finish("a", JobState.COMPLETED, result={"ok": 1})
    store.discard("b")
    assert redis.zcard(names.active_jobs) == 0
    assert not redis.exists(names.job_message("a")) and not redis.exists(names.job_message("b"))


def test_a_worker_record_that_expired_comes_back_whole_with_its_ttl(redis, names):
    """A heartbeat missed for a TTL (a stalled process) lets the record expire; the next beat writes it whole again
    (identity, ready), never a partial record, and never one without a TTL."""
    from pagedq.store.registry import Heartbeat

    key = names.worker(f"w-{uuid.uuid4().hex[:6]}")
    pid = str(uuid.uuid4().int % 10**6)
    heartbeat = Heartbeat(redis, key, {"role": "gpu", "model": "m", "pid": pid, "ready": 0}, ttl_s=5)
    heartbeat.update(ready=1)
    redis.delete(key)  # expired
    heartbeat.beat()
    record = redis.hgetall(key)
    assert {k: record[k] for k in ("role", "model", "pid", "ready")} == {"role": "gpu", "model": "m", "pid": pid,
                                                                         "ready": "1"}
    assert 0 < redis.ttl(key) <= 5


def test_a_worker_hands_tokens_on_only_when_another_live_gpu_worker_serves_its_model(redis, names, monkeypatch):
    """``Peers``: the live GPU workers of the same model other than this one, from the worker records; a CPU worker,
    another model's worker or an expired record does not count; a peer started later is seen within ``TTL_S``."""
    from pagedq.store.registry import Heartbeat, gpu_workers_serving
    from pagedq.workers.gpu_worker import Peers

    model = f"m-{uuid.uuid4().hex[:6]}"
    me, peer = (f"gpu-{uuid.uuid4().hex[:6]}" for _ in range(2))
    Heartbeat(redis, names.worker(me), {"role": "gpu", "model": model}, ttl_s=30)
    Heartbeat(redis, names.worker(f"cpu-{uuid.uuid4().hex[:6]}"), {"role": "cpu"}, ttl_s=30)
    Heartbeat(redis, names.worker(f"gpu-{uuid.uuid4().hex[:6]}"), {"role": "gpu", "model": model + "-x"}, ttl_s=30)
    monkeypatch.setattr(Peers, "TTL_S", 0.5)
    peers = Peers(redis, names, model, me)
    assert gpu_workers_serving(redis, names, model) == {me}
    assert peers.any_other() is False
    Heartbeat(redis, names.worker(peer), {"role": "gpu", "model": model}, ttl_s=30)
    assert peers.any_other() is False  # read again only after TTL_S
    time.sleep(0.6)
    assert peers.any_other() is True
    assert gpu_workers_serving(redis, names, model) == {me, peer}
    redis.delete(names.worker(peer))  # its record expired
    time.sleep(0.6)
    assert peers.any_other() is False
