"""Late binding through the real queue (the one dispatch path): a GPU worker claims the next job of the fleet
order when a seat is free, and no job is lost or run twice when that worker is killed or drained.

One module-scoped stack (real redis-server, real Celery worker processes, the packaged model) with 2 engine seats;
prefixes ``pfd:`` / ``pfd.``.  Ordering tests hold one seat with a long *blocker* job and free the other only
once every job they submit waits in the fair queue, so claims go one at a time: the order of ``started_at`` is
the order of the claims.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from queue import Empty

import pytest
from queue_helpers import DoneCounter, completed_once_on, wait_until

from pagedq.config import Settings
from pagedq.config.celery_app import send_dispatch_token
from pagedq.config.messages import GenerateJob
from pagedq.config.names import DISPATCH_TASK
from pagedq.config.sampling_params import SamplingParams
from pagedq.config.scheduling import SchedulingMeta
from pagedq.pipeline import Client
from pagedq.pipeline.local.stack import settings_env
from pagedq.store.dispatch import FairDispatch
from pagedq.store.lost_jobs import LostJobSweep
from pagedq.store.registry import lookup_model
from pagedq.store.transport import job_id_of, slot_of
from pagedq.workers.engine.block_hash import cache_key, prefix_hashes
from pagedq.workers.processes import free_port

TIMEOUT = 180
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="pfd:", queue_prefix="pfd.", result_cache=False,
                    kv_cache_memory="256MiB", progress_interval_s=0.5, max_num_seqs=2,
                    worker_ttl_s=6, drain_timeout_s=1, send_grace_s=5)


def tenant_client(settings: Settings, stack, name: str) -> Client:
    return Client(settings, stack.url, tenant=f"{name}-{uuid.uuid4().hex[:6]}")


def gpu_workers(stack) -> list:
    return [c for c in stack.children if c.role == "gpu"]


def blocker_tenants(settings: Settings, stack) -> tuple[Client, Client]:
    """Two tenants of their own for the blockers: the tenants under test are charged nothing for them."""
    return tenant_client(settings, stack, "blocker-a"), tenant_client(settings, stack, "blocker-b")


def hold_both_seats(*owners: Client) -> list[str]:
    """Two long jobs that take the engine's two seats (running, not merely claimed), one per owner: two tenants
    holding one seat each are both at their share, so no tenant may take a seat from them (``seat_share``)."""
    blockers = [owner.submit(prompt=f"A very long story {i}:", max_tokens=1500, priority=9, **GREEDY)
                for i, owner in enumerate(owners * (2 // len(owners)))]
    wait_until(lambda: all(int(owners[0].status(b).completion_tokens or 0) > 0 for b in blockers), TIMEOUT,
               what="the blockers to run")
    return blockers


def wait_all_waiting(client: Client, fair: FairDispatch, jobs: list[str]) -> None:
    wait_until(lambda: all(fair.is_waiting(j) for j in jobs), TIMEOUT, interval=0.2,
               what="every job waiting in the fair queue")


def started(client: Client, jobs: list[str]) -> dict[str, float]:
    return {j: client.status(j).started_at for j in jobs}


def test_strict_priority_across_tenants_when_a_seat_frees(settings, stack, client):
    """3 tenants x 3 priorities wait while the seats are taken; freed one at a time, every job of a higher band
    starts before any job of a lower band, whichever tenant submitted it and in whatever order."""
    fair = FairDispatch(client.r, client.names)
    tenants = [tenant_client(settings, stack, name) for name in ("ta", "tb", "tc")]
    blockers = hold_both_seats(*blocker_tenants(settings, stack))
    plan = [(c, p) for c in tenants for p in (1, 5, 9)]
    random.shuffle(plan)  # arrival order must not matter
    jobs = {c.submit(prompt=f"Tell me about {random.randrange(10**6)}.", max_tokens=3, priority=p, **GREEDY): p
            for c, p in plan}
    wait_all_waiting(client, fair, list(jobs))
    client.cancel(blockers[0])  # one free seat: the claims go one by one, each when the last job ended
    for job in jobs:
        client.result(job, timeout=TIMEOUT)
    client.cancel(blockers[1])
    order = sorted(jobs, key=lambda j: started(client, [j])[j])
    bands = [jobs[j] for j in order]
    print("priority of each job in the order they started:", bands)
    assert bands == sorted(bands, reverse=True), "a lower band started while a higher one waited"
    for c in tenants:
        c.close()


def test_a_flooding_tenant_does_not_starve_another(settings, stack, client):
    """Tenant A floods 40 jobs, then tenant B submits 3, same priority: B's jobs start among the first claims
    after the seat frees, not after A's 40 (arrival order would run all of A's first).  Then A's jobs still
    waiting are cancelled: each leaves the fair queue at once and ends cancelled, and no token runs it."""
    fair = FairDispatch(client.r, client.names)
    flood, other = tenant_client(settings, stack, "flood"), tenant_client(settings, stack, "other")
    blockers = hold_both_seats(*blocker_tenants(settings, stack))
    prompt = f"Say something about the number {random.randrange(10**6)}."  # one cost for every job
    a = [flood.submit(prompt=prompt, max_tokens=2, **GREEDY) for _ in range(40)]
    wait_all_waiting(client, fair, a)
    b = [other.submit(prompt=prompt, max_tokens=2, **GREEDY) for _ in range(3)]
    wait_all_waiting(client, fair, b)
    client.cancel(blockers[0])
    for job in b:
        client.result(job, timeout=TIMEOUT)
    last_b = max(started(client, b).values())
    a_before = sum(1 for t in started(client, a).values() if t is not None and t < last_b)
    print(f"flood jobs started before the other tenant's last: {a_before} of 40")
    assert a_before <= 4, f"{a_before} flood jobs ran before the other tenant's 3 (fair share alternates)"
    waiting = [j for j in a if fair.is_waiting(j)]  # the free seat goes on taking flood jobs meanwhile
    for job in waiting:
        flood.cancel(job)
    client.cancel(blockers[1])
    for job in a:
        wait_until(lambda j=job: client.status(j).done, TIMEOUT, what="every flood job ended")
    assert len(waiting) >= 30
    assert all(client.status(j).state == "cancelled" for j in waiting)
    assert client.r.hmget(client.names.fair_index, waiting) == [None] * len(waiting), "left the fair queue"
    never_started = sum(client.status(j).started_at is None for j in waiting)
    assert never_started >= len(waiting) - 1, "a job cancelled while it waits is not run (one may race a claim)"
    flood.close()
    other.close()


def test_a_tenant_below_its_share_takes_a_seat_from_a_tenant_holding_all(settings, stack, client):
    """One tenant's two long jobs hold both seats; another tenant's job runs to the end at once, in place of one
    of them (preempted, resumed afterwards), not after them; a third job of the same tenant waits (at its share)."""
    owner, newcomer = tenant_client(settings, stack, "owner"), tenant_client(settings, stack, "newcomer")
    blockers = hold_both_seats(owner)
    quick = newcomer.submit(prompt=f"Name a colour {random.randrange(10**6)}.", max_tokens=4, priority=9, **GREEDY)
    assert newcomer.result(quick, timeout=TIMEOUT)["usage"]["completion_tokens"] == 4
    assert all(client.status(b).state == "in_progress" for b in blockers), "ran beside the blockers, not after"
    held = [newcomer.submit(prompt=f"Count to {i}.", max_tokens=400, priority=9, **GREEDY) for i in range(2)]
    wait_until(lambda: client.status(held[0]).started_at is not None or client.status(held[1]).started_at
               is not None, TIMEOUT, what="one of the newcomer's jobs to take a seat")
    time.sleep(2)
    assert sum(client.status(j).started_at is not None for j in held) == 1, "one seat of two is its share"
    for job in held:
        newcomer.cancel(job)
    for b in blockers:
        owner.cancel(b)
    for job in [*held, *blockers]:
        wait_until(lambda j=job: client.status(j).done, TIMEOUT, what="every job ended")
    owner.close()
    newcomer.close()


def test_flower_shows_the_token_and_the_job_it_bound(settings, stack, client, tmp_path):
    port = free_port()
    env = {**os.environ, **settings_env(settings), "PAGEDQ_BROKER_URL": stack.url}
    cmd = [sys.executable, "-m", "pagedq.pipeline.cli", "flower", "--port", str(port), "--unauthenticated-api"]
    with open(tmp_path / "flower.log", "wb") as log:
        flower = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: _get(f"{base}/healthcheck") == "OK", 60, 0.2, "Flower to start")
        time.sleep(1.0)  # its event receiver subscribes just after the HTTP server is up
        job = client.submit(prompt=f"Hello, Flower {random.randrange(10**6)}!", max_tokens=120, **GREEDY)

        def token(state: str, text: str) -> dict | None:
            tasks = json.loads(_get(f"{base}/api/tasks") or "{}").values()
            return next((t for t in tasks if t["name"] == DISPATCH_TASK and t["state"] == state and
                         job in str(t.get("result")) and text in str(t.get("result"))), None)
        bound = wait_until(lambda: token("PROGRESS", "bound job"), 60, 0.1, "the token naming the job it bound")
        assert "binds a job when it runs" in bound["args"] and job not in bound["args"]
        wait_until(lambda: token("PROGRESS", "tokens so far"), 60, 0.1, "the token's progress naming its job")
        client.result(job, timeout=TIMEOUT)
        done = wait_until(lambda: token("SUCCESS", job), 30, 0.5, "the token's SUCCESS naming its job")
        assert done["worker"] == gpu_workers(stack)[0].hostname and "'completion_tokens': 120" in done["result"]
    finally:
        flower.send_signal(signal.SIGTERM)
        flower.wait(30)


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return None


def submit_and_wait_running(client: Client, n: int, max_tokens: int) -> tuple[list[str], list[str]]:
    jobs = [client.submit(prompt=f"Story number {random.randrange(10**6)}:", max_tokens=max_tokens, **GREEDY)
            for _ in range(n)]
    wait_until(lambda: sum(int(client.status(j).completion_tokens or 0) > 0 for j in jobs) >= 2, TIMEOUT,
               what="two bound jobs running")
    running = [j for j in jobs if int(client.status(j).completion_tokens or 0) > 0 and not client.status(j).done]
    return jobs, running


def assert_clean(client: Client) -> None:
    """Every job ended and nothing of the dispatch stayed behind: no index entry, no bound slot."""
    assert client.r.zcard(client.names.active_jobs) == 0
    assert client.r.hlen(client.names.fair_index) == 0
    assert not list(client.r.scan_iter(match=client.names.slot("*"), count=1000))


def test_a_worker_keeps_the_names_of_its_cached_blocks_in_redis(settings, stack, client):
    """For placement: the blocks of a prompt the worker computed are in its set, under the names the
    CPU side computes from the prompt's token ids and the registered model (``block_hash``)."""
    info = lookup_model(client.r, client.names, settings.model)
    prompt = [random.randint(100, 30000) for _ in range(random.randint(40, 90))]
    job = client.submit(prompt=prompt, max_tokens=4, **GREEDY)
    client.result(job, timeout=TIMEOUT)
    names = {h.hex() for h in prefix_hashes(prompt, info.block_size, cache_key(settings.model, info.fingerprint))}
    assert info.block_size > 0 and len(names) == (len(prompt) - 1) // info.block_size >= 2
    key = client.names.kv_blocks(settings.model, client.status(job).worker)
    wait_until(lambda: names <= client.r.smembers(key), 10, what="the prompt's blocks in the worker's set")
    assert 0 < client.r.ttl(key) <= settings.worker_ttl_s


