"""Leases on one clock: a host's clock and a paused broker never take a healthy job from its worker.

Every lease time is Redis's ``TIME`` (``store/transport.py``), so a worker whose clock runs a minute ahead
restores nothing that is held; after the broker was unreachable for longer than the lease, nothing is restored
until live workers had a whole lease to renew.  The first tests drive the transport directly (a kombu consumer
on a redis-server of their own, no model); the last two run a deployment on it: two GPU workers, one of them
with its clock +60 s (``PAGEDQ_CLOCK_OFFSET_S``), and a broker stopped (SIGSTOP) for twice the lease.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import uuid
from dataclasses import dataclass

import pytest
import redis as redis_py
from kombu import Connection, Exchange, Queue
from queue_helpers import DoneCounter, wait_until

from pagedq.config import Settings
from pagedq.config.celery_app import use_hardened_transport
from pagedq.config.names import Names
from pagedq.pipeline import Client
from pagedq.pipeline.local.redis_server import RedisServer
from pagedq.pipeline.local.stack import Stack
from pagedq.store import transport
from pagedq.store.jobs import JobStore
from pagedq.store.registry import Heartbeat

LEASE = 4  # the deployment's PAGEDQ_WORKER_TTL_S: renewals every 1 s, restore passes every 1.3 s
UNIT_LEASE = 2  # the transport-only tests' visibility timeout
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    """A redis-server of this module's own: the tests stop and continue its process."""
    server = RedisServer(tmp_path_factory.mktemp("lease-redis"), write_run_file=False)
    server.start()
    yield server
    os.kill(server.proc.pid, signal.SIGCONT)  # never leave it stopped, whatever a test did
    server.stop()


def paused(server: RedisServer, seconds: float) -> None:
    """The broker does nothing for ``seconds`` (its process stopped), then carries on; its clock keeps going."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


# --- the transport alone: one message, one holder, one other consumer ----------------------------------------
class Consumer:
    """A kombu consumer on the hardened transport holding the messages it takes (acks_late, never acked)."""

    def __init__(self, url: str, prefix: str, queue: Queue) -> None:
        use_hardened_transport()
        self.conn = Connection(url, transport_options={"visibility_timeout": UNIT_LEASE, "global_keyprefix": prefix})
        self.channel = self.conn.channel()
        self.taken: list = []
        self.consumer = self.conn.Consumer(queue, channel=self.channel, callbacks=[lambda b, m: self.taken.append(m)])
        self.consumer.qos(prefetch_count=10)
        self.consumer.consume()

    def take(self, n: int) -> None:
        deadline = time.monotonic() + 10
        while len(self.taken) < n and time.monotonic() < deadline:
            try:
                self.conn.drain_events(timeout=0.5)
            except TimeoutError:
                pass
        assert len(self.taken) == n

    def restore_pass(self) -> None:
        self.channel.qos.restore_visible(num=None, interval=1)

    def close(self) -> None:
        self.conn.release()


class Renewer(threading.Thread):
    """A consumer's renewal timer (every lease / 4, as a worker's), stoppable to play its death.  On a client of
    its own: the channel's client is the consumer's, used by the test's thread."""

    def __init__(self, consumer: Consumer, url: str) -> None:
        super().__init__(daemon=True)
        self.consumer, self.client, self.stopped = consumer, redis_py.Redis.from_url(url), threading.Event()
        self.start()

    def run(self) -> None:
        while not self.stopped.wait(UNIT_LEASE / 4):
            try:
                self.consumer.channel.lease_call(self.client, transport._RENEW, list(self.consumer.channel.qos._delivered))
            except redis_py.RedisError:
                pass

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.client.close()


@dataclass
class LeasePair:
    """A holder that took ``n`` messages and holds them; another consumer that holds none."""

    holder: Consumer
    other: Consumer
    r: redis_py.Redis
    prefix: str
    queue: str
    n: int

    def held(self) -> tuple[int, int]:
        """(messages taken and not acknowledged, messages back on the queue)."""
        return self.r.hlen(f"{self.prefix}unacked"), self.r.llen(f"{self.prefix}{self.queue}")


@pytest.fixture
def pair(broker):
    prefix = f"lease-{uuid.uuid4().hex[:8]}:"
    name = f"q-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), name)
    holder, other = Consumer(broker.url, prefix, queue), Consumer(broker.url, prefix, queue)
    n = random.randint(2, 5)
    with holder.conn.Producer() as producer:
        for i in range(n):
            producer.publish({"i": i, "nonce": uuid.uuid4().hex}, exchange=queue.exchange, routing_key=name,
                             declare=[queue])
    holder.take(n)
    r = redis_py.Redis.from_url(broker.url)
    yield LeasePair(holder, other, r, prefix, name, n)
    holder.close()
    other.close()
    r.close()


