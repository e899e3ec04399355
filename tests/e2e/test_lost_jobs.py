"""The lost-job sweep against a real redis-server and the real producer (no workers, no model).

Messages are sent by ``Client.submit`` / ``submit_batch`` through Celery onto the real queue lists; what a
worker or a crash would do to them (pop a message and die, lose the last writes of the append-only file) is
done to those lists directly.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from pagedq.config import Settings
from pagedq.config.celery_app import send_preprocess
from pagedq.config.messages import to_json
from pagedq.config.names import JobState, broker_priority
from pagedq.pipeline.client import Client
from pagedq.pipeline.local.redis_server import RedisServer
from pagedq.store.jobs import JobStore
from pagedq.store.lost_jobs import LostJobSweep
from pagedq.store.transport import job_id_of

INTERVAL_S = 0.3


def make_client(url: str, **kw) -> Client:
    tag = uuid.uuid4().hex[:8]
    return Client(Settings(broker_url=url, key_prefix=f"lj{tag}:", queue_prefix=f"lj{tag}.", result_cache=False,
                           **kw), url)


@pytest.fixture
def client(redis_url):
    with make_client(redis_url, send_grace_s=1.0) as c:
        yield c


class Sender:
    """The CPU worker's resend: the real ``send_preprocess``; remembers which jobs it sent."""

    def __init__(self, client: Client) -> None:
        self.client, self.sent = client, []
        self._lock = threading.Lock()

    def __call__(self, msg, priority: int) -> None:
        with self._lock:
            self.sent.append(msg.job_id)
        send_preprocess(self.client.app, msg, priority)


def sweeper(client: Client, owner: str = "cpu-1", **kw) -> tuple[LostJobSweep, Sender]:
    sender = Sender(client)
    return LostJobSweep(client.store, sender, interval_s=INTERVAL_S, owner=owner, **kw), sender


def sweep_apart(sweep: LostJobSweep, n: int) -> list[list[str]]:
    """``n`` sweeps, one interval apart (as the CPU worker's thread runs them)."""
    results = []
    for _ in range(n):
        time.sleep(INTERVAL_S + 0.05)
        results.append(sweep.sweep())
    return results


def submit(client: Client, **kw) -> str:
    return client.submit(prompt=f"lost job test {uuid.uuid4().hex}", max_tokens=8, **kw)


def preprocess_lists(client: Client) -> list[str]:
    return client.names.broker_lists(client.names.preprocess_queue)


def messages_of(client: Client) -> Counter:
    """Job id -> how many messages on the preprocess lists name it."""
    return Counter(job_id_of(json.loads(raw)) for key in preprocess_lists(client) for raw in client.r.lrange(key, 0, -1))


def take_message(client: Client, job_id: str) -> str:
    """Remove the job's message from its queue, as a worker that popped it and died before recording it would."""
    for key in preprocess_lists(client):
        for raw in client.r.lrange(key, 0, -1):
            if job_id_of(json.loads(raw)) == job_id:
                client.r.lrem(key, 1, raw)
                return raw
    raise AssertionError(f"no message of {job_id}")


def orphans(client: Client, n: int) -> list[str]:
    """Jobs cancelled or expired while queued: each leaves its message on the queue."""
    jobs = []
    for i in range(n):
        if i % 2:
            job = submit(client)
            client.cancel(job)
        else:
            job = submit(client, timeout_s=0)
            assert client.store.expire_if_due(job)
        jobs.append(job)
    return jobs


def old_shortcut_sees_nothing_missing(client: Client) -> bool:
    """The count the sweep used to trust: as many messages as active jobs means none is missing."""
    r, n = client.r, client.names
    lists = [key for q in (n.preprocess_queue, n.results_queue) for key in n.broker_lists(q)]
    return sum(r.llen(key) for key in lists) + r.hlen(n.unacked) >= r.zcard(n.active_jobs)


# --- the Done-when test ------------------------------------------------------------------------------------------
def test_orphans_of_jobs_ended_while_queued_do_not_hide_a_lost_job_resent_within_two_sweeps(client):
    ended = orphans(client, random.randint(3, 8))
    waiting = [submit(client) for _ in range(random.randint(1, 4))]
    lost = submit(client)
    take_message(client, lost)
    assert all(client.status(j).state in ("cancelled", "expired") for j in ended)
    assert old_shortcut_sees_nothing_missing(client)  # the shape that hid the lost job from the old sweep
    sweep, sender = sweeper(client)
    assert sweep_apart(sweep, 2) == [[], [lost]]  # suspected, then sent again
    assert sender.sent == [lost]
    assert sweep_apart(sweep, 2) == [[], []]  # it has its message again; the orphans' messages name no active job
    held = messages_of(client)
    assert held[lost] == 1 and all(held[j] == 1 for j in waiting + ended)
    assert client.status(lost).state == "queued" and client.r.hget(client.names.job(lost), "resent") == "1"
    assert not any(client.r.hexists(client.names.job(j), "resent") for j in ended + waiting)


