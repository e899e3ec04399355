"""The chaos scenarios of ``scripts/chaos.py``, smaller: every fault ends with 0 lost and 0 published twice."""

from __future__ import annotations

import ast
import subprocess
import sys
import threading
import time

import chaos
import pytest

from pagedq.config import Settings
from pagedq.config.names import Names
from pagedq.pipeline import Client
from pagedq.pipeline.local.redis_server import RedisServer
from pagedq.pipeline.local.stack import Stack, judge_workers


def check(row: chaos.Row, min_completed: int) -> None:
    print(chaos.HEADER + "\n" + row.line())
    assert row.lost == 0, f"{row.lost} job(s) never ended"
    assert row.twice == 0, f"{row.twice} job(s) published twice"
    assert row.completed >= min_completed
    assert row.completed + row.failed == row.submitted


def test_kill_gpu_worker():
    row = chaos.gpu_kill(jobs=8, tokens=64)
    check(row, 8)
    assert row.recover_s is not None and row.recover_s <= 30


def test_kill_cpu_worker():
    check(chaos.cpu_kill(jobs=24, tokens=8), 24)


def test_kill_one_pipeline_stage():
    row = chaos.stage_kill(jobs=6, tokens=64)
    check(row, 6)
    assert f"exit code {3}" in row.notes[0]


def test_kill_and_restart_redis():
    check(chaos.redis_kill(jobs=8, tokens=64), 8)


def test_sigterm_drains():
    row = chaos.sigterm(jobs=6, tokens=48)
    check(row, 6)
    finished, running = row.notes[0].split(" running")[0].split("/")
    assert int(finished) == int(running) > 0, "running jobs finish during the drain, not after a requeue"


def test_redis_paused():
    row = chaos.redis_pause(jobs=6, tokens=48, pause_s=8)
    check(row, 6)
    assert "BrokerUnavailable after" in row.notes[0]


@pytest.mark.parametrize("bad", [120])
def test_generated_bad_requests_and_garbage(bad):
    row = chaos.garbage(bad=bad, good=10)
    check(row, 10)
    assert row.notes[-1] == "workers alive"


def test_backlog_of_short_jobs():
    check(chaos.backlog(jobs=100), 100)


def test_kill_every_worker_and_up_again():
    """Every worker killed -9 at once while most jobs run, then a fresh stack reusing live workers (``pagedq up``
    restarted): it must ignore the dead workers' unexpired records, and its workers restore their leases.
    12 jobs of 16…120 tokens, lease 6 s (full size, ``python scripts/chaos.py all_kill``: 40 jobs of 32…500,
    lease 15 s)."""
    row = chaos.all_kill(jobs=12, lo=16, hi=120, ttl_s=6)
    check(row, 12)
    assert "ignoring" in row.notes[0] and "reusing" not in row.notes[0], row.notes[0]
    assert "started 1 GPU + 1 CPU" in row.notes[0]
    assert row.recover_s is not None and row.recover_s <= 30


def test_kill_and_restart_redis_under_load():
    """redis-server killed -9 (AOF everysec) while most jobs run, restarted on the same port and data dir, the
    workers left alone: every job completes once, and every interrupted job is generating again (or done)
    within 30 s of the restart.  12 jobs of 16…120 tokens, lease 6 s (full size, ``python scripts/chaos.py
    redis_kill_busy``: 40 jobs of 32…500, lease 15 s)."""
    row = chaos.redis_kill_busy(jobs=12, lo=16, hi=120, ttl_s=6)
    check(row, 12)
    assert row.recover_s is not None and row.recover_s <= 30


@pytest.mark.parametrize("ack", [1, 0])
def test_kill_9_of_the_redis_master_sentinel_fails_over(ack):
    """A master, two replicas and three sentinels (real servers); kill -9 of the master while most jobs run:
    Sentinel promotes a replica, and the workers, the producer (more jobs submitted after) and the done-channel
    listener follow it with no process restarted; every job completes once, each interrupted one generating
    again within 30 s of Sentinel's down-after time; the old master, started again, is a replica.  With
    ``PAGEDQ_REDIS_MIN_REPLICAS_ACK=1`` nothing acknowledged can be lost; without it the window is the
    replication lag (on loopback well under a millisecond, and every job here was submitted seconds before the
    kill).  10 jobs of 16…120 tokens (full size, ``python scripts/chaos.py sentinel_failover``: 40 of 32…500)."""
    row = chaos.sentinel_failover(jobs=10, lo=16, hi=120, ack=ack)
    check(row, 11)
    assert row.recover_s is not None and row.recover_s <= chaos.DOWN_AFTER_MS / 1000 + 30, row.notes[0]
    assert row.notes[-1] == "old master back as a replica: True"


def test_kill_9_of_the_first_listed_sentinel_and_the_master():
    """As above with the first sentinel of every process's URL killed -9 just before the master: the two left
    fail over, everyone finds the master through them (a dead sentinel costs a refused connection, not
    redis-py's retries: 13.0 s measured, 36-41 s before), every job completes once."""
    row = chaos.sentinel_failover(jobs=10, lo=16, hi=120, ack=1, kill_sentinel=True)
    check(row, 11)
    assert row.recover_s is not None and row.recover_s <= chaos.DOWN_AFTER_MS / 1000 + 30, row.notes[0]
    assert row.notes[0].startswith("first-listed sentinel killed") and row.notes[-1].endswith("replica: True")


