"""The queue pipeline end to end: a real redis-server, real worker processes, no fakes, no eager mode.

One GPU worker (``pagedq worker``) and one CPU worker (``pagedq cpu-worker``)
serve the whole module.  The GPU worker
runs at most 9 jobs at once (``max_num_seqs=9``); the
priority test swaps in one that holds 4.  Everything uses the prefixes ``pqt:`` / ``pqt.`` on the
session's Redis.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest
from kombu import Producer
from queue_helpers import broker_depth, wait_until

from pagedq.config import Settings
from pagedq.config.names import (
    DISPATCH_TASK,
    GENERATE_TASK,
    POSTPROCESS_TASK,
    PREPROCESS_TASK,
    broker_priority,
)
from pagedq.pipeline import Client, JobFailedError, JobNotFoundError, RequestError
from pagedq.pipeline.local.stack import Stack, settings_env
from pagedq.workers.processes import free_port

TIMEOUT = 120
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    # result_cache off: these tests repeat requests and need each one to reach the engine
    return Settings(broker_url=redis_url, key_prefix="pqt:", queue_prefix="pqt.", result_cache=False, max_num_seqs=9,
                    kv_cache_memory="256MiB", progress_interval_s=0.5)


def gpu_worker(stack: Stack):
    return next(c for c in stack.children if c.role == "gpu")


@contextmanager
def gpu_worker_with(stack: Stack, **env: str):
    """Swap the module's GPU worker for one with other settings for the duration of a test."""
    def swap(extra: dict[str, str]) -> None:
        stack.stop_worker(gpu_worker(stack))
        stack.wait_ready(TIMEOUT, [stack.add_worker("gpu", extra)])
    swap({f"PAGEDQ_{k.upper()}": str(v) for k, v in env.items()})
    try:
        yield
    finally:
        swap({})


def worker_stats(client: Client, stack: Stack) -> dict[str, str]:
    return client.r.hgetall(client.names.worker(gpu_worker(stack).hostname))


def wait_idle(client: Client, stack: Stack) -> None:
    """No job left in the broker or the engine."""
    def idle() -> bool:
        s = worker_stats(client, stack)
        return s.get("requests") == "0" and s.get("inflight") == "0" and broker_depth(client) == 0
    wait_until(idle, TIMEOUT, what="an idle worker")


def job_count(client: Client) -> int:
    return sum(1 for _ in client.r.scan_iter(match=client.names.job("*"), count=1000))


def text_of(result: dict) -> str:
    choice = result["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


# --- submit -> complete -------------------------------------------------------------------------
def test_submit_completes(client):
    job = client.submit([{"role": "user", "content": "What is 2+2?"}], max_tokens=12, temperature=0)
    assert client.status(job).state == "queued"  # preprocessing alone takes longer than this call
    result = client.result(job, timeout=TIMEOUT)
    assert result["object"] == "chat.completion"
    assert result["choices"][0]["message"]["content"]
    assert result["choices"][0]["finish_reason"] in ("stop", "length")
    usage = result["usage"]
    assert usage["completion_tokens"] <= 12 and usage["prompt_tokens"] > 10
    st = client.status(job)
    assert st.state == "completed" and st.attempts == 1 and st.error is None
    assert st.created_at <= st.started_at <= st.completed_at
    assert st.completion_tokens == usage["completion_tokens"] and st.prompt_tokens == usage["prompt_tokens"]

    text_job = client.submit(prompt="The capital of France is", max_tokens=5, **GREEDY)
    text = client.result(text_job, timeout=TIMEOUT)
    assert text["object"] == "text_completion" and text["usage"]["completion_tokens"] == 5


def test_redelivered_postprocess_publishes_once(client):
    job = client.submit(prompt="One, two,", max_tokens=4, **GREEDY)
    first = client.result(job, timeout=TIMEOUT)
    completed_at = client.status(job).completed_at
    with client.r.pubsub(ignore_subscribe_messages=True) as ps:
        ps.subscribe(client.names.done_channel(job))
        redelivered = {"request_id": job, "kind": "text", "model": client.settings.model,
                       "output_token_ids": [42, 43], "num_prompt_tokens": 3, "finish_reason": "length"}
        for _ in range(2):
            client.app.send_task(POSTPROCESS_TASK, args=[redelivered], queue=client.names.results_queue)
        wait_until(lambda: broker_depth(client) == 0, 30, what="the copies to be consumed")
        time.sleep(0.5)
        assert ps.get_message(timeout=0.5) is None  # waiters heard the job finish once, not again
    assert client.result(job, timeout=5) == first
    assert client.status(job).completed_at == completed_at


def _batch_lines() -> list[str]:
    bodies = [
        ("chat-1", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Name three colors."}],
                                            "max_tokens": 16, "temperature": 0}),
        ("text-1", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}),
        ("bad-1", "/v1/chat/completions", {"messages": [], "max_tokens": 4}),
        ("chat-stop", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to ten."}],
                                               "max_tokens": 24, "temperature": 0, "stop": [","]}),
        ("text-2", "/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}),
        ("chat-2", "/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": "What is Redis?"}],
                                            "max_tokens": 10, "temperature": 0}),
    ]
    return [json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body}) for cid, url, body in bodies]


