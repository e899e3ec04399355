"""No job lost, stranded or run twice: leases, worker loss, backpressure, bad input at the edge.

Real redis-server and worker processes; the prefixes ``prl:`` / ``prl.`` on the session's Redis.
"""

from __future__ import annotations

import json
import signal
import time
import uuid

import pytest
from queue_helpers import DoneCounter, broker_depth, wait_until

from pagedq.config import Settings
from pagedq.config.messages import to_json
from pagedq.pipeline import Client, RequestError
from pagedq.pipeline.local.stack import Stack

TIMEOUT = 180
GREEDY = {"temperature": 0, "ignore_eos": True}


def settings_for(redis_url: str, prefix: str, **kw) -> Settings:
    return Settings(broker_url=redis_url, key_prefix=f"{prefix}:", queue_prefix=f"{prefix}.", result_cache=False,
                    kv_cache_memory="256MiB", progress_interval_s=0.5, **kw)


def all_keys(client: Client) -> set[str]:
    return set(client.r.scan_iter(match=f"{client.settings.key_prefix}*", count=1000))


# --- the edge: bad requests and a full queue leave no trace ------------------------------------------------
STUCK_OR_RAW_ERRORS = [  # each was accepted by an earlier pagedq and then never ended, or ended in a raw error
    ("messages.0.content", {"messages": [{"role": "user", "content": "\ud800"}]}),
    ("stop", {"messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]}),
    ("user", {"messages": [{"role": "user", "content": "hi"}], "user": "\ud800"}),
    ("seed", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}),
    ("seed", {"messages": [{"role": "user", "content": "hi"}], "seed": -1}),
    ("top_k", {"messages": [{"role": "user", "content": "hi"}], "top_k": 10**30, "temperature": 1}),
    ("repetition_penalty", {"messages": [{"role": "user", "content": "hi"}], "repetition_penalty": 1e308}),
]


@pytest.fixture(scope="module")
def edge_client(redis_url):
    with Client(settings_for(redis_url, "pre", max_queued_jobs=3), redis_url) as client:
        yield client


@pytest.mark.parametrize("param, body", STUCK_OR_RAW_ERRORS)
def test_requests_that_used_to_get_stuck_are_refused_at_submit(edge_client, param, body):
    before = all_keys(edge_client)
    with pytest.raises(RequestError) as e:
        edge_client.submit(**body)
    assert e.value.param.split(".")[0] == param.split(".")[0] and str(e.value).startswith(param)
    assert all_keys(edge_client) == before and broker_depth(edge_client) == 0


def test_tiny_temperature_is_greedy_not_an_error(edge_client):
    job = edge_client.submit([{"role": "user", "content": "hi"}], temperature=1e-30)
    edge_client.cancel(job)  # no worker here: it was accepted, as greedy
    assert edge_client.status(job).state == "cancelled"


def test_beyond_the_backlog_bound_submit_raises_queue_full_and_writes_nothing(edge_client):
    client = edge_client
    jobs = [client.submit(prompt=f"job {i}", max_tokens=4) for i in range(3)]
    assert client.store.backlog(client.settings.model) == 3
    before, depth = all_keys(client), broker_depth(client)
    with pytest.raises(RequestError) as e:
        client.submit(prompt="one too many", max_tokens=4)
    assert e.value.code == "queue_full"
    lines = [{"custom_id": f"b{i}", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 2}}
             for i in range(2)]
    with pytest.raises(RequestError, match="full"):
        client.submit_batch(lines)  # all or nothing
    assert all_keys(client) == before and broker_depth(client) == depth
    client.cancel(jobs[0])  # an ended job frees its place
    assert client.store.backlog(client.settings.model) == 2
    jobs.append(client.submit(prompt="now it fits", max_tokens=4))
    for job in jobs[1:]:
        client.cancel(job)
    assert client.store.backlog(client.settings.model) == 0


def test_submit_batch_refuses_a_string_that_is_not_a_path(edge_client):
    with pytest.raises(TypeError, match="not an existing file"):
        edge_client.submit_batch("requests.jsonl")