def test_a_renewal_between_selection_and_restore_keeps_the_message(pair, broker):
    lively = Renewer(pair.other, broker.url)  # keeps the lease clock stamped, as live consumers do
    time.sleep(UNIT_LEASE * 1.3)  # the holder renews nothing: every lease runs out
    with pair.other.channel.conn_or_acquire() as client:
        due = pair.other.channel.lease_call(client, transport._DUE, [0])
        assert len(due) == pair.n
        pair.holder.channel.renew_leases()  # the holder renews after the selection, before the restore
        assert not any(pair.other.channel.qos.restore_if_expired(tag, client) for tag in due)
    assert pair.held() == (pair.n, 0)
    time.sleep(UNIT_LEASE * 1.3)
    pair.other.restore_pass()
    lively.stop()
    assert pair.held() == (0, pair.n), "a lease that ran out by Redis's clock is restored"


def test_a_holder_that_wakes_after_its_messages_were_restored_cannot_ack_the_copies_another_consumer_runs(
        pair, broker):
    """A restored message comes back under a new delivery tag: the old holder (a worker frozen past its lease)
    acking or renewing its old tags touches nothing another consumer holds.  With kombu's one tag for every
    delivery, its ack deleted the running copies from ``unacked`` and the lost-job sweep sent their jobs again."""
    lively = Renewer(pair.other, broker.url)
    time.sleep(UNIT_LEASE * 1.3)  # the holder is frozen: its leases run out
    pair.other.restore_pass()
    assert pair.held() == (0, pair.n)
    pair.other.take(pair.n)  # the other consumer runs them now
    old = {m.delivery_tag for m in pair.holder.taken}
    new = {m.delivery_tag for m in pair.other.taken}
    assert len(new) == pair.n and not old & new, "every restored copy has a tag of its own"
    assert set(pair.r.hkeys(f"{pair.prefix}unacked")) == {t.encode() for t in new}
    pair.holder.channel.renew_leases()  # the holder wakes: renews, then acks what it thinks it holds
    for message in pair.holder.taken:
        message.ack()
    lively.stop()
    assert pair.held() == (pair.n, 0), "the copies the other consumer runs are still held, as leases"
    assert set(pair.r.hkeys(f"{pair.prefix}unacked")) == {t.encode() for t in new}
    for message in pair.other.taken:
        message.ack()
    assert pair.held() == (0, 0)


def test_after_a_broker_pause_longer_than_the_lease_live_holders_renew_first(pair, broker):
    renewer = Renewer(pair.holder, broker.url)
    time.sleep(UNIT_LEASE / 2)
    renewer.stop()  # its next renewal comes after the pause, and after another consumer's restore pass
    paused(broker, 2 * UNIT_LEASE)
    pair.other.restore_pass()  # the first lease call after the pause
    assert pair.held() == (pair.n, 0)
    renewer, lively = Renewer(pair.holder, broker.url), Renewer(pair.other, broker.url)
    for _ in range(6):  # a lease and a half: the holder renews, the other consumer keeps looking
        time.sleep(UNIT_LEASE / 4)
        pair.other.restore_pass()
    assert pair.held() == (pair.n, 0), "a live holder keeps its messages across the pause"
    renewer.stop()  # the holder dies: its messages come back once its lease runs out
    start = time.monotonic()
    wait_until(lambda: pair.other.restore_pass() or pair.held() == (0, pair.n), 4 * UNIT_LEASE, interval=0.3,
               what="the dead holder's messages back on the queue")
    lively.stop()
    print(f"{pair.n} messages of a dead holder restored {time.monotonic() - start:.1f} s after it stopped "
          f"(lease {UNIT_LEASE} s)")