def test_kill_9_of_the_gpu_worker_every_bound_job_completes_once(settings, stack, client):
    counter = DoneCounter(client.r, client.names)
    jobs, running = submit_and_wait_running(client, 5, 48)
    victim = gpu_workers(stack)[0]
    kv = client.names.kv_blocks(settings.model, victim.hostname)
    assert client.r.scard(kv) > 0, "the worker's cache is known while it runs"
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    stack.children.remove(victim)
    wait_until(lambda: not client.r.exists(kv), settings.worker_ttl_s + 5, what="the dead worker's cache set gone")
    fresh = stack.add_worker("gpu")
    completed_once_on(fresh, client, counter, jobs, running, tokens=48)
    assert all(client.status(j).attempts == 2 for j in running), "a lost worker counts an attempt"
    assert all(client.r.hget(client.names.job(j), "redeliveries") == "1" for j in running), "restored once"
    assert_clean(client)


def test_drain_hands_bound_jobs_back_and_they_complete_on_another_worker(settings, stack, client):
    counter = DoneCounter(client.r, client.names)
    fair = FairDispatch(client.r, client.names)
    jobs, running = submit_and_wait_running(client, 3, 120)  # far longer than the 1 s drain
    stack.stop_worker(gpu_workers(stack)[0])  # SIGTERM, and wait for it to exit
    assert all(client.status(j).state == "queued" and fair.is_waiting(j) for j in running), \
        "the drain hands running jobs back to the fair queue"
    fresh = stack.add_worker("gpu")
    completed_once_on(fresh, client, counter, jobs, running, tokens=120)
    assert all(client.status(j).attempts == 1 for j in running), "a drain does not count an attempt"
    assert_clean(client)