def _comparable(line: dict) -> dict:
    body = json.loads(json.dumps(line["response"]["body"]))
    for key in ("id", "created"):
        body.pop(key, None)
    body.get("usage", {}).pop("prompt_tokens_details", None)  # prefix-cache hits depend on history
    return {"custom_id": line["custom_id"], "status": line["response"]["status_code"], "body": body}


def test_results_identical_to_offline_run_batch(client, settings, tmp_path):
    lines = _batch_lines()
    batch = client.submit_batch(lines)
    queued = client.batch_results(batch, timeout=TIMEOUT)
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    # The CLI itself, with the same engine settings; passive OpenMP waits keep it fast on a shared machine.
    env = {**os.environ, **settings_env(settings), "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "run-batch", "--offline", "-i",
                    str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")], env=env, check=True, timeout=600)
    offline = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [_comparable(x) for x in queued] == [_comparable(x) for x in offline]
    assert [x["custom_id"] for x in queued] == ["chat-1", "text-1", "bad-1", "chat-stop", "text-2", "chat-2"]
    assert queued[2]["response"]["status_code"] == 400 and "messages" in queued[2]["error"]["message"]
    assert text_of(queued[3]["response"]["body"]).count(",") == 0


def test_batch_results_in_input_order(client):
    # Longest first: jobs finish in roughly the reverse of input order.
    lines = [{"custom_id": f"req-{i}", "url": "/v1/completions",
              "body": {"prompt": f"Item {i}:", "max_tokens": 40 - 6 * i, **GREEDY}} for i in range(6)]
    lines.insert(3, {"custom_id": "broken", "url": "/v1/completions", "body": {"prompt": "x", "top_p": 0}})
    batch = client.submit_batch(lines)
    out = client.batch_results(batch, timeout=TIMEOUT)
    assert [x["custom_id"] for x in out] == [x["custom_id"] for x in lines]
    good = [x for x in out if x["custom_id"] != "broken"]
    assert [x["response"]["body"]["usage"]["completion_tokens"] for x in good] == [40 - 6 * i for i in range(6)]
    finished = [client.status(j) for j in client.r.lrange(client.names.batch_jobs(batch), 0, -1)]
    order = [s.custom_id for s in sorted((s for s in finished if s.completed_at), key=lambda s: s.completed_at)]
    assert order != [x["custom_id"] for x in good]  # they did finish out of order
    status = client.batch_status(batch)
    assert status.done and status.request_counts == {"total": 7, "completed": 6, "failed": 1}
    assert out[3]["response"]["status_code"] == 400 and "top_p" in out[3]["error"]["message"]


def test_stream_yields_deltas_that_join_to_the_result(client):
    job = client.submit(prompt="Once upon a time, in a land far away,", max_tokens=48, stream=True, **GREEDY)
    deltas = list(client.stream(job, timeout=TIMEOUT))
    assert len(deltas) > 3
    assert "".join(deltas) == text_of(client.result(job, timeout=5))


def test_readme_streaming_example_streams_without_asking_at_submit(client):
    """README's example: submit (no stream=True), then stream the job; deltas arrive as they are generated."""
    start = time.monotonic()
    job = client.submit(prompt="Once upon a time", max_tokens=64, **GREEDY)
    arrivals, deltas = [], []
    for d in client.stream(job, timeout=TIMEOUT):
        arrivals.append(time.monotonic() - start)
        deltas.append(d)
    total = time.monotonic() - start
    print(f"{len(deltas)} deltas; first after {arrivals[0]:.2f} s of {total:.2f} s")
    assert len(deltas) >= 10
    assert arrivals[0] < total / 2, "the first delta arrives before the job is half done"
    assert "".join(deltas) == text_of(client.result(job, timeout=5))


# --- bad requests -------------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    ({}, "messages"),
    ({"messages": CHAT, "prompt": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": CHAT, "temperature": -1}, "temperature"),
    ({"messages": CHAT, "temperature": 3}, "temperature"),
    ({"messages": CHAT, "top_p": 0}, "top_p"),
    ({"messages": CHAT, "top_k": 0}, "top_k"),
    ({"messages": CHAT, "min_p": 1.5}, "min_p"),
    ({"messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": "many"}, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 10**6}, "max_tokens"),
    ({"messages": CHAT, "priority": 10}, "priority"),
    ({"messages": CHAT, "priority": -1}, "priority"),
    ({"messages": CHAT, "n": 0}, "n"),
    ({"messages": CHAT, "stop": [""]}, "stop"),
    ({"messages": CHAT, "stop": ["x"] * 17}, "stop"),
    ({"messages": CHAT, "presence_penalty": 5}, "presence_penalty"),
    ({"messages": CHAT, "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": CHAT, "seed": "abc"}, "seed"),
    ({"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": CHAT, "max_tokenz": 5}, "max_tokenz"),
    ({"messages": CHAT, "model": "no-such-model"}, "model"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [-1, 5]}, "prompt"),
    ({"prompt": [10**7]}, "prompt"),
    ({"prompt": "hi", "logprobs": 50}, "logprobs"),
    ({"prompt": "hi", "echo": True, "stream": True}, "echo"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "timeout_s": -1}, "timeout_s"),
]