# --- attempts: a job taken from a live worker is a second copy, not a restart -----------------------------------
def test_an_attempt_counts_only_once_the_previous_worker_is_gone_or_handed_the_job_back(redis):
    names = Names(key_prefix=f"adm{uuid.uuid4().hex[:6]}:")
    store = JobStore(redis, names, result_ttl_s=60, max_attempts=2)
    job = uuid.uuid4().hex
    store.create([(job, {"state": "queued", "priority": random.randint(0, 9)})], 10)
    workers = [f"gpu{i}.{uuid.uuid4().hex[:6]}" for i in range(2)]
    for w in workers:
        Heartbeat(redis, names.worker(w), {"role": "gpu"}, ttl_s=LEASE)  # a fresh record (not kept beating)

    def restore_and_admit(to: str) -> str:  # a lease restore takes the job from its holder; ``to`` takes it
        redis.eval(transport._REQUEUE_JOB, 1, names.job(job))
        return store.admit(job, worker=to)

    assert store.admit(job, worker=workers[0]) == "ok"
    for i in range(random.randint(3, 6)):  # holders alive: however often, no attempt, never poison
        assert restore_and_admit(workers[(i + 1) % 2]) == "ok"
    record = store.get(job)
    assert record["attempts"] == "1" and int(record["redeliveries"]) >= 3
    redis.pexpire(names.worker(record["worker"]), int(LEASE * 1000 * 0.4))  # its last beat: 60% of a TTL ago
    other = next(w for w in workers if w != record["worker"])
    assert restore_and_admit(other) == "ok" and store.get(job)["attempts"] == "2"
    store.requeue(job)  # an orderly hand-back, holder alive: not an attempt, and the next start is one
    assert store.admit(job, worker=workers[0]) == "ok" and store.get(job)["attempts"] == "2"
    store.requeue(job, count_attempt=True)  # its replica was lost: the next start counts, alive or not
    assert store.admit(job, worker=workers[1]) == "poison"


# --- a deployment: a skewed worker and a paused broker take no job from a live worker ---------------------------
def clock_ahead_s(client: Client, hostname: str) -> float:
    """How far a worker's clock runs ahead of Redis's: its record's ``updated_at`` (its own ``time.time()``)
    against ``beat_at`` (Redis's ``TIME`` at its heartbeat)."""
    rec = client.r.hgetall(client.names.worker(hostname))
    return float(rec.get("updated_at", 0)) - float(rec.get("beat_at", 0))


@pytest.fixture(scope="module")
def deployment(broker, tmp_path_factory):
    """Two GPU workers (the second's clock +60 s) and a CPU worker on this module's broker; a client."""
    prefix = f"pls{uuid.uuid4().hex[:6]}"
    s = Settings(broker_url=broker.url, key_prefix=f"{prefix}:", queue_prefix=f"{prefix}.", result_cache=False,
                 kv_cache_memory="256MiB", progress_interval_s=0.5, worker_ttl_s=LEASE, max_num_seqs=4)
    with Stack(s, log_dir=tmp_path_factory.mktemp("lease-logs")) as stack, Client(s, stack.url) as client:
        skewed = stack.add_worker("gpu", extra_env={"PAGEDQ_CLOCK_OFFSET_S": "60"})
        stack.wait_ready(600, [skewed])
        wait_until(lambda: clock_ahead_s(client, skewed.hostname) > 55, 30,
                   what="the second worker's clock 60 s ahead in its record")
        start = time.monotonic()
        client.result(client.submit(prompt="Count:", max_tokens=32, **GREEDY), timeout=300)
        rate = 32 / (time.monotonic() - start)
        yield stack, client, rate


def run_long_jobs(client: Client, rate: float, seconds: float, during=None) -> tuple[list[str], dict]:
    """Four jobs of about ``seconds`` each (two per worker); ``during()`` once all run. Returns them and the
    number of terminal publications per job."""
    counter = DoneCounter(client.r, client.names)
    max_tokens = max(48, min(4000, int(rate * seconds)))
    jobs = [client.submit(prompt=f"A long story, part {random.randint(1, 10**6)}:", max_tokens=max_tokens, **GREEDY)
            for _ in range(4)]
    wait_until(lambda: all(int(client.status(j).completion_tokens or 0) > 0 for j in jobs), 300,
               what="all four jobs running")
    if during is not None:
        during()
    results = [client.result(j, timeout=600) for j in jobs]
    time.sleep(1)
    counter.stop()
    assert all(res["usage"]["completion_tokens"] == max_tokens for res in results)
    return jobs, counter.counts


def assert_ran_once(client: Client, jobs: list[str], counts: dict) -> None:
    records = [client.r.hgetall(client.names.job(j)) for j in jobs]
    redelivered = [j for j, rec in zip(jobs, records, strict=True) if rec.get("redeliveries") or rec["attempts"] != "1"]
    print(f"{len(jobs)} jobs: redelivered {len(redelivered)}, "
          f"failed {sum(rec['state'] != 'completed' for rec in records)}, "
          f"published twice {sum(counts[j] > 1 for j in jobs)}, on {sorted({rec['worker'] for rec in records})}")
    assert all(rec["state"] == "completed" for rec in records), "no healthy job fails (as poison or else)"
    assert not redelivered, f"healthy jobs redelivered: {[(j, client.r.hgetall(client.names.job(j))) for j in redelivered]}"
    assert all(counts[j] == 1 for j in jobs), f"published twice or never: {counts}"