# --- the lost-job sweep and the fair queues: no workers, no model; what a preprocess does is done by hand ------
SWEEP_S = 0.3


def tokens_on_queue(client: Client, model: str) -> list[str]:
    lists = client.names.broker_lists(client.names.generate_queue(model))
    return [slot_of(json.loads(raw)) for key in lists for raw in client.r.lrange(key, 0, -1)]


def preprocessed(client: Client, fair: FairDispatch, job_id: str) -> None:
    """What the preprocess does before it sends a token: the job, tokenized, waits in its fair queue."""
    meta = SchedulingMeta(tenant=client.tenant, priority=5, arrival=time.time())
    params = SamplingParams(max_tokens=random.randrange(2, 9))
    fair.push(GenerateJob(job_id, client.settings.model, "text", [random.randrange(1, 100) for _ in range(5)],
                          params, 5, meta=meta))


def test_sweep_holds_fair_jobs_tops_up_tokens_and_releases_a_job_whose_token_is_gone(redis_url):
    tag = uuid.uuid4().hex[:8]
    s = Settings(broker_url=redis_url, key_prefix=f"fs{tag}:", queue_prefix=f"fs{tag}.", result_cache=False,
                 send_grace_s=1.0)
    with Client(s, redis_url, tenant="sweep") as client:
        model, fair = s.model, FairDispatch(client.r, client.names)
        jobs = [client.submit(prompt=f"fair sweep {uuid.uuid4().hex}", max_tokens=4) for _ in range(4)]
        for key in client.names.broker_lists(client.names.preprocess_queue):  # preprocessed: messages consumed
            client.r.delete(key)
        for job in jobs:
            preprocessed(client, fair, job)
        send_dispatch_token(client.app, model, 5)  # one token sent; the other three producers died before theirs
        resent: list[str] = []
        sweep = LostJobSweep(client.store, lambda msg, p: resent.append(msg.job_id), interval_s=SWEEP_S,
                             owner="cpu-t", send_token=lambda m, p: send_dispatch_token(client.app, m, p))
        for _ in range(3):
            time.sleep(SWEEP_S + 0.05)
            assert sweep.sweep() == [], "a job waiting in a fair queue is held"
        assert len(tokens_on_queue(client, model)) == 4, "topped up to one token per waiting job"
        assert resent == []

        # A job bound to a slot whose token is on no queue and in no worker's hands: back in line, not resent.
        slot = uuid.uuid4().hex
        bound = fair.claim(model, "gpu-gone", slot)
        assert bound is not None and fair.bound_job(slot) == bound.job_id
        found = []
        for _ in range(2):  # missing in two sweeps in a row
            time.sleep(SWEEP_S + 0.05)
            found = sweep.sweep()
        assert found == [bound.job_id] and fair.is_waiting(bound.job_id) and fair.bound_job(slot) is None
        assert client.r.hget(client.names.job(bound.job_id), "resent") == "1" and resent == []

        # Bound again, to a token that is on its queue: held.
        slot = uuid.uuid4().hex
        again = fair.claim(model, "gpu-live", slot)
        send_dispatch_token(client.app, model, 5, slot)
        for _ in range(3):
            time.sleep(SWEEP_S + 0.05)
            assert sweep.sweep() == []
        assert fair.bound_job(slot) == again.job_id
        for job in jobs:
            client.cancel(job)