@pytest.mark.parametrize(("fields", "field"), BAD_REQUESTS, ids=[f"{i}-{f}" for i, (_, f) in enumerate(BAD_REQUESTS)])
def test_bad_request_raises_at_submit_and_queues_nothing(client, stack, fields, field):
    wait_until(lambda: broker_depth(client) == 0, TIMEOUT, what="an empty broker queue")
    depth, jobs = broker_depth(client), job_count(client)
    with pytest.raises(RequestError) as err:
        client.submit(**fields)
    assert field in str(err.value), f"error does not name {field!r}: {err.value}"
    assert broker_depth(client) == depth and job_count(client) == jobs


# --- malformed messages straight onto the queues ------------------------------------------------
def test_malformed_messages_are_logged_and_crash_nothing(client, stack):
    wait_idle(client, stack)
    n = client.names
    queues = [n.preprocess_queue, n.generate_queue(client.settings.model), n.results_queue]
    results_before = set(client.r.scan_iter(match=n.result("*")))
    states_before = {k: client.r.hget(k, "state") for k in client.r.scan_iter(match=n.job("*"))}
    for queue in queues:  # raw garbage and envelope-less JSON
        for raw in (b"\x00garbage{{", b'{"not": "an envelope"}', b"[1, 2, 3]", b'"just a string"'):
            client.r.lpush(n.broker_list(queue), raw)
    app = client.app
    bad_tasks = [  # well-formed envelopes with the wrong body
        (PREPROCESS_TASK, n.preprocess_queue, ["not a dict"]),
        (PREPROCESS_TASK, n.preprocess_queue, [{"job_id": 5}]),
        (GENERATE_TASK, queues[1], [{"job_id": "ghost", "prompt_token_ids": "x"}]),
        (GENERATE_TASK, queues[1], [1, 2, 3]),
        (POSTPROCESS_TASK, n.results_queue, [{"request_id": 1}]),
        (POSTPROCESS_TASK, n.results_queue, [{"request_id": "ghost", "kind": "chat", "model": client.settings.model,
                                              "output_token_ids": [1, 2], "num_prompt_tokens": 1,
                                              "finish_reason": "stop"}]),  # a job that does not exist
        ("pagedq.no_such_task", queues[1], [{}]),
    ]
    for name, queue, args in bad_tasks:
        app.send_task(name, args=args, queue=queue, priority=broker_priority(5))
    with app.connection_for_write() as conn:  # pickle is never accepted
        Producer(conn).publish(pickle.dumps({"job_id": "ghost"}), routing_key=queues[1], exchange="",
                               serializer=None, content_type="application/x-python-serialize",
                               content_encoding="binary", headers={"task": GENERATE_TASK, "id": "pickled"})
    wait_until(lambda: broker_depth(client) == 0, 30, what="the workers to drain the garbage")
    time.sleep(1.0)
    for child in stack.children:
        assert child.proc.poll() is None, f"{child.hostname} died"
    assert set(client.r.scan_iter(match=n.result("*"))) == results_before
    assert not client.r.exists(n.job("ghost")) and not client.r.exists(n.result("ghost"))
    assert {k: client.r.hget(k, "state") for k in states_before} == states_before
    logs = "".join(c.log_path.read_text(errors="replace") for c in stack.children)
    assert logs.count("dropped a malformed message") >= 12 + 4  # 12 raw items, 4 bad bodies
    assert "unregistered task" in logs and "untrusted content" in logs
    # ... and the workers still serve the next job.
    job = client.submit(prompt="Still alive?", max_tokens=3, **GREEDY)
    assert client.result(job, timeout=TIMEOUT)["usage"]["completion_tokens"] == 3