def test_a_worker_whose_clock_runs_a_minute_ahead_takes_no_job_from_another(deployment):
    stack, client, rate = deployment
    start = time.monotonic()
    jobs, counts = run_long_jobs(client, rate, seconds=3 * LEASE)
    took = time.monotonic() - start
    print(f"four jobs in {took:.0f} s under a {LEASE} s lease, one worker's clock +60 s")
    assert_ran_once(client, jobs, counts)
    workers = {client.r.hget(client.names.job(j), "worker") for j in jobs}
    assert len(workers) == 2, "both workers held jobs while the other's restore passes ran"
    assert took > 2 * LEASE


def test_a_broker_paused_longer_than_the_lease_takes_no_job_from_a_live_worker(deployment, broker):
    stack, client, rate = deployment
    use_hardened_transport()
    conn = Connection(broker.url, transport_options={"visibility_timeout": LEASE,
                                                     "global_keyprefix": client.settings.key_prefix})
    channel = conn.channel()  # one more consumer of the deployment, connected before the pause
    channel.client.ping()

    def pause_then_restore_first() -> None:  # its restore pass goes out as the broker comes back
        paused(broker, 2 * LEASE)
        channel.qos.restore_visible(num=None, interval=1)

    jobs, counts = run_long_jobs(client, rate, seconds=3 * LEASE, during=pause_then_restore_first)
    conn.release()
    assert_ran_once(client, jobs, counts)
    names = Names.from_settings(client.settings)
    clock = client.r.hgetall(names.lease_clock)
    assert float(clock["resumed"]) > float(clock["seen"]) - 60, "the pause was seen as the broker coming back"


def test_a_hand_back_takes_back_only_an_attempt_its_admit_counted(redis):
    names = Names(key_prefix=f"adm{uuid.uuid4().hex[:6]}:")
    store = JobStore(redis, names, result_ttl_s=60, max_attempts=3)
    job = uuid.uuid4().hex
    store.create([(job, {"state": "queued", "priority": random.randint(0, 9)})], 10)
    holder, taker = (f"gpu{i}.{uuid.uuid4().hex[:6]}" for i in range(2))
    for w in (holder, taker):
        Heartbeat(redis, names.worker(w), {"role": "gpu"}, ttl_s=LEASE)
    assert store.admit(job, worker=holder) == "ok" and store.get(job)["attempts"] == "1"
    redis.eval(transport._REQUEUE_JOB, 1, names.job(job))  # a lease restore while the holder lives
    assert store.admit(job, worker=taker) == "ok" and store.get(job)["attempts"] == "1"  # spared: not counted
    store.requeue(job)  # the taker drains: it hands back a start that counted nothing
    assert store.get(job)["attempts"] == "1"  # was 0: the next death would not have counted toward poison
    assert store.admit(job, worker=holder) == "ok" and store.get(job)["attempts"] == "2"
    redis.delete(names.worker(holder))
    redis.hset(names.worker(holder), "role", "gpu")  # a record without a TTL (no heartbeat) proves nothing
    redis.eval(transport._REQUEUE_JOB, 1, names.job(job))
    assert store.admit(job, worker=taker) == "ok" and store.get(job)["attempts"] == "3"



def test_running_jobs_keep_their_messages_across_a_broker_crash(deployment, broker):
    """kill -9 of the broker while four jobs run, restarted on its port (its append-only file) 2.5 s later: each
    worker's consumer closes its channel and connects again, its tasks running on.  kombu's close put the running
    jobs' messages back on their queue, or with the broker down left them to expire a lease after it came back:
    either way each ran again.  The handover keeps them with the tasks that run them, renewed by the new channel
    for longer than a lease, and acknowledged through it."""
    stack, client, rate = deployment
    names = Names.from_settings(client.settings)

    def crash_and_restart() -> None:
        broker.proc.send_signal(signal.SIGKILL)
        broker.proc.wait()
        time.sleep(2.5)
        broker.start()

    jobs, counts = run_long_jobs(client, rate, seconds=4 * LEASE, during=crash_and_restart)
    assert_ran_once(client, jobs, counts)
    wait_until(lambda: client.r.hlen(names.unacked) == 0, 10, what="every message acknowledged")