# --- before the fair queue: the order a CPU worker tokenizes in ----------------------------------------------
def batch_lines(n: int, tag: str) -> list[dict]:
    return [{"custom_id": f"{tag}{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"{tag} line {i} {uuid.uuid4().hex}", "max_tokens": random.randint(2, 9)}}
            for i in range(n)]


def taken_order(client: Client) -> list[str]:
    """The preprocess messages' job ids in the order a CPU worker takes them: kombu's own ``_get`` on the
    hardened channel (lowest broker step first, first in first out within one), until the queue is empty."""
    order = []
    with client.app.connection_for_read() as conn:
        channel = conn.default_channel
        while True:
            try:
                order.append(job_id_of(channel._get(client.names.preprocess_queue)))
            except Empty:
                return order


def test_a_batch_sent_behind_another_is_tokenized_before_the_others_tail(redis_url):
    """A batch's deeper lines go to lower broker steps (``bulk_step``), so a tenant whose batch is sent after
    another's has its lines tokenized (claimable) after the other's first 16, not after all of them; a single
    request goes before both; each batch keeps its own line order."""
    tag = uuid.uuid4().hex[:8]
    s = Settings(broker_url=redis_url, key_prefix=f"fb{tag}:", queue_prefix=f"fb{tag}.", result_cache=False)
    with Client(s, redis_url, tenant="ahead") as ahead, Client(s, redis_url, tenant="behind") as behind:
        first = ahead.submit_batch(batch_lines(random.randint(280, 340), "a"))
        second = behind.submit_batch(batch_lines(random.randint(5, 15), "b"))
        single = behind.submit(prompt=f"one request {uuid.uuid4().hex}", max_tokens=4)
        a_ids = ahead.r.lrange(ahead.names.batch_jobs(first), 0, -1)
        b_ids = ahead.r.lrange(ahead.names.batch_jobs(second), 0, -1)
        order = taken_order(ahead)
    assert sorted(order) == sorted([*a_ids, *b_ids, single])
    at = {job: i for i, job in enumerate(order)}
    assert [j for j in order if j in set(a_ids)] == a_ids and [j for j in order if j in set(b_ids)] == b_ids
    assert order[0] == single
    last_b = max(at[j] for j in b_ids)
    assert last_b < at[a_ids[16]]  # all of b's lines (fewer than 16) before a's 17th
    assert min(at[j] for j in a_ids[256:]) > last_b