# --- priority, continuous batching, cancel ------------------------------------------------------
def test_high_priority_job_overtakes_queued_low_priority_jobs(client, stack):
    wait_idle(client, stack)
    with gpu_worker_with(stack, max_num_seqs=4):  # saturated by 4 jobs
        lows = [client.submit(prompt="Count: 1, 2, 3,", max_tokens=32, priority=0, **GREEDY) for _ in range(100)]
        high = client.submit(prompt="Say hi.", max_tokens=4, priority=9, **GREEDY)
        client.result(high, timeout=TIMEOUT)
        finished_at = client.status(high).completed_at
        statuses = [client.status(j) for j in lows]
        after = sum(1 for s in statuses if s.completed_at is None or s.completed_at > finished_at)
        for j in lows:
            client.cancel(j)
        print(f"{after} of 100 low-priority jobs completed after the high-priority one")
        assert after >= 90, f"only {after} of 100 low-priority jobs completed after the high-priority one"
        cancelled = [client.wait(j, TIMEOUT) for j in lows]
        assert sum(s.state == "cancelled" for s in cancelled) >= 80  # the queued ones went at once


def test_short_job_joins_running_batch(client, stack):
    wait_idle(client, stack)
    longs = [client.submit(prompt=f"Story number {i}:", max_tokens=200, **GREEDY) for i in range(8)]
    wait_until(lambda: worker_stats(client, stack).get("requests") == "8", TIMEOUT, what="8 running jobs")
    steps = int(worker_stats(client, stack)["steps"])
    wait_until(lambda: int(worker_stats(client, stack)["steps"]) >= steps + 3, 30, what="decode steps")
    short = client.submit(prompt="Hi", max_tokens=4, **GREEDY)
    assert client.result(short, timeout=TIMEOUT)["usage"]["completion_tokens"] == 4
    states = [client.status(j) for j in longs]
    print(f"4-token job done while the long jobs had {[s.completion_tokens for s in states]} of 200 tokens")
    states = [s.state for s in states]
    for j in longs:
        client.cancel(j)
    assert states == ["in_progress"] * 8, f"long jobs were not all still running: {states}"


