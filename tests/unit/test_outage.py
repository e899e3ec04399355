"""``store.connection.through_outage``: a worker's last writes of a job wait for a broker that is restarting (a
failover, a crash and restart) instead of failing the task, and give up after their bound; against a real
redis-server killed and started again on its port."""

from __future__ import annotations

import random
import signal
import threading
import time
import uuid

import pytest
import redis as redis_py

from pagedq.pipeline.local.redis_server import RedisServer
from pagedq.store.connection import redis_client, through_outage


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path / "redis", write_run_file=False)
    s.start()
    yield s
    s.stop()


def crash(server: RedisServer) -> None:
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()


def test_a_write_waits_out_a_broker_restart(server):
    r = redis_client(server.url, timeout_s=2)
    key, amount = f"outage:{uuid.uuid4().hex}", random.randint(2, 10**6)
    r.set("warm", 1)  # a pooled connection, which the crash breaks
    crash(server)
    calls, out = [], []

    def write() -> int:
        calls.append(time.monotonic())
        return r.incrby(key, amount)

    # The write in a thread, the restart here: a server started from a thread dies with it (its parent-death
    # signal follows the thread that spawned it).
    writer = threading.Thread(target=lambda: out.append(through_outage(write, "test write", wait_s=30)))
    start = time.monotonic()
    writer.start()
    time.sleep(1.5)
    server.start()
    writer.join(60)
    assert out == [amount], "the write went through once the broker was back"
    assert time.monotonic() - start >= 1.5 and calls[0] - start < 1.0, "it waited for the restart"
    assert len(calls) >= 2, "the first call failed and was made again"
    assert int(r.get(key)) == amount
    r.close()


def test_a_broker_gone_longer_than_the_bound_raises(server):
    r = redis_client(server.url, timeout_s=2)
    crash(server)
    start = time.monotonic()
    with pytest.raises(redis_py.ConnectionError):
        through_outage(lambda: r.set("k", random.random()), "test write", wait_s=1.5)
    assert 1.5 <= time.monotonic() - start < 10
    server.start()  # for the fixture's stop
    r.close()