# --- leases: a live worker keeps its jobs however long they run; a dead one's come back -----------------------
def tokens_per_second(client: Client) -> float:
    start = time.monotonic()
    client.result(client.submit(prompt="Count:", max_tokens=64, **GREEDY), timeout=TIMEOUT)
    return 64 / (time.monotonic() - start)


def test_a_job_longer_than_the_visibility_timeout_runs_once_on_a_live_worker(redis_url, tmp_path):
    s = settings_for(redis_url, "prv", visibility_timeout_s=5)
    with Stack(s, log_dir=tmp_path) as stack, Client(s, stack.url) as client:
        rate = tokens_per_second(client)
        max_tokens = min(7000, int(rate * 45))  # about 45 s: nine times the 5 s lease
        gpu = next(c for c in stack.children if c.role == "gpu")
        received = int(client.r.hget(client.names.worker(gpu.hostname), "jobs_received"))
        start = time.monotonic()
        job = client.submit(prompt="A very long story:", max_tokens=max_tokens, **GREEDY)
        result = client.result(job, timeout=600)
        took = time.monotonic() - start
        print(f"{max_tokens} tokens in {took:.0f} s with a 5 s lease")
        status = client.status(job)
        assert result["usage"]["completion_tokens"] == max_tokens
        assert took > 3 * 5, "the job must outlive the lease several times over"
        assert status.attempts == 1 and client.r.hget(client.names.job(job), "redeliveries") is None
        stats = client.r.hgetall(client.names.worker(gpu.hostname))
        assert int(stats["jobs_received"]) == received + 1, "the generate task was delivered once"


def write_without_sending(client: Client, prompt: str, max_tokens: int) -> str:
    """What a producer killed between writing a job and sending its message leaves behind: a job, no message."""
    url, body = "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, **GREEDY}
    req = client.validate(url, {**body, "model": client.settings.model, "priority": 5})
    job = uuid.uuid4().hex
    msg = client._preprocess_message(job, url, req)
    client.store.create([(job, client._job_record(req, None))], 10, messages={job: json.dumps(to_json(msg))})
    return job


def test_killed_gpu_worker_jobs_are_back_on_the_queue_within_the_lease(redis_url, tmp_path):
    """Also: a job whose message never reached the queue is found by the lost-job sweep and completes."""
    s = settings_for(redis_url, "prk", worker_ttl_s=10, max_num_seqs=8, send_grace_s=5)
    with Stack(s, log_dir=tmp_path) as stack, Client(s, stack.url) as client:
        counter = DoneCounter(client.r, client.names)
        unsent = write_without_sending(client, "A job its producer never sent:", 12)
        jobs = [client.submit(prompt=f"Story number {i}:", max_tokens=96, **GREEDY) for i in range(8)]
        first = next(c for c in stack.children if c.role == "gpu")
        wait_until(lambda: all(int(client.status(j).completion_tokens or 0) > 0 for j in jobs), TIMEOUT,
                   what="all jobs running")
        running = [j for j in jobs if not client.status(j).done]
        assert running, "the kill came too late to matter"
        first.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        first.proc.wait()
        stack.children.remove(first)
        second = stack.add_worker("gpu")  # the replacement, started at once
        wait_until(lambda: all(client.status(j).state in ("queued", "completed") or
                               client.status(j).worker == second.hostname for j in running),
                   60, interval=0.2, what="the dead worker's jobs to go back on the queue")
        back_after = time.monotonic() - killed_at
        print(f"{len(running)} running jobs back on the queue {back_after:.1f} s after kill -9 (lease 10 s)")
        assert back_after <= 30
        results = [client.result(j, timeout=600) for j in jobs]
        lost = client.result(unsent, timeout=120)  # before counter.stop(): its publication must be counted
        time.sleep(1)
        counter.stop()
        assert all(r["usage"]["completion_tokens"] == 96 for r in results)
        assert all(counter.counts[j] == 1 for j in jobs), f"published twice or never: {counter.counts}"
        assert all(client.status(j).attempts == 2 for j in running)
        assert lost["usage"]["completion_tokens"] == 12 and counter.counts[unsent] == 1
        assert client.r.hget(client.names.job(unsent), "resent") == "1"
        assert client.r.zcard(client.names.active_jobs) == 0