def test_cancel_running_job_within_two_steps_frees_kv_blocks(client, stack):
    wait_idle(client, stack)
    job = client.submit(prompt="Once upon a time", max_tokens=400, **GREEDY)
    wait_until(lambda: client.status(job).state == "in_progress", TIMEOUT, what="the job to start")
    wait_until(lambda: int(worker_stats(client, stack)["used_blocks"]) > 0, 30, what="KV blocks in use")
    steps = int(worker_stats(client, stack)["steps"])
    wait_until(lambda: int(worker_stats(client, stack)["steps"]) >= steps + 5, 30, what="decode steps")
    steps_at_cancel = int(worker_stats(client, stack)["steps"])
    client.cancel(job)
    final = client.wait(job, 30)
    assert final.state == "cancelled" and final.cancelled_at is not None
    print(f"cancelled {final.aborted_at_step - steps_at_cancel} engine step(s) after the request, "
          f"{final.completion_tokens} tokens generated")
    assert final.aborted_at_step - steps_at_cancel <= 2
    assert final.completion_tokens < 400
    with pytest.raises(JobFailedError):
        client.result(job, timeout=1)

    def freed() -> bool:
        s = worker_stats(client, stack)
        return s["requests"] == "0" and s["used_blocks"] == "0" and s["free_blocks"] == s["num_blocks"]
    wait_until(freed, 10, what="the job's KV blocks to be freed")


def test_cancel_batch_ends_waiting_jobs_at_once_and_running_ones_at_the_next_recheck(client, stack):
    wait_idle(client, stack)
    batch = client.submit_batch([{"custom_id": f"c{i}", "url": "/v1/completions",
                                  "body": {"prompt": f"Story number {i}:", "max_tokens": 300, **GREEDY}}
                                 for i in range(40)])
    job_ids = client.r.lrange(client.names.batch_jobs(batch), 0, -1)
    wait_until(lambda: int(worker_stats(client, stack).get("requests", 0)) >= 2, TIMEOUT, what="running jobs")
    running = [j for j in job_ids if client.status(j).state == "in_progress"]
    status = client.cancel_batch(batch)
    queued_left = [j for j in job_ids if j not in running and not client.status(j).done]
    assert queued_left == [], f"{len(queued_left)} waiting jobs not ended by the cancel"
    done = client.wait_batch(batch, 3 * client.settings.progress_interval_s + 10)
    assert done.cancelled + done.completed == 40 and done.cancelled >= 38, (status, done)
    for j in running:
        s = client.status(j)
        assert s.state in ("cancelled", "completed")
        assert s.state == "completed" or s.completion_tokens < 300
    with pytest.raises(JobNotFoundError):
        client.cancel_batch("no-such-batch")

    def freed() -> bool:
        s = worker_stats(client, stack)
        return s["requests"] == "0" and s["used_blocks"] == "0"
    wait_until(freed, 10, what="the batch's KV blocks to be freed")


def test_job_not_started_in_time_expires(client):
    job = client.submit(prompt="x", max_tokens=2, timeout_s=0.0, **GREEDY)
    status = client.wait(job, TIMEOUT)
    assert status.state == "expired" and status.error["code"] == "expired" and status.started_at is None


