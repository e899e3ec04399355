"""Chaos: faults against real processes (redis-server, workers, the model), counted.

    python scripts/chaos.py                 # every scenario at full size; prints one table
    python scripts/chaos.py gpu_kill redis_pause --jobs 12
    python scripts/chaos.py all_kill --jobs 12 --min-tokens 16 --max-tokens 120

Each scenario runs its own deployment (a redis-server in a temporary folder, a
CPU and a GPU worker), submits jobs long enough to be mid-generation when the
fault strikes, applies the fault, and waits for every job to end.  Columns:
jobs submitted, completed, failed with a clear error (code + message), lost
(never reached a terminal state), published twice (a terminal state heard
more than once on the job's done channel), and seconds to recover (from the
fault until the work it interrupted is running again).  Lost and twice must be 0.

``all_kill`` and ``redis_kill_busy`` strike a busy deployment: 40 greedy jobs
with max_tokens spread over 32…500 (ignore_eos), most of them running at the
fault.  ``all_kill`` kills every worker at once and starts a fresh stack that
reuses live workers, as ``pagedq up`` restarted by a supervisor would;
``redis_kill_busy`` kills redis-server and restarts it, workers left alone.

The tests (``tests/e2e/test_chaos.py``) run the same scenarios, smaller.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import redis

from pagedq.config import Settings
from pagedq.pipeline import BrokerUnavailable, Client, JobNotFoundError, RequestError
from pagedq.pipeline.local.redis_server import RedisServer
from pagedq.pipeline.local.stack import Child, Stack
from pagedq.pipeline.local.topology import Topology
from pagedq.store.connection import redis_client

GREEDY = {"temperature": 0, "ignore_eos": True}
DEADLINE_S = 900
DOWN_AFTER_MS = 2000  # Sentinel's down-after-milliseconds in the failover scenarios
RECOVER_WAIT_S = 240  # the busy scenarios give up measuring a recovery after this long (and count what ended)
FENCE_WAIT_S = 120  # gpu_freeze: how long the thawed worker has to try finishing the jobs it held


@dataclass
class Row:
    scenario: str
    submitted: int = 0
    completed: int = 0
    failed: int = 0  # ended failed/cancelled/expired with an error code and message
    lost: int = 0  # never terminal
    twice: int = 0  # a terminal state published more than once
    recover_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        rec = "-" if self.recover_s is None else f"{self.recover_s:.1f}"
        return (f"| {self.scenario} | {self.submitted} | {self.completed} | {self.failed} | {self.lost} | "
                f"{self.twice} | {rec} | {'; '.join(self.notes)} |")


HEADER = ("| scenario | submitted | completed | failed (clear error) | lost | published twice | recover s | notes |\n"
          "|---|---|---|---|---|---|---|---|")


class DoneListener:
    """Counts terminal-state publications per job; survives a broker restart or failover (it resubscribes, to the
    master the sentinels name)."""

    def __init__(self, r: redis.Redis, pattern: str, prefix: str) -> None:
        self.counts: Counter = Counter()
        self.prefix = prefix
        self.r = r
        self.pubsub = self.r.pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe(**{pattern: self._on})
        self.thread = self.pubsub.run_in_thread(sleep_time=0.05, daemon=True, exception_handler=self._retry)

    def _on(self, message) -> None:
        self.counts[message["channel"][len(self.prefix):]] += 1

    @staticmethod
    def _retry(exc, pubsub, thread) -> None:
        time.sleep(0.5)  # the broker is away; redis-py reconnects and resubscribes on the next read

    def stop(self) -> None:
        self.thread.stop()
        self.thread.join(timeout=5)


class Deployment:
    """A redis-server of its own (so it can be killed and restarted), or with ``sentinels`` a Sentinel topology
    (a master, ``replicas`` replicas, that many sentinels: ``pipeline.local.topology``), and a pagedq stack on it."""

    def __init__(self, workdir: Path, gpu_workers: int = 1, sentinels: int = 0, replicas: int = 1,
                 **settings: object) -> None:
        self.workdir = workdir
        self.redis: RedisServer | None = None
        self.topology: Topology | None = None
        if sentinels:
            self.topology = Topology(workdir / "redis", replicas=replicas, sentinels=sentinels,
                                     down_after_ms=DOWN_AFTER_MS)
            self.url = self.topology.start()
            self.topology.wait_healthy(60)
        else:
            self.redis = RedisServer(workdir / "redis", write_run_file=False)
            self.url = self.redis.start()
        base = dict(broker_url=self.url, result_cache=False, kv_cache_memory="256MiB", worker_ttl_s=6,
                    progress_interval_s=0.5, model_wait_s=120)
        self.settings = Settings(**{**base, **settings})
        self.stack = Stack(self.settings, gpu_workers=gpu_workers, log_dir=workdir / "logs").start()
        self.client = Client(self.settings, self.url)
        names = self.client.names
        self.done = DoneListener(self.reader(), names.done_channel("*"), names.done_channel(""))
        self.r = self.reader()  # the scenarios' own reads

    def reader(self) -> redis.Redis:
        """A client of its own (on the master, wherever the sentinels say it is now)."""
        return redis_client(self.url, 5, self.settings)

    def worker(self, role: str) -> Child:
        return next(c for c in self.stack.children if c.role == role)

    def replace(self, child: Child, wait: bool = False) -> Child:
        """The supervisor's part: a fresh worker of the same role once ``child`` is gone."""
        child.proc.wait()
        self.stack.children.remove(child)
        new = self.stack.add_worker(child.role)
        if wait:
            self.stack.wait_ready(600, [new])
        return new

    def submit(self, n: int, max_tokens: int | list[int]) -> list[str]:
        tokens = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
        return [self.client.submit(prompt=f"Story {i} of {n}, about {random.choice(WORDS)}:",
                                   max_tokens=tokens[i], **GREEDY) for i in range(n)]

    def kill_workers(self) -> list[Child]:
        """kill -9 of every worker at once, each with its process group (pipeline stages too)."""
        victims = list(self.stack.children)
        for child in victims:
            os.killpg(child.proc.pid, signal.SIGKILL)
        for child in victims:
            child.proc.wait()
        return victims

    def up_again(self) -> Stack:
        """What a supervisor restarting ``pagedq up`` does: a fresh stack on the same broker, reusing the
        workers it can show are alive (new names, as a new ``pagedq up`` process would have)."""
        old = self.stack
        old.stop()  # its children are gone: nothing to stop, it only forgets them
        self.stack = Stack(self.settings, log_dir=self.workdir / "logs", reuse_workers=True,
                           first_index=old.workers_started).start()
        return self.stack

    def crash_redis(self, down_s: float = 2) -> None:
        """kill -9 of redis-server; restarted ``down_s`` later on the same port and data dir (its AOF)."""
        self.redis.proc.send_signal(signal.SIGKILL)
        self.redis.proc.wait()
        time.sleep(down_s)
        self.redis = RedisServer(self.redis.data_dir, write_run_file=False)
        self.redis.start()

    def snapshot(self, jobs: list[str]) -> dict[str, tuple[str, int]]:
        """job -> (state, completion tokens so far); one status read per job."""
        out = {}
        for job in jobs:
            try:
                s = self.status(job)
            except JobNotFoundError:
                out[job] = ("missing", 0)
                continue
            out[job] = ("done" if s.done else s.state, s.completion_tokens or 0)
        return out

    def recover(self, predicate: Callable[[], bool], timeout: float = RECOVER_WAIT_S) -> float | None:
        """Seconds until ``predicate()`` held, or None if it did not within ``timeout``."""
        try:
            return self.wait_for(predicate, timeout, poll=0.5)
        except TimeoutError:
            return None

    def status(self, job: str):
        return self.client.status(job)

    def running(self, jobs: list[str]) -> list[str]:
        return [j for j in jobs if (s := self.status(j)).state == "in_progress" and (s.completion_tokens or 0) > 0]

    def wait_for(self, predicate: Callable[[], bool], timeout: float, poll: float = 0.2) -> float:
        """Seconds until ``predicate()`` held (raises TimeoutError)."""
        start = time.monotonic()
        while not predicate():
            if time.monotonic() - start > timeout:
                raise TimeoutError("condition not reached")
            time.sleep(poll)
        return time.monotonic() - start

    def wait_until_more_ended(self, jobs: list[str], than: int) -> None:
        """Until more than ``than`` of ``jobs`` have ended, or all of them (a recovery that had nothing left)."""
        self.wait_for(lambda: sum(self._terminal(j) for j in jobs) > min(than, len(jobs) - 1), DEADLINE_S, poll=0.5)

    def settle(self, row: Row, jobs: list[str], timeout: float = DEADLINE_S) -> Row:
        """Wait for every job to end (or the deadline), then count."""
        deadline = time.monotonic() + timeout
        pending = list(jobs)
        while pending and time.monotonic() < deadline:
            pending = [j for j in pending if not self._terminal(j)]
            time.sleep(0.5)
        time.sleep(1.0)  # the last publications reach the listener
        row.submitted += len(jobs)
        errors: Counter = Counter()
        for job in jobs:
            try:
                status = self.status(job)
            except JobNotFoundError:  # its record is gone (a failover without the replica ack, in its window)
                row.lost += 1
                errors["record gone"] += 1
                continue
            if status.state == "completed":
                row.completed += 1
            elif status.done and status.error and status.error.get("code") and status.error.get("message"):
                row.failed += 1
                errors[status.error["code"]] += 1
            elif status.done and status.state == "cancelled":
                row.failed += 1
            else:
                row.lost += 1
            row.twice += self.done.counts[job] > 1
        if errors:
            row.notes.append("failed with " + ", ".join(f"{code} x{n}" for code, n in errors.most_common()))
        return row

    def diagnose(self, jobs: list[str]) -> str:
        """Where each job that never ended stands in Redis: its record, its kept message, the active set, and
        every message naming it on a queue list or in ``unacked``."""
        from pagedq.store.transport import job_id_of

        n, r = self.client.names, self.r
        holders: dict[str, list[str]] = {}
        for key in r.scan_iter(match=n.broker_list_pattern, _type="list"):
            for raw in r.lrange(key, 0, -1):
                holders.setdefault(job_id_of(json.loads(raw)) or "", []).append(key)
        for raw in r.hvals(n.unacked):
            holders.setdefault(job_id_of(json.loads(raw)[0]) or "", []).append("unacked")
        lines = []
        for job in jobs:
            rec = r.hgetall(n.job(job))
            fields = {k: rec.get(k) for k in ("state", "attempts", "redeliveries", "resent", "worker",
                                               "completion_tokens", "requeued_at", "resent_at")}
            lines.append(f"{job}: {fields}; kept message {bool(r.exists(n.job_message(job)))}; "
                         f"active {r.zscore(n.active_jobs, job) is not None}; messages {holders.get(job, [])}")
        return "\n".join(lines)

    def _terminal(self, job: str) -> bool:
        try:
            return self.status(job).done
        except (BrokerUnavailable, JobNotFoundError):
            return False

    def close(self) -> None:
        self.done.stop()
        self.r.close()
        self.client.close()
        self.stack.stop()
        (self.topology or self.redis).stop()


