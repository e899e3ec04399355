"""``PAGEDQ_REDIS_MIN_REPLICAS_ACK``: submit returns only once a replica holds the job, and a job's end is announced
only once a replica holds it; against a real master and replica (the replica paused with SIGSTOP to stop its
acknowledgements)."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis
from redis_nodes import master_and_replica

from pagedq.config import Settings
from pagedq.config.names import JobState
from pagedq.pipeline import Client, NotReplicated
from pagedq.store.transport import job_id_of

ACK_TIMEOUT_S = 1.0


@pytest.fixture
def pair(tmp_path):
    with master_and_replica(tmp_path) as nodes:
        yield nodes


def settings_for(port: int, password: str, acks: int) -> tuple[Settings, str]:
    tag = uuid.uuid4().hex[:8]
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    return Settings(broker_url=url, key_prefix=f"ra{tag}:", queue_prefix=f"ra{tag}.", result_cache=False,
                    redis_min_replicas_ack=acks, redis_replica_ack_timeout_s=ACK_TIMEOUT_S), url


def messages_on(r: redis.Redis, client: Client) -> set[str]:
    """Job ids of the preprocess messages waiting on ``r`` (a master or a replica)."""
    lists = client.names.broker_lists(client.names.preprocess_queue)
    return {job_id_of(json.loads(raw)) for key in lists for raw in r.lrange(key, 0, -1)}


def heard(ps, timeout: float) -> dict | None:
    """The next message published on ``ps``'s channels within ``timeout`` seconds (subscribe replies skipped)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        message = ps.get_message(timeout=left)
        if message is not None:
            return message
    return None


def lines(n: int) -> list[dict]:
    return [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"line {i} {uuid.uuid4().hex}", "max_tokens": 4}} for i in range(n)]


def test_submit_returns_once_a_replica_holds_the_job_and_raises_not_replicated_when_none_confirms(pair):
    master, replica, pw = pair
    settings, url = settings_for(master.port, pw, acks=1)
    on_replica = redis.Redis(port=replica.port, password=pw, decode_responses=True)
    with Client(settings, url) as client:
        job = client.submit(prompt=f"replicated {uuid.uuid4().hex}", max_tokens=4)
        batch = client.submit_batch(lines(5))
        batch_jobs = on_replica.lrange(client.names.batch_jobs(batch), 0, -1)
        assert on_replica.hget(client.names.job(job), "state") == JobState.QUEUED
        assert len(batch_jobs) == 5 and {job, *batch_jobs} <= messages_on(on_replica, client)
        replica.pause()
        try:
            started = time.monotonic()
            with pytest.raises(NotReplicated, match="PAGEDQ_REDIS_MIN_REPLICAS_ACK") as e:
                client.submit(prompt=f"not confirmed {uuid.uuid4().hex}", max_tokens=4)
            waited = time.monotonic() - started
            (unconfirmed,) = e.value.job_ids
            with pytest.raises(NotReplicated) as e:
                client.submit_batch(lines(3))
            assert len(e.value.job_ids) == 3
        finally:
            replica.resume()
    assert ACK_TIMEOUT_S * 0.9 <= waited < ACK_TIMEOUT_S + 3
    # written on the master all the same: a producer looks at its status before submitting again
    assert client.r.hget(client.names.job(unconfirmed), "state") == JobState.QUEUED
    assert unconfirmed in messages_on(client.r, client)


def test_without_the_option_submit_does_not_wait_for_a_replica(pair):
    master, replica, pw = pair
    settings, url = settings_for(master.port, pw, acks=0)
    with Client(settings, url) as client:
        client.submit(prompt="warm up", max_tokens=4)
        replica.pause()
        try:
            started = time.monotonic()
            job = client.submit(prompt=f"unreplicated {uuid.uuid4().hex}", max_tokens=4)
            waited = time.monotonic() - started
        finally:
            replica.resume()
        assert client.status(job).state == JobState.QUEUED
    assert waited < ACK_TIMEOUT_S * 0.5


def test_an_end_is_announced_only_once_a_replica_holds_it(pair):
    master, replica, pw = pair
    settings, url = settings_for(master.port, pw, acks=1)
    with Client(settings, url) as client:
        jobs = [client.submit(prompt=f"to end {uuid.uuid4().hex}", max_tokens=4) for _ in range(2)]
        with client.r.pubsub(ignore_subscribe_messages=True) as ps:
            ps.subscribe(*[client.names.done_channel(j) for j in jobs])
            replica.pause()
            try:
                assert client.store.finish(jobs[0], JobState.CANCELLED) is True  # ended on the master
            finally:
                replica.resume()
            assert heard(ps, 1.0) is None, "an end no replica confirmed was announced"
            assert client.status(jobs[0]).state == JobState.CANCELLED
            assert client.store.finish(jobs[1], JobState.CANCELLED) is True
            message = heard(ps, 5)
            assert message is not None and message["channel"] == client.names.done_channel(jobs[1])
            assert message["data"] == JobState.CANCELLED
        on_replica = redis.Redis(port=replica.port, password=pw, decode_responses=True)
        assert on_replica.hget(client.names.job(jobs[1]), "state") == JobState.CANCELLED
        assert client.store.finish(jobs[1], JobState.COMPLETED) is False  # once