# --- Flower -------------------------------------------------------------------------------------
def test_flower_shows_preprocess_dispatch_and_postprocess_tasks(client, settings, stack, tmp_path):
    port = free_port()
    env = {**settings_env(settings), "PAGEDQ_BROKER_URL": stack.url}
    cmd = [sys.executable, "-m", "pagedq.pipeline.cli", "flower", "--port", str(port), "--unauthenticated-api"]
    log = open(tmp_path / "flower.log", "wb")
    flower = subprocess.Popen(cmd, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _get(f"{base}/healthcheck") == "OK", 60, 0.2, "Flower to start")
        time.sleep(1.0)  # its event receiver subscribes just after the HTTP server is up
        job = client.submit(prompt="Hello, Flower!", max_tokens=200, **GREEDY)

        def tasks_of_job() -> dict:
            """The job's tasks by name: preprocess and postprocess name it in their arguments, the dispatch
            token that ran it in its result (it names no job until it binds one)."""
            tasks = json.loads(_get(f"{base}/api/tasks") or "{}")
            return {t["name"]: t for t in tasks.values()
                    if job in (t.get("args") or "") or job in str(t.get("result") or "")}

        def progressing() -> bool:  # task-progress events: state PROGRESS, tokens so far
            token = tasks_of_job().get(DISPATCH_TASK)
            return bool(token) and token["state"] == "PROGRESS" and "tokens so far" in str(token.get("result"))
        wait_until(progressing, 60, 0.1, "Flower to show the job's dispatch task in PROGRESS")
        client.result(job, timeout=TIMEOUT)

        def all_succeeded() -> dict | None:
            mine = tasks_of_job()
            done = all(mine.get(n, {}).get("state") == "SUCCESS" for n in (PREPROCESS_TASK, DISPATCH_TASK,
                                                                             POSTPROCESS_TASK))
            return mine if done else None
        mine = wait_until(all_succeeded, 30, 0.5, "Flower to list the job's tasks as SUCCESS")
        assert mine[DISPATCH_TASK]["worker"] == gpu_worker(stack).hostname
        # Arguments read as the job, not as token ids or a wall of text.
        for name in (PREPROCESS_TASK, POSTPROCESS_TASK):
            args = mine[name]["args"]
            assert f"job={job}" in args and "prompt_token_ids" not in args and len(args) < 300, (name, args)
        assert "priority=5" in mine[PREPROCESS_TASK]["args"] and "priority=5" in mine[DISPATCH_TASK]["args"]

        # A job that fails in pagedq is a FAILURE in Flower, with pagedq's reason.
        job = client.submit(prompt="hello " * 9000, max_tokens=4)
        with pytest.raises(JobFailedError, match="maximum context length"):
            client.result(job, timeout=TIMEOUT)

        def failed() -> dict | None:
            task = tasks_of_job().get(PREPROCESS_TASK, {})
            return task if task.get("state") == "FAILURE" else None
        task = wait_until(failed, 30, 0.5, "Flower to show the preprocess task as FAILURE")
        assert "maximum context length" in task["exception"] and "context_length_exceeded" in task["exception"]
        stats = json.loads(_get(f"{base}/api/tasks?state=FAILURE") or "{}")
        assert any(job in (t.get("args") or "") for t in stats.values())
        # Flower's Broker view works with pagedq's transport: backlog per queue.
        queues = wait_until(lambda: json.loads(_get(f"{base}/api/queues/length") or "{}").get("active_queues"),
                            30, 0.5, "Flower's queue lengths")
        names = {q["name"] for q in queues}
        assert {"pqt.preprocess", "pqt.results"} <= names and all(q["messages"] >= 0 for q in queues)
    finally:
        flower.send_signal(signal.SIGTERM)
        flower.wait(30)
        log.close()