def test_a_gpu_worker_frozen_past_its_lease_is_fenced_when_it_wakes():
    """Two GPU workers; SIGSTOP of the one running most jobs until the other has restored all of its jobs, then
    SIGCONT: every job completes once (published once), and the finishes the woken worker attempts for the jobs
    it lost are refused (counted in ``names.fenced``)."""
    row = chaos.gpu_freeze(jobs=8, tokens=96)
    check(row, 8)
    assert row.notes[-1] == "0 sent again by the lost-job sweep", row.notes  # its acks left the copies alone
    note = row.notes[-2]
    held = int(note.split(" running on it")[0])
    refused = ast.literal_eval(note.split("writes refused after the SIGCONT: ")[1].split("; it ")[0])
    assert held >= 1 and refused.get("finish", 0) >= held, note  # jobs it had taken but not started count too


IDENTITY = "from pagedq.workers.processes import process_identity as p; import json, time; " \
           "print(json.dumps(p()), flush=True); time.sleep(60)"


def test_up_reuses_only_workers_shown_alive(redis):
    """``pagedq up``'s judgement of registered workers, on real processes and the real Redis: on this host a
    worker counts only while its recorded pid runs and is the same process (a killed one, and a record naming
    this pid with another start time, do not); elsewhere only while its record is renewed."""
    import json

    names = Names(key_prefix=f"reuse{time.time_ns()}:")
    procs = [subprocess.Popen([sys.executable, "-c", IDENTITY], stdout=subprocess.PIPE, text=True) for _ in "ab"]
    try:
        alive, killed = (json.loads(p.stdout.readline()) for p in procs)
        procs[1].kill()
        procs[1].wait()
        reused_pid = {**alive, "pid_start": "1"}  # the pid of a process that started at another time
        records = {"gpu0.1@here": {**alive, "role": "gpu"}, "cpu0.1@here": {**killed, "role": "cpu"},
                   "gpu1.1@here": {**reused_pid, "role": "gpu"},
                   "gpu0.2@far": {"role": "gpu", "host": "far", "pid": "7"},
                   "cpu0.2@far": {"role": "cpu", "host": "far", "pid": "8"}}
        for host, rec in records.items():
            redis.hset(names.worker(host), mapping=rec)
            redis.expire(names.worker(host), 60)
        stop = threading.Event()

        def heartbeat() -> None:  # only gpu0.2@far's worker runs
            while not stop.wait(0.5):
                redis.expire(names.worker("gpu0.2@far"), 60)

        threading.Thread(target=heartbeat, daemon=True).start()
        verdicts = {v.hostname: v for v in judge_workers(redis, names, records, ttl_s=3)}
        stop.set()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert {h for h, v in verdicts.items() if v.alive} == {"gpu0.1@here", "gpu0.2@far"}
    assert verdicts["gpu0.1@here"].line() == f"reusing gpu0.1@here (pid {alive['pid']}, alive)"
    assert verdicts["cpu0.1@here"].line() == f"ignoring cpu0.1@here: pid {killed['pid']} is not running"
    assert verdicts["gpu1.1@here"].line() == f"ignoring gpu1.1@here: pid {alive['pid']} is not running"
    assert verdicts["cpu0.2@far"].line() == "ignoring cpu0.2@far: on far, no heartbeat within 2 s"


def test_worker_consumes_again_after_broker_crash(tmp_path):
    """A worker that holds a message and waits on its queue (BRPOP) when redis-server is killed -9 reconnects
    and consumes again.  kombu used to close that channel after Celery had dropped the transport's client, and
    restoring the held messages then raised AttributeError, which Celery takes as unrecoverable: the worker
    never consumed again, and the jobs it held sat ``queued`` once their leases ran out (the strand of
    ``redis_kill_busy``).  No model: a CPU worker alone holds each job's preprocess (an ETA retry while it waits
    for a model) and ends it ``model_not_found`` after ``model_wait_s``."""
    server = RedisServer(tmp_path / "redis", write_run_file=False)
    server.start()
    settings = Settings(broker_url=server.url, model_wait_s=3, worker_ttl_s=6, result_cache=False)
    try:
        with Stack(settings, gpu_workers=0, cpu_workers=1, log_dir=tmp_path / "logs") as stack:
            client = Client(settings, server.url)
            held = client.submit(prompt="held at the crash", max_tokens=4)
            time.sleep(2)  # taken, retried once, held; and more than AOF's last second ago
            server.proc.kill()
            server.proc.wait()
            time.sleep(1)
            server = RedisServer(server.data_dir, write_run_file=False)
            server.start()
            after = client.submit(prompt="sent after the restart", max_tokens=4)
            for job in (held, after):
                deadline = time.monotonic() + 60
                while not client.status(job).done and time.monotonic() < deadline:
                    time.sleep(0.5)
                status = client.status(job)
                assert status.done, f"{job} still {status.state}: the worker stopped consuming"
                assert status.error["code"] == "model_not_found"
            [worker] = stack.children
            assert worker.proc.poll() is None
            assert "Unrecoverable error" not in worker.log_path.read_text()
            client.close()
    finally:
        server.stop()