WORDS = ["queues", "caches", "rivers", "engines", "lighthouses", "parcels", "bees", "comets"]


@contextmanager
def deployment(**settings: object):
    with tempfile.TemporaryDirectory(prefix="pagedq-chaos-") as tmp:
        d = Deployment(Path(tmp), **settings)
        try:
            yield d
        finally:
            d.close()


# --- scenarios ---------------------------------------------------------------------------------------------
def gpu_kill(jobs: int = 24, tokens: int = 160) -> Row:
    """kill -9 of the GPU worker mid-generation; a replacement starts at once."""
    row = Row("kill -9 GPU worker")
    with deployment(max_num_seqs=jobs) as d:
        ids = d.submit(jobs, tokens)
        d.wait_for(lambda: len(d.running(ids)) >= jobs // 2, DEADLINE_S)
        victim = d.worker("gpu")
        interrupted = [j for j in ids if not d.status(j).done]
        victim.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        new = d.replace(victim)
        d.wait_for(lambda: all(d.status(j).done or (d.status(j).worker == new.hostname and
                                                    d.status(j).state == "in_progress") for j in interrupted),
                   DEADLINE_S)
        row.recover_s = time.monotonic() - killed
        row.notes.append(f"{len(interrupted)} running at the kill; recover = all of them running again "
                         f"(lease {d.settings.worker_ttl_s} s, new worker's model load included)")
        return d.settle(row, ids)


def gpu_freeze(jobs: int = 12, tokens: int = 160) -> Row:
    """SIGSTOP of a GPU worker (and its process group) mid-generation, past its lease: the other GPU worker
    restores and runs its jobs; then SIGCONT: the frozen worker wakes up believing it still holds them, and
    fencing must refuse every finish and requeue it attempts (``pagedq_fenced_total``)."""
    row = Row("SIGSTOP a GPU worker past its lease, SIGCONT after (2 GPU workers)")
    with deployment(gpu_workers=2, max_num_seqs=jobs) as d:
        ids = d.submit(jobs, tokens)
        d.wait_for(lambda: len(d.running(ids)) >= jobs // 2, DEADLINE_S)
        holders = Counter(d.status(j).worker for j in d.running(ids))
        victim = next(c for c in d.stack.children if c.hostname == holders.most_common(1)[0][0])
        frozen_jobs = [j for j in d.running(ids) if d.status(j).worker == victim.hostname]
        # Halfway through: woken, it finishes before the other worker's restarted copies do, and acks its
        # messages while that worker still runs them (the ack must not touch theirs: no job is sent again).
        d.wait_for(lambda: all(d.status(j).done or (d.status(j).completion_tokens or 0) >= tokens // 2
                               for j in frozen_jobs), DEADLINE_S)
        os.killpg(victim.proc.pid, signal.SIGSTOP)
        frozen_jobs = [j for j in ids if (s := d.status(j)).state == "in_progress" and s.worker == victim.hostname]
        frozen = time.monotonic()
        try:
            d.wait_for(lambda: all(d.status(j).done or d.status(j).worker not in (None, victim.hostname)
                                   for j in frozen_jobs), DEADLINE_S)
            row.recover_s = time.monotonic() - frozen  # it wakes while the other worker runs its jobs' copies
        finally:
            os.killpg(victim.proc.pid, signal.SIGCONT)
        names = d.client.names

        def fenced() -> dict[str, int]:
            return {op: int(n) for op, n in d.r.hgetall(names.fenced).items()}

        try:  # it generates on from where it froze, then tries to finish each job it held
            d.wait_for(lambda: sum(fenced().values()) >= len(frozen_jobs), FENCE_WAIT_S, poll=1)
        except TimeoutError:
            pass
        out = d.settle(row, ids)
        out.notes.append(f"{len(frozen_jobs)} running on it at the SIGSTOP; recover = until all of them ran on "
                         f"the other worker (lease {d.settings.worker_ttl_s} s); writes refused after the SIGCONT: "
                         f"{fenced() or 'none'}; it {'exited' if victim.proc.poll() is not None else 'lives on'}")
        out.notes.append(f"{resent(d, ids)} sent again by the lost-job sweep")
        return out


def placement_kill(jobs: int = 16, tokens: int = 160) -> Row:
    """Cache-aware placement, two GPU workers: conversations' first turns run, then their next turns (history +
    more tokens), each placed on the worker holding its history; kill -9 of the worker holding the most while
    those turns run, no replacement: every turn completes once on the other worker."""
    row = Row("kill -9 cache holder (placement, 2 GPU workers)")
    with deployment(gpu_workers=2, max_num_seqs=jobs) as d:
        d.stack.wait_ready(600)
        histories = [[random.randint(100, 30000) for _ in range(random.randint(100, 250))] for _ in range(jobs)]
        first = [d.client.submit(prompt=h, max_tokens=2, **GREEDY) for h in histories]
        for job in first:
            d.client.result(job, timeout=DEADLINE_S)
        holders = [d.status(j).worker for j in first]
        victim = next(c for c in d.stack.children if c.hostname == Counter(holders).most_common(1)[0][0])
        ids = [d.client.submit(prompt=h + [random.randint(100, 30000) for _ in range(20)], max_tokens=tokens,
                               **GREEDY) for h in histories]
        d.wait_for(lambda: sum(d.status(j).worker == victim.hostname and d.status(j).state == "in_progress"
                               for j in ids) >= 2, DEADLINE_S)
        interrupted = [j for j in ids if not d.status(j).done and d.status(j).worker in (None, victim.hostname)]
        placed = sum(d.status(j).worker == h for j, h in zip(ids, holders, strict=True))
        victim.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        victim.proc.wait()
        d.stack.children.remove(victim)
        survivor = next(c.hostname for c in d.stack.children if c.role == "gpu")
        d.wait_for(lambda: all(d.status(j).done or (d.status(j).worker == survivor and
                                                    d.status(j).state == "in_progress") for j in interrupted),
                   DEADLINE_S)
        row.recover_s = time.monotonic() - killed
        row.notes.append(f"{placed} of {jobs} next turns started on their history's worker; {len(interrupted)} "
                         f"of the victim's running or waiting at the kill")
        return d.settle(row, first + ids)


def cpu_kill(jobs: int = 60, tokens: int = 16) -> Row:
    """kill -9 of the CPU worker while it takes in a burst of preprocess messages (half the jobs, submitted just
    before the kill, once the first half showed the pipeline working)."""
    row = Row("kill -9 CPU worker")
    with deployment() as d:
        ids = d.submit(jobs // 2, tokens)
        d.wait_for(lambda: sum(d.status(j).done for j in ids) >= 3, DEADLINE_S)
        victim = d.worker("cpu")
        ids += d.submit(jobs - jobs // 2, tokens)
        victim.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        victim.proc.wait()
        done_before = sum(d.status(j).done for j in ids)  # counted once nothing else can end
        d.replace(victim)
        d.wait_until_more_ended(ids, done_before + 1)
        row.recover_s = time.monotonic() - killed
        row.notes.append(f"{jobs - done_before} of {jobs} not done at the kill; recover = jobs completing again")
        return d.settle(row, ids)


def stage_kill(jobs: int = 12, tokens: int = 120) -> Row:
    """kill -9 of one pipeline stage: the replica is lost, its worker exits, the supervisor restarts it."""
    import psutil

    row = Row("kill -9 one pipeline stage")
    with deployment(pipeline_stages=2, max_num_seqs=jobs) as d:
        ids = d.submit(jobs, tokens)
        d.wait_for(lambda: len(d.running(ids)) >= jobs // 2, DEADLINE_S)
        driver = d.worker("gpu")
        [stage] = [p for p in psutil.Process(driver.proc.pid).children()
                   if any("stage" in part for part in p.cmdline())]
        interrupted = [j for j in ids if not d.status(j).done]
        os.kill(stage.pid, signal.SIGKILL)
        killed = time.monotonic()
        new = d.replace(driver)
        d.wait_for(lambda: all(d.status(j).done or d.status(j).worker == new.hostname for j in interrupted),
                   DEADLINE_S)
        row.recover_s = time.monotonic() - killed
        row.notes.append(f"worker exit code {driver.proc.returncode}")
        return d.settle(row, ids)


def redis_kill(jobs: int = 16, tokens: int = 120) -> Row:
    """kill -9 of redis-server (AOF, appendfsync everysec), restarted on the same port and data dir."""
    row = Row("kill -9 redis-server, restart")
    with deployment(max_num_seqs=jobs) as d:
        ids = d.submit(jobs, tokens)
        time.sleep(1.5)  # everything submitted more than a second before the crash must survive it
        d.wait_for(lambda: len(d.running(ids)) >= 2, DEADLINE_S)
        killed = time.monotonic()
        d.crash_redis()
        d.wait_until_more_ended(ids, sum(d._terminal(j) for j in ids))
        row.recover_s = time.monotonic() - killed
        row.notes.append("same port; workers reconnected by themselves; recover = first job ending after")
        return d.settle(row, ids)


def sigterm(jobs: int = 12, tokens: int = 120) -> Row:
    """SIGTERM of the GPU worker mid-run: it drains (running jobs finish, up to drain_timeout_s), then exits."""
    row = Row("SIGTERM GPU worker (drain)")
    with deployment(max_num_seqs=jobs, drain_timeout_s=30) as d:
        ids = d.submit(jobs, tokens)
        d.wait_for(lambda: len(d.running(ids)) >= jobs // 2, DEADLINE_S)
        victim = d.worker("gpu")
        running = d.running(ids)
        victim.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        d.replace(victim)
        finished_by_drain = sum(d.status(j).state == "completed" and d.status(j).attempts == 1 for j in running)
        row.recover_s = time.monotonic() - stopped
        row.notes.append(f"{finished_by_drain}/{len(running)} running jobs finished during the drain; "
                         f"exit code {victim.proc.returncode}")
        return d.settle(row, ids)


def redis_pause(jobs: int = 12, tokens: int = 80, pause_s: float = 30) -> Row:
    """Redis stopped (SIGSTOP) for ``pause_s``: producers get BrokerUnavailable in bounded time; all recovers."""
    row = Row(f"Redis paused {pause_s:.0f} s")
    with deployment(max_num_seqs=jobs, broker_timeout_s=3) as d:
        ids = d.submit(jobs, tokens)
        d.wait_for(lambda: len(d.running(ids)) >= 2, DEADLINE_S)
        d.redis.proc.send_signal(signal.SIGSTOP)
        paused = time.monotonic()
        try:
            start = time.monotonic()
            try:
                d.client.submit(prompt="during the pause", max_tokens=4)
                row.notes.append("submit during the pause did not fail")
            except BrokerUnavailable:
                row.notes.append(f"submit during the pause: BrokerUnavailable after {time.monotonic() - start:.1f} s")
            time.sleep(max(0.0, pause_s - (time.monotonic() - paused)))
        finally:
            d.redis.proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        d.wait_until_more_ended(ids, sum(d._terminal(j) for j in ids))
        row.recover_s = time.monotonic() - resumed
        return d.settle(row, ids)


def garbage(bad: int = 1000, good: int = 20, seed: int = 0) -> Row:
    """Generated bad requests (hypothesis over the schema) mixed with good ones, plus raw garbage on every queue."""
    row = Row(f"{bad} generated requests + garbage on every queue")
    with deployment() as d:
        accepted: list[str] = []
        refused: Counter = Counter()
        bodies = generated_bodies(bad)
        good_at = set(random.Random(seed).sample(range(len(bodies) + good), good))
        it = iter(bodies)
        for i in range(len(bodies) + good):
            if i in good_at:
                accepted.append(d.client.submit(prompt=f"good {i}", max_tokens=4, **GREEDY))
                continue
            try:
                accepted.append(d.client.submit(**next(it)))
            except RequestError as e:
                refused[e.code] += 1
        pushed = push_garbage(d)
        row.notes.append(f"{sum(refused.values())} refused at submit with a field-naming RequestError; "
                         f"{len(accepted) - good} generated ones accepted; {pushed} raw items pushed onto queues")
        out = d.settle(row, accepted)
        alive = all(c.proc.poll() is None for c in d.stack.children)
        out.notes.append("workers alive" if alive else "A WORKER DIED")
        return out


def generated_bodies(n: int) -> list[dict]:
    """Request bodies drawn by hypothesis around the schema: wrong types, extremes, lone surrogates, oversize."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    text = st.text(st.characters(exclude_categories=()), max_size=40)  # Cs included: lone surrogates
    scalar = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                       st.floats(allow_nan=True, allow_infinity=True), text,
                       st.lists(st.integers(-5, 60000), max_size=5), st.just("x" * 200_000))
    names = st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                             "presence_penalty", "frequency_penalty", "repetition_penalty", "logprobs", "user",
                             "priority", "n", "stream", "model", "echo", "bogus"])
    extra = st.dictionaries(names, scalar, max_size=4)
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard"]),
                                     "content": st.one_of(text, scalar)})
    chat = st.builds(lambda m, e: {"messages": m, "max_tokens": 4, **e}, st.lists(message, max_size=3), extra)
    completion = st.builds(lambda p, e: {"prompt": p, "max_tokens": 4, **e},
                           st.one_of(text, st.lists(st.integers(-3, 70000), max_size=6), scalar), extra)
    drawn: list[dict] = []

    @settings(max_examples=n, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(chat, completion))
    def collect(body: dict) -> None:
        if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
            body["max_tokens"] = 8  # an accepted one stays short
        drawn.append(body)

    collect()
    return drawn[:n]


def push_garbage(d: Deployment) -> int:
    """Raw items on every queue list: not JSON, JSON without an envelope, an envelope for no task, pickle."""
    n = d.client.names
    queues = [n.preprocess_queue, n.results_queue, n.generate_queue(d.settings.model)]
    items = [b"\x00\xffnot json", b"{}", b"[1, 2, 3]", json.dumps({"body": "x"}).encode(),
             json.dumps({"body": "", "headers": {"task": "no.such.task"}, "properties": {}}).encode(),
             json.dumps({"body": "gASVBAAAAAAAAACMAXiULg==", "content-type": "application/x-python-serialize",
                         "content-encoding": "binary", "headers": {"task": "pagedq.generate", "id": "x"},
                         "properties": {"delivery_tag": "t", "body_encoding": "base64",
                                        "delivery_info": {"exchange": "", "routing_key": "x"}}}).encode()]
    r = redis.Redis.from_url(d.redis.url)
    for q in queues:
        for item in items:
            r.lpush(n.broker_list(q), item)
    return len(queues) * len(items)


def backlog(jobs: int = 10_000) -> Row:
    """A backlog of short jobs: Redis memory stays bounded; jobs/s through the queue vs run-batch --offline."""
    import psutil

    row = Row(f"{jobs}-job backlog")
    with deployment(max_num_seqs=256) as d:
        r = redis.Redis.from_url(d.redis.url)
        base = r.info("memory")["used_memory"]
        start = time.monotonic()
        lines = [{"custom_id": f"j{i}", "url": "/v1/completions",
                  "body": {"prompt": f"Item {i}:", "max_tokens": 1, "temperature": 0}} for i in range(jobs)]
        batch = d.client.submit_batch(lines)
        peak = 0
        while not d.client.batch_status(batch).done:
            peak = max(peak, r.info("memory")["used_memory"])
            time.sleep(1)
        queued_s = time.monotonic() - start
        ids = r.lrange(d.client.names.batch_jobs(batch), 0, -1)
        rss = {c.role: psutil.Process(c.proc.pid).memory_info().rss >> 20 for c in d.stack.children}
        row.notes.append(f"Redis used_memory peak {(peak - base) / 2**20:.0f} MiB above idle; worker RSS (MiB) "
                         f"{rss}; {jobs / queued_s:.1f} jobs/s through the queue")
        out = d.settle(row, [i.decode() for i in ids])
    offline = offline_rate(lines)
    out.notes.append(f"run-batch --offline {offline:.1f} jobs/s (queue/offline = {jobs / queued_s / offline:.2f})")
    return out


def offline_rate(lines: list[dict]) -> float:
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        src.write_text("".join(json.dumps(x) + "\n" for x in lines))
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "run-batch", "--offline", "-i", str(src),
                        "-o", str(Path(tmp) / "out.jsonl")], check=True, capture_output=True)
        return len(lines) / (time.monotonic() - start)


# --- faults on a busy deployment: long, uneven jobs, most running at the fault ----------------------------
def spread(n: int, lo: int, hi: int) -> list[int]:
    """``n`` max_tokens evenly from ``lo`` to ``hi``, in a fresh random order."""
    values = [lo + round((hi - lo) * i / max(n - 1, 1)) for i in range(n)]
    random.shuffle(values)
    return values


def busy(jobs: int, **settings: object):
    """A deployment that runs every job at once (sequences, inflight tasks and KV cache for all of them)."""
    return deployment(max_num_seqs=jobs, kv_cache_memory="1GiB", **settings)


def until_fault(d: Deployment, ids: list[str]) -> None:
    """Until the first eighth of the jobs (the shortest) completed, the rest running: the fault strikes while
    jobs complete now and then, as in a deployment at work (40 jobs: 5 done, 35 running)."""
    first = max(1, len(ids) // 8)
    d.wait_for(lambda: sum(d.status(j).done for j in ids) >= first, DEADLINE_S, poll=0.5)


def resent(d: Deployment, ids: list[str]) -> int:
    """Jobs the lost-job sweep sent again (their message had vanished)."""
    return sum(bool(d.r.hget(d.client.names.job(j), "resent")) for j in ids)


def settle_busy(d: Deployment, row: Row, ids: list[str], stall_s: float = 120) -> Row:
    """Wait for every job to end while any of them still moves (state or tokens), then count: long jobs on a
    busy machine take what they take, and a job stranded by the fault shows as lost within ``stall_s``."""
    last, moved, deadline = None, time.monotonic(), time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and time.monotonic() - moved < stall_s:
        snap = d.snapshot(ids)
        if all(state == "done" for state, _ in snap.values()):
            break
        if snap != last:
            last, moved = snap, time.monotonic()
        time.sleep(2)
    out = d.settle(row, ids, timeout=0)
    out.notes.append(f"{resent(d, ids)} sent again by the lost-job sweep")
    if out.lost:
        lost = [j for j in ids if not d._terminal(j)]
        print(f"{out.scenario}: {out.lost} job(s) never ended:\n{d.diagnose(lost)}", file=sys.stderr, flush=True)
        out.notes.append(f"never ended: {', '.join(sorted({d.status(j).state for j in lost}))}")
    return out


def all_kill(jobs: int = 40, lo: int = 32, hi: int = 500, ttl_s: int = 15) -> Row:
    """kill -9 of every worker at once while most jobs run (a worker host losing power; Redis up), then a fresh
    stack at once, reusing live workers as ``pagedq up`` does: the dead workers' records (still within their TTL)
    must not be trusted, and the new workers restore the dead ones' leases.  ``ttl_s``: PAGEDQ_WORKER_TTL_S."""
    row = Row(f"kill -9 every worker, pagedq up again ({jobs} jobs of {lo}-{hi} tokens)")
    with busy(jobs, worker_ttl_s=ttl_s) as d:
        ids = d.submit(jobs, spread(jobs, lo, hi))
        until_fault(d, ids)
        d.kill_workers()
        interrupted = [j for j, (state, _) in d.snapshot(ids).items() if state != "done"]
        restarted = time.monotonic()
        stack = d.up_again()
        new = {c.hostname for c in stack.children if c.role == "gpu"}

        def all_running_again() -> bool:
            statuses = [d.status(j) for j in interrupted]
            return all(s.done or (s.worker in new and s.state == "in_progress") for s in statuses)

        recovered = d.recover(all_running_again)
        row.recover_s = None if recovered is None else time.monotonic() - restarted
        started = Counter(c.role for c in stack.children)
        row.notes.append(f"{len(interrupted)} running at the kill; up again started {started['gpu']} GPU + "
                         f"{started['cpu']} CPU ({'; '.join(v.line() for v in stack.reused) or 'no records'}); "
                         f"recover = from the restart until all of them run on the new GPU worker (lease {ttl_s} s, "
                         "its model load included)")
        return settle_busy(d, row, ids)


def redis_kill_busy(jobs: int = 40, lo: int = 32, hi: int = 500, ttl_s: int = 15) -> Row:
    """kill -9 of redis-server (AOF everysec) while most jobs run, restarted on the same port and data dir;
    the workers are left alone (they reconnect).  ``ttl_s``: PAGEDQ_WORKER_TTL_S (``pagedq up``'s default)."""
    row = Row(f"kill -9 redis-server under load, restart ({jobs} jobs of {lo}-{hi} tokens)")
    with busy(jobs, worker_ttl_s=ttl_s) as d:
        ids = d.submit(jobs, spread(jobs, lo, hi))
        until_fault(d, ids)
        running = [j for j, (state, _) in d.snapshot(ids).items() if state != "done"]
        d.crash_redis()
        restarted = time.monotonic()
        at_restart = d.snapshot(running)
        # Jobs sent after the restart: the running ones could finish on a worker that no longer consumes.
        probes = d.submit(max(1, jobs // 8), 8)

        def all_moving() -> bool:
            now = d.snapshot(running + probes)
            return all(state == "done" or (state == "in_progress" and tokens != at_restart.get(j, ("", 0))[1])
                       for j, (state, tokens) in now.items())

        recovered = d.recover(all_moving)
        row.recover_s = None if recovered is None else time.monotonic() - restarted
        row.notes.append(f"{len(running)} running at the crash, {len(probes)} more of 8 tokens sent after the "
                         "restart; recover = from the restart until each of these is generating (tokens moving) "
                         "or done")
        return settle_busy(d, row, ids + probes)


def sentinel_failover(jobs: int = 40, lo: int = 32, hi: int = 500, ack: int | None = None,
                      kill_sentinel: bool = False) -> Row:
    """kill -9 of the Redis master while most jobs run (a broker host lost for good): the sentinels promote a
    replica after ``DOWN_AFTER_MS``; workers, producer and listener follow it without a restart; the old master,
    started again, must come back as a replica.  ``kill_sentinel``: kill -9 of the first-listed sentinel (first
    in every process's URL) just before the master.  ``ack``:
    PAGEDQ_REDIS_MIN_REPLICAS_ACK (default: the environment's, else 0).  Without it, what the master had not yet
    sent its replica is lost with it (Redis replication is asynchronous: the window is the replication lag).
    Two replicas: with the ack option a replica must remain to confirm writes once one has become master."""
    ack = int(os.environ.get("PAGEDQ_REDIS_MIN_REPLICAS_ACK", "0")) if ack is None else ack
    what = "a sentinel and the Redis master" if kill_sentinel else "the Redis master"
    row = Row(f"kill -9 {what}, Sentinel failover, replica ack {ack} ({jobs} jobs of {lo}-{hi} tokens)")
    with busy(jobs, sentinels=3, replicas=2, redis_min_replicas_ack=ack) as d:
        ids = d.submit(jobs, spread(jobs, lo, hi))
        until_fault(d, ids)
        running = [j for j, (state, _) in d.snapshot(ids).items() if state != "done"]
        if kill_sentinel:
            first = d.topology.sentinel_servers[0]  # the first in the URL every process was given
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait()
        old = d.topology.sentinel_master()
        victim = d.topology.node_at(old[1])
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        killed = time.monotonic()
        promoted = d.recover(lambda: d.topology.sentinel_master() not in (None, old), 120)
        probes, sent_at = [], None
        while sent_at is None and time.monotonic() - killed < RECOVER_WAIT_S:
            try:  # the producer that submitted the jobs, not restarted: its next submits reach the new master
                probes = d.submit(max(1, jobs // 8), 8)
                sent_at = time.monotonic() - killed
            except BrokerUnavailable:
                time.sleep(0.5)
        first_seen: dict[str, tuple[str, int]] = {}  # each job as first read after the failover

        def all_moving() -> bool:
            try:
                now = d.snapshot(running + probes)
            except BrokerUnavailable:
                return False
            for j, (state, tokens) in now.items():
                first_seen.setdefault(j, (state, tokens))
            return all(state == "done" or (state == "in_progress" and tokens != first_seen[j][1])
                       for j, (state, tokens) in now.items())

        recovered = d.recover(all_moving)
        row.recover_s = None if recovered is None else time.monotonic() - killed
        row.notes.append(f"{'first-listed sentinel killed, then the master; ' if kill_sentinel else ''}"
                         f"{len(running)} running at the kill; new master named after "
                         f"{'-' if promoted is None else f'{promoted:.1f}'} s (down-after {DOWN_AFTER_MS / 1000:g} s); "
                         f"{len(probes)} jobs of 8 tokens submitted by the same client "
                         f"{'-' if sent_at is None else f'{sent_at:.1f}'} s after the kill; recover = from the kill "
                         "until each of these is generating (tokens moving) or done; no process restarted")
        out = settle_busy(d, row, ids + probes)
        out.notes.append(f"old master back as a replica: {rejoined(d, victim)}")
        return out


def rejoined(d: Deployment, node) -> bool:
    """Start the killed master again (as ``pagedq up`` would): it must come back as a replica of the new one."""
    try:
        d.topology.start()
        d.topology.wait_healthy(60)
        return redis.Redis.from_url(node.url, socket_timeout=2).role()[0] in (b"slave", "slave")
    except (redis.RedisError, OSError, TimeoutError):
        return False


SCENARIOS: dict[str, Callable[..., Row]] = {
    "gpu_kill": gpu_kill, "cpu_kill": cpu_kill, "stage_kill": stage_kill, "redis_kill": redis_kill,
    "sigterm": sigterm, "redis_pause": redis_pause, "garbage": garbage, "backlog": backlog,
    "all_kill": all_kill, "redis_kill_busy": redis_kill_busy, "placement_kill": placement_kill,
    "sentinel_failover": sentinel_failover, "sentinel_kill": partial(sentinel_failover, kill_sentinel=True),
    "gpu_freeze": gpu_freeze,
}

# --jobs / --min-tokens / --max-tokens, for the scenarios that take them
SIZE_ARGS = {"jobs": "jobs", "min_tokens": "lo", "max_tokens": ("tokens", "hi")}


def size_kwargs(scenario: Callable[..., Row], args: argparse.Namespace) -> dict[str, int]:
    import inspect

    params = inspect.signature(scenario).parameters
    kwargs = {}
    for flag, names in SIZE_ARGS.items():
        value = getattr(args, flag)
        for name in (names,) if isinstance(names, str) else names:
            if value is not None and name in params:
                kwargs[name] = value
    return kwargs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenarios", nargs="*", help=f"any of {', '.join(SCENARIOS)} (default: all)")
    p.add_argument("--jobs", type=int, help="jobs per scenario (default: each scenario's full size)")
    p.add_argument("--min-tokens", type=int, help="busy scenarios: the smallest max_tokens (default 32)")
    p.add_argument("--max-tokens", type=int, help="max_tokens (busy scenarios: the largest, default 500)")
    args = p.parse_args()
    unknown = [name for name in args.scenarios if name not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}")
    rows = []
    for name in args.scenarios or SCENARIOS:
        print(f"running {name}...", file=sys.stderr, flush=True)
        rows.append(SCENARIOS[name](**size_kwargs(SCENARIOS[name], args)))
        print(rows[-1].line(), file=sys.stderr, flush=True)
    print(f"\nchaos, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores\n{HEADER}")
    for row in rows:
        print(row.line())
    return 0 if all(r.lost == 0 and r.twice == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