# --- the lock -------------------------------------------------------------------------------------------------
def test_two_sweepers_at_once_resend_each_lost_job_exactly_once(client):
    orphans(client, random.randint(4, 10))  # messages to page through (page=2): many calls, lock renewals
    lost = [submit(client) for _ in range(random.randint(3, 8))]
    for job in lost:
        take_message(client, job)
    (a, sent_a), (b, sent_b) = sweeper(client, "cpu-a", page=2), sweeper(client, "cpu-b", page=2)
    stop = threading.Event()

    def keep_sweeping(sweep: LostJobSweep) -> None:
        while not stop.is_set():
            sweep.sweep()
            time.sleep(random.uniform(0.005, 0.05))

    threads = [threading.Thread(target=keep_sweeping, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(set(sent_a.sent + sent_b.sent)) < len(lost) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(4 * INTERVAL_S)  # more sweeps by both, after every lost job was sent again
    stop.set()
    for t in threads:
        t.join()
    assert Counter(sent_a.sent + sent_b.sent) == Counter(lost)  # each once, whichever sweeper sent it
    assert all(client.r.hget(client.names.job(j), "resent") == "1" for j in lost)
    assert all(messages_of(client)[j] == 1 for j in lost)


def test_a_sweeper_whose_lock_was_taken_mid_sweep_sends_nothing_more(client):
    lost = [submit(client) for _ in range(2)]
    for job in lost:
        take_message(client, job)
    first = LostJobSweep(client.store, lambda msg, priority: None, interval_s=INTERVAL_S, owner="slow")
    assert sweep_apart(first, 1) == [[]]  # both suspected
    other, other_sender = sweeper(client, "other")
    sent_by_first: list[str] = []

    def pause_past_the_lock(msg, priority: int) -> None:
        """The first sweeper stalls after its first resend until its lock expired and another swept."""
        sent_by_first.append(msg.job_id)
        client.r.delete(client.names.sweep_lock)
        other.sweep()

    first.send = pause_past_the_lock
    time.sleep(INTERVAL_S + 0.05)
    assert first.sweep() == sent_by_first  # it lost the lock after its first resend: it stopped there
    assert len(sent_by_first) == 1 and len(other_sender.sent) == 1
    assert sorted(sent_by_first + other_sender.sent) == sorted(lost)  # each sent once, by one of them
    assert client.r.get(client.names.sweep_lock).startswith("other:")  # the first never released it
    assert not first.release()


# --- pending sends ------------------------------------------------------------------------------------------------
def test_a_job_written_but_not_yet_sent_is_left_alone_for_its_grace_then_sent_again(client):
    grace = client.settings.send_grace_s
    job = uuid.uuid4().hex  # what a producer killed between writing a job and sending its message leaves
    url, body = "/v1/completions", {"prompt": f"unsent {job}", "max_tokens": 8, "priority": 5}
    req = client.validate(url, {**body, "model": client.settings.model})
    msg = client._preprocess_message(job, url, req)
    written = time.monotonic()
    client.store.create([(job, client._job_record(req, None))], 10, messages={job: json.dumps(to_json(msg))})
    sweep, sender = sweeper(client)
    resent_after, swept_within_grace = None, 0
    for _ in range(int(grace / INTERVAL_S) + 6):
        resent = sweep_apart(sweep, 1)[0]
        if resent:
            resent_after = time.monotonic() - written
            break
        if time.monotonic() - written < grace:
            swept_within_grace += 1
            assert not client.r.sismember(client.names.lost_suspects, job)  # not even suspected
    assert swept_within_grace >= 1
    assert resent == [job] and resent_after is not None and resent_after >= grace
    assert sender.sent == [job] and messages_of(client)[job] == 1


def test_a_batch_slower_to_send_than_the_grace_has_none_of_its_jobs_resent(redis_url):
    with make_client(redis_url, send_grace_s=0.6) as client:
        real_send = client._send

        def slow_send(msg, priority, **how):  # a long send loop: 50,000 lines, or a slow link
            time.sleep(0.1)
            real_send(msg, priority, **how)

        client._send = slow_send
        n = random.randint(20, 30)  # ~2-3 s of sending: several graces
        lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                  "body": {"prompt": f"batch line {i} {uuid.uuid4().hex}", "max_tokens": 8}} for i in range(n)]
        sweep, sender = sweeper(client)
        batch: list[str] = []
        producer = threading.Thread(target=lambda: batch.append(client.submit_batch(lines)))
        producer.start()
        while producer.is_alive():
            sweep.sweep()
            time.sleep(0.1)
        producer.join()
        sweep_apart(sweep, 3)
        assert sender.sent == []
        jobs = client.r.lrange(client.names.batch_jobs(batch[0]), 0, -1)
        assert len(jobs) == n and all(messages_of(client)[j] == 1 for j in jobs)
        now_s = float(client.r.time()[0]) + 1
        assert all(client.r.zscore(client.names.active_jobs, j) <= now_s for j in jobs)  # every send confirmed