def test_every_task_event_reaches_flower_in_few_broker_messages(client, stack):
    """A batch's jobs: each of a job's three tasks reaches an event receiver (Flower's) as sent, received,
    started and succeeded, every one; the events come many to a broker message (the producer's task-sent events
    of a batch, and each worker's task events: ``BatchedEventsConsumer``), not one message each as Celery sends
    them by itself."""
    from celery.events.receiver import EventReceiver

    events, sizes = [], []  # every event; the number of task events in each message that has any

    class Counting(EventReceiver):
        def _receive(self, body, message, **kw):
            batch = body if isinstance(body, list) else [body]
            if n := sum(e["type"].startswith("task-") for e in batch):
                sizes.append(n)
            events.extend(batch)
            super()._receive(body, message)

    with client.app.connection_for_read() as conn:
        receiver = Counting(conn, handlers={}, app=client.app)
        thread = threading.Thread(target=receiver.capture, kwargs={"limit": None, "timeout": None}, daemon=True)
        thread.start()
        try:  # subscribed once a worker's heartbeat (every 2 s) comes through
            wait_until(lambda: any(e["type"] == "worker-heartbeat" for e in events), 30, 0.1, "a worker heartbeat")
            lines = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/completions",
                      "body": {"prompt": f"Event {i}: {os.urandom(4).hex()}", "max_tokens": 3, **GREEDY}}
                     for i in range(12)]
            batch = client.submit_batch(lines)
            client.wait_batch(batch, timeout=TIMEOUT)
            jobs = client.r.lrange(client.names.batch_jobs(batch), 0, -1)
            assert len(jobs) == 12

            def of_job(job: str) -> dict[str, set[str]]:
                # A dispatch token names its job only once it binds one: in its progress events and its result.
                mine = {e.get("uuid") for e in events if job in (e.get("args") or "") or e.get("job_id") == job
                        or job in str(e.get("result") or "")}
                names = {e["uuid"]: e["name"] for e in events if e.get("name") and e.get("uuid") in mine}
                kinds: dict[str, set[str]] = {}
                for e in events:
                    if e.get("uuid") in names:
                        kinds.setdefault(names[e["uuid"]], set()).add(e["type"])
                return kinds

            every = {"task-sent", "task-received", "task-started", "task-succeeded"}
            tasks = (PREPROCESS_TASK, DISPATCH_TASK, POSTPROCESS_TASK)
            wait_until(lambda: all(all(every <= of_job(j).get(n, set()) for n in tasks) for j in jobs), 30, 0.2,
                       "every task event of every job")
        finally:
            receiver.should_stop = True
            thread.join(10)
    assert sum(sizes) >= 12 * 12, sizes  # 12 per job, and the module's earlier tests may add some
    assert sum(sizes) / len(sizes) >= 4, f"{sum(sizes)} task events came in {len(sizes)} messages"


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return None


# --- broker priority and key names ------------------------------------------------------------
def test_broker_serves_pagedq_priority_9_first(client):
    """kombu's Redis lists serve 0 first; pagedq's 9 (most urgent) must map onto it."""
    queue = f"{client.settings.queue_prefix}priority-probe"
    for p in (2, 9, 0, 5):
        client.app.send_task("pagedq.probe", args=[p], queue=queue, priority=broker_priority(p))
    assert client.r.llen(client.names.broker_list(queue, 0)) == 1  # pagedq 9 -> kombu 0 (no suffix)
    with client.app.connection_for_read() as conn:
        simple = conn.SimpleQueue(queue, no_ack=True)
        order = [json.loads(simple.get_nowait().body)[0][0] for _ in range(4)]
        simple.close()
    assert order == [9, 5, 2, 0]


def test_every_key_carries_a_deployment_prefix(client, stack):
    """Ours and kombu's own keys (queue lists, unacked messages, bindings) all start with "<prefix>:"."""
    assert any(k.startswith("pqt:_kombu.binding.") for k in client.r.scan_iter(count=1000))
    keys = list(client.r.scan_iter(count=1000))
    stray = [k for k in keys if k.startswith(("pagedq:", "_kombu", "unacked"))]  # default or no prefix
    stray += [k for k in keys if ("pqt." in k or "pqt:" in k) and not k.startswith("pqt:")]
    assert not stray, f"keys without this deployment's prefix: {stray[:10]}"


# --- a worker that goes away gives its jobs back ------------------------------------------------
def test_warm_shutdown_returns_a_running_job_to_the_queue(redis_url, tmp_path: Path):
    """Warm shutdown (no drain time) requeues a running job at once, not as an attempt; another worker ends it.
    (A killed worker's jobs: test_reliability and test_chaos.)"""
    s = Settings(broker_url=redis_url, key_prefix="pqk:", queue_prefix="pqk.", result_cache=False, kv_cache_memory="128MiB",
                 drain_timeout_s=0)
    with Stack(s, log_dir=tmp_path) as stack, Client(s, stack.url) as client:
        job = client.submit(prompt="A long story:", max_tokens=120, **GREEDY)

        def running_on(child) -> bool:
            st = client.status(job)
            return st.worker == child.hostname and (st.completion_tokens or 0) > 0
        first = gpu_worker(stack)
        wait_until(lambda: running_on(first), TIMEOUT, what="the job to run")
        stack.stop_worker(first)  # SIGTERM: warm shutdown
        assert client.status(job).state == "queued"
        assert broker_depth(client) == 1

        stack.wait_ready(TIMEOUT, [stack.add_worker("gpu")])
        result = client.result(job, timeout=TIMEOUT)
        assert result["usage"]["completion_tokens"] == 120
        assert client.status(job).attempts == 1, "the orderly shutdown is not an attempt"


# --- the command line, on the embedded default ---------------------------------------------------
def _leftovers(parent_pid: int, redis_dir: Path) -> list[str]:
    """Processes a pagedq command started that are still alive: its workers, or a redis-server in its dir."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cwd = os.readlink(proc / "cwd")
        except OSError:
            continue
        if f".{parent_pid}@" in cmdline or (cwd == str(redis_dir) and "redis-server" in cmdline) or \
                proc.name == str(parent_pid):
            found.append(f"{proc.name}: {cmdline}")
    return found


def _embedded_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    return {**env, "PAGEDQ_REDIS_DIR": str(tmp_path / "redis"), "PAGEDQ_KV_CACHE_MEMORY": "128MiB",
            "OMP_WAIT_POLICY": "PASSIVE"}


def test_run_batch_cli_starts_and_stops_the_whole_stack(tmp_path):
    lines = _batch_lines()
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.Popen([sys.executable, "-m", "pagedq.pipeline.cli", "run-batch", "-i",
                             str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")],
                            env=_embedded_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    password = (tmp_path / "redis" / "password").read_text().strip()
    assert len(password) >= 32 and password not in stderr, "the broker password stays out of the output"
    logs = Settings().state_dir / "logs"
    assert not [f for f in logs.glob("*.log") if password in f.read_text(errors="replace")]
    out = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in out] == [json.loads(ln)["custom_id"] for ln in lines]
    assert [x["response"]["status_code"] for x in out] == [200, 200, 400, 200, 200, 200]
    # The embedded broker persisted its data (appendonly.aof before Redis 7, appendonlydir/ since).
    assert any((tmp_path / "redis").glob("appendonly*"))
    assert not (tmp_path / "redis" / "redis.json").exists()
    assert not _leftovers(proc.pid, tmp_path / "redis")


def test_up_serves_until_ctrl_c_and_leaves_nothing(tmp_path):
    env = _embedded_env(tmp_path)
    up = subprocess.Popen([sys.executable, "-m", "pagedq.pipeline.cli", "up", "--loglevel", "WARNING"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in up.stderr:  # wait for the banner
            if line.startswith("pagedq up:"):
                break
        else:
            raise AssertionError(f"pagedq up exited with {up.wait()}")
        # The client finds the running embedded broker through its run file.
        done = subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "submit", "Say hi.", "--max-tokens", "4",
                               "--wait", "--timeout", "120"], env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-2000:]
        job = done.stderr.splitlines()[0].strip()  # the job id first (stderr), then the result (stdout, JSON)
        result = json.loads(done.stdout)
        assert result["usage"]["completion_tokens"] <= 4 and result["id"].endswith(job)
        running = _leftovers(up.pid, tmp_path / "redis")
        assert len(running) >= 4, running  # up itself, Redis, a GPU and a CPU worker
        password = (tmp_path / "redis" / "password").read_text().strip()
        assert not [c for c in running if password in c], "the broker password is in no process's argv"
        assert password not in done.stdout + done.stderr
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(120)
    assert code == 0
    assert password not in up.stderr.read()
    assert not _leftovers(up.pid, tmp_path / "redis")