# --- a broker crash that loses its last writes ------------------------------------------------------------------------
def aof_file(data_dir: Path) -> Path:
    """The file a crash cuts short: appendonly.aof (Redis < 7), else the incremental file of appendonlydir."""
    single = data_dir / "appendonly.aof"
    return single if single.exists() else max((data_dir / "appendonlydir").glob("*.incr.aof"),
                                              key=lambda p: p.stat().st_mtime)


def test_jobs_whose_messages_vanished_with_the_last_writes_of_the_aof_are_sent_again(tmp_path):
    server = RedisServer(tmp_path / "redis", write_run_file=False, appendfsync="always")
    server.start()
    try:
        with make_client(server.url, send_grace_s=1.0) as client:
            ended = orphans(client, random.randint(3, 6))  # long before the crash, as every job below
            waiting = [submit(client) for _ in range(random.randint(2, 5))]
            running = submit(client, priority=0)  # alone on its priority's list
            popped = client.r.rpop(client.names.broker_list(client.names.preprocess_queue, broker_priority(0)))
            assert job_id_of(json.loads(popped)) == running
            aof = aof_file(server.data_dir)
            cut: list[int] = []
            real_send = client._send

            def send_after_the_cut(msg, priority, **how):  # everything from here on is in the lost last second
                cut.append(aof.stat().st_size)
                real_send(msg, priority, **how)

            client._send = send_after_the_cut
            last = submit(client)  # its record made it into the AOF; its message did not
            # kombu records the popped message in unacked only after the pop: lost too
            client.r.hset(client.names.unacked, uuid.uuid4().hex, f'[{popped}, "", "{client.names.preprocess_queue}"]')
            names, settings = client.names, client.settings
        server.proc.kill()
        server.proc.wait()
        with open(aof, "r+b") as f:
            f.truncate(cut[0])
        server.start()
        with Client(settings, server.url) as client:
            assert client.status(last).state == "queued" and client.status(running).state == "queued"
            held = messages_of(client)
            assert held[last] == 0 and held[running] == 0 and client.r.hlen(names.unacked) == 0
            assert old_shortcut_sees_nothing_missing(client)
            sweep, sender = sweeper(client)
            results = sweep_apart(sweep, 2)
            assert results == [[], [running]]  # confirmed sent before the crash: sent again within two sweeps
            deadline = time.monotonic() + 1.0 + 6 * INTERVAL_S
            while last not in sender.sent and time.monotonic() < deadline:
                sweep_apart(sweep, 1)
            assert sorted(sender.sent) == sorted([running, last])  # its send was pending: once its grace passed
            held = messages_of(client)
            assert all(held[j] == 1 for j in [running, last, *waiting, *ended])
            assert all(client.status(j).state in (JobState.CANCELLED, JobState.EXPIRED) for j in ended)
    finally:
        server.stop()


def test_a_finished_jobs_delta_stream_is_readable_then_gone_soon(redis_url):
    with make_client(redis_url) as client:
        store: JobStore = client.store
        job = submit(client)
        client.r.hset(client.names.job(job), "stream", 1)
        words = [uuid.uuid4().hex[:6] for _ in range(random.randint(2, 6))]
        for w in words:
            client.r.xadd(client.names.stream(job), {"type": "delta", "text": w}, maxlen=client.names.stream_maxlen,
                          approximate=True)
        store.finish(job, JobState.COMPLETED, result={"choices": [{"text": "".join(words)}]})
        ttl = client.r.ttl(client.names.stream(job))
        assert 0 < ttl <= client.names.stream_ttl_after_end_s < store.ttl
        entries = client.r.xrange(client.names.stream(job))
        assert [e["text"] for _, e in entries[:-1]] == words and entries[-1][1]["type"] == "end"
        assert client.r.ttl(client.names.result(job)) > client.names.stream_ttl_after_end_s
