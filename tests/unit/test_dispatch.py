"""The Redis fair queue (store/dispatch.py) against a real redis-server: the Lua claim order is the fleet order of
``pagedq.fleet.policy.FairQueue``; lift, release, unbind, remove, refund; two claimers never share a job."""

from __future__ import annotations

import json
import random
import threading
import uuid

import pytest

from pagedq.config.messages import GenerateJob
from pagedq.config.names import Names
from pagedq.config.sampling_params import SamplingParams
from pagedq.config.scheduling import SchedulingMeta
from pagedq.fleet.placement import Candidate, PlacementPolicy, WorkerLoad, decide
from pagedq.fleet.policy import FairQueue, VirtualTokenCounters, below_share
from pagedq.store.dispatch import FairDispatch, SeatsHeld, Skip, SlotBusy

MODEL = "test/fair-model"


@pytest.fixture
def names() -> Names:
    return Names(key_prefix=f"t-{uuid.uuid4().hex[:8]}:", queue_prefix="t.")


@pytest.fixture
def dispatch(redis, names) -> FairDispatch:
    return FairDispatch(redis, names)


def _job(meta: SchedulingMeta, prompt: int | None = None, max_tokens: int | None = None,
         model: str = MODEL) -> GenerateJob:
    prompt = prompt if prompt is not None else random.randint(1, 300)
    return GenerateJob(job_id=uuid.uuid4().hex, model=model, kind="text",
                       prompt_token_ids=[random.randrange(1000) for _ in range(prompt)],
                       params=SamplingParams(max_tokens=max_tokens if max_tokens is not None else random.randint(1, 128)),
                       priority=meta.priority, meta=meta)


def _create_records(redis, names, jobs: list[GenerateJob], state: str = "queued") -> None:
    pipe = redis.pipeline()
    for job in jobs:
        pipe.hset(names.job(job.job_id), mapping={"state": state, "model": job.model})
    pipe.execute()


def _random_meta(tenants: list[str], bands: list[int]) -> SchedulingMeta:
    # Arrivals on the microsecond grid: the Redis member keeps 6 decimals (the Redis clock's resolution).
    return SchedulingMeta(tenant=random.choice(tenants), priority=random.choice(bands),
                          deadline=random.choice([None, None, round(random.uniform(1e9, 1e9 + 100), 3)]),
                          arrival=round(random.uniform(1.7e9, 1.7e9 + 60), 6))


def _cost(job: GenerateJob) -> tuple[int, int]:
    return len(job.prompt_token_ids), job.params.max_tokens


@pytest.mark.parametrize("ties", [False, True], ids=["mixed", "ties"])
def test_claim_order_is_the_fleet_order_on_random_workloads(redis, names, dispatch, ties):
    """The key property: push / claim / refund interleaved at random give the same sequence of jobs, and the
    same counters, as the plain-Python FairQueue with the same weights and charges.  ``ties``: equal costs,
    weights and few distinct deadlines, so counters and deadlines are often equal and the tie-breaks decide."""
    tenants = [f"tenant-{i}-{uuid.uuid4().hex[:4]}" for i in range(random.randint(3, 5))]
    bands = random.sample(range(10), random.randint(2, 3))
    weights = {} if ties else {t: random.choice([1.0, 2.0, 0.5, round(random.uniform(0.2, 4), 3)])
                               for t in tenants[1:]}
    cost = random.randint(5, 50)
    if weights:
        redis.hset(names.tenant_weights, mapping={t: str(w) for t, w in weights.items()})
    oracle: FairQueue[str] = FairQueue(VirtualTokenCounters(weights=weights))
    jobs: dict[str, GenerateJob] = {}
    claimed = 0
    for step in range(random.randint(250, 350)):
        action = random.random()
        if action < 0.5 or not len(oracle):
            meta = _random_meta(tenants, bands)
            if ties:
                meta = SchedulingMeta(meta.tenant, meta.priority, random.choice([None, 1e9]), meta.arrival)
            job = _job(meta, cost, cost) if ties else _job(meta)
            jobs[job.job_id] = job
            _create_records(redis, names, [job])
            dispatch.push(job)
            oracle.push(job.job_id, job.meta)
        elif action < 0.9:
            want = oracle.pop()
            got = dispatch.claim(MODEL, "w1", f"slot-{step}")
            assert got is not None and got.job_id == want, f"step {step}: claim order differs from FairQueue"
            assert got == jobs[want]
            oracle.counters.charge(got.meta.tenant, *_cost(got))
            claimed += 1
        else:
            job = jobs[random.choice(list(jobs))]
            unused = job.params.max_tokens if ties else random.randint(0, job.params.max_tokens)
            dispatch.refund(MODEL, job.meta.tenant, unused)
            oracle.counters.charge(job.meta.tenant, 0, -unused)
        assert dispatch.waiting(MODEL) == len(oracle)
    while (want := oracle.pop()) is not None:
        got = dispatch.claim(MODEL, "w1", f"drain-{want}")
        assert got is not None and got.job_id == want
        oracle.counters.charge(got.meta.tenant, *_cost(got))
        claimed += 1
    assert claimed > 100
    assert dispatch.claim(MODEL, "w1", "empty") is None
    assert dispatch.waiting_by_tenant(MODEL) == {}
    assert dispatch.counters(MODEL) == {t: c for t, c in oracle.counters.counters.items()}


def test_a_claim_beyond_the_seats_takes_only_what_may_take_a_seat(redis, names, dispatch):
    """A worker with every seat taken claims only a job of the highest band waiting, and only if that band
    outranks a running job or its tenant holds fewer seats than its weighted share (``seat_share``); the choice is
    ``FairQueue.peek`` with the same filter.  Random workloads, checked claim by claim against the oracle."""
    tenants = [f"t{i}-{uuid.uuid4().hex[:4]}" for i in range(random.randint(2, 4))]
    bands = random.sample(range(10), 2)
    weights = {t: random.choice([1.0, 2.0, 0.5, 3.0]) for t in tenants[1:]}  # the first: no weight (1)
    redis.hset(names.tenant_weights, mapping={t: str(w) for t, w in weights.items()})
    oracle: FairQueue[str] = FairQueue(VirtualTokenCounters(weights=weights))
    jobs: dict[str, GenerateJob] = {}
    outcomes = {"any": 0, "below share": 0, "none": 0}
    for step in range(200):
        if random.random() < 0.5 or not len(oracle):
            job = _job(_random_meta(tenants, bands))
            jobs[job.job_id] = job
            _create_records(redis, names, [job])
            dispatch.push(job)
            oracle.push(job.job_id, job.meta)
            continue
        seats = random.randint(2, 12)
        held = {t: n for t in random.sample(tenants, random.randint(1, len(tenants)))
                if (n := random.randint(0, seats)) > 0}
        lowest = random.choice(bands)
        top = max(j.meta.priority for j in jobs.values() if j.job_id in oracle)
        want = oracle.peek() if top > lowest else oracle.peek(below_share(held, seats, oracle.counters.weight))
        got = dispatch.claim(MODEL, "w", f"s{step}", SeatsHeld(seats, held, lowest))
        assert (got.job_id if got else None) == want, (step, held, seats, lowest)
        outcomes["none" if want is None else "any" if top > lowest else "below share"] += 1
        if got is not None:
            oracle.remove(want)
            oracle.counters.charge(got.meta.tenant, *_cost(got))
    assert all(outcomes.values()), outcomes  # every case was exercised
    assert dispatch.waiting(MODEL) == len(oracle)


def test_strict_priority_then_least_served_tenant(redis, names, dispatch):
    """A higher band goes first whatever the counters; within a band the least-served tenant does."""
    redis.hset(names.vtc(MODEL), mapping={"rich": "1000", "poor": "10"})
    low = [_job(SchedulingMeta("poor", 3, None, 1.0 + i)) for i in range(2)]
    high = _job(SchedulingMeta("rich", 7, None, 50.0))
    rich = _job(SchedulingMeta("rich", 3, None, 0.5))
    jobs = [*low, high, rich]
    _create_records(redis, names, jobs)
    for job in jobs:
        dispatch.push(job)
    order = [dispatch.claim(MODEL, "w", f"s{i}").job_id for i in range(4)]
    assert order[0] == high.job_id
    assert order[1] == low[0].job_id  # poor: 10 + one charge (< 430) stays below rich
    assert set(order[2:]) == {low[1].job_id, rich.job_id}


def test_a_returning_tenant_starts_at_the_lowest_active_counter(redis, names, dispatch):
    busy = [_job(SchedulingMeta(t, 5, None, float(i))) for i, t in enumerate(["a", "b", "a", "b"])]
    _create_records(redis, names, busy)
    for job in busy:
        dispatch.push(job)
    for i in range(2):  # a and b served once each: both counters > 0
        dispatch.claim(MODEL, "w", f"s{i}")
    before = dispatch.counters(MODEL)
    low = min(before["a"], before["b"])
    assert low > 0 and "idle" not in before
    back = _job(SchedulingMeta("idle", 5, None, 99.0))
    _create_records(redis, names, [back])
    dispatch.push(back)
    assert dispatch.counters(MODEL)["idle"] == low  # lifted: idle time banked no credit
    # A tenant still active is not lifted again by a second job; one above the floor keeps its own counter.
    redis.hset(names.vtc(MODEL), "idle", repr(low + 5000))
    again = _job(SchedulingMeta("idle", 5, None, 100.0))
    _create_records(redis, names, [again])
    dispatch.push(again)
    assert dispatch.counters(MODEL)["idle"] == low + 5000
    assert dispatch.waiting_by_tenant(MODEL) == {"a": 1, "b": 1, "idle": 2}


def test_push_is_idempotent_and_release_puts_a_job_back_exactly_once(redis, names, dispatch):
    jobs = [_job(SchedulingMeta(random.choice(["a", "b"]), 5, None, float(i))) for i in range(5)]
    _create_records(redis, names, jobs)
    for job in jobs:
        dispatch.push(job)
        dispatch.push(job)  # waiting: changes nothing
    assert dispatch.waiting(MODEL) == 5
    first = dispatch.claim(MODEL, "w", "slot-1")
    counters_after_claim = dispatch.counters(MODEL)
    dispatch.push(first)  # bound: changes nothing
    assert dispatch.waiting(MODEL) == 4
    assert dispatch.bound_job("slot-1") == first.job_id
    assert redis.hget(names.job(first.job_id), "slot") == "slot-1"
    with pytest.raises(SlotBusy):
        dispatch.claim(MODEL, "w", "slot-1")
    redis.hset(names.job(first.job_id), "state", "in_progress")
    assert dispatch.release("slot-1") == first.job_id
    assert dispatch.release("slot-1") is None  # a second release is a no-op
    assert dispatch.waiting(MODEL) == 5
    assert dispatch.bound_job("slot-1") is None
    assert redis.hget(names.job(first.job_id), "state") == "queued"
    assert redis.hget(names.job(first.job_id), "slot") is None
    tenant = first.meta.tenant
    assert dispatch.counters(MODEL)[tenant] < counters_after_claim[tenant]  # the claim's charge came back
    # Back at its own place: the earliest of its tenant, so claimed again first.
    again = dispatch.claim(MODEL, "w", "slot-2")
    assert again.job_id == first.job_id
    seen = [again.job_id] + [dispatch.claim(MODEL, "w", f"slot-{i}").job_id for i in range(3, 7)]
    assert sorted(seen) == sorted(j.job_id for j in jobs)
    assert dispatch.claim(MODEL, "w", "slot-9") is None


def test_unbind_forgets_and_remove_takes_a_waiting_job_out(redis, names, dispatch):
    jobs = [_job(SchedulingMeta("a", 5, None, float(i))) for i in range(3)]
    _create_records(redis, names, jobs)
    for job in jobs:
        dispatch.push(job)
    bound = dispatch.claim(MODEL, "w", "s1")
    assert dispatch.remove(bound.job_id) is False  # bound, not waiting
    assert dispatch.remove(jobs[2].job_id) is True
    assert dispatch.remove(jobs[2].job_id) is False
    assert redis.exists(names.fair_message(jobs[2].job_id)) == 0
    dispatch.unbind("s1", job_id=jobs[2].job_id)  # the end of another job: the slot's binding stays
    assert dispatch.bound_job("s1") == bound.job_id
    assert redis.exists(names.fair_message(bound.job_id)) == 1
    dispatch.unbind("s1", job_id=bound.job_id)
    assert dispatch.bound_job("s1") is None
    assert redis.exists(names.fair_message(bound.job_id)) == 0
    assert redis.hget(names.fair_index, bound.job_id) is None
    assert dispatch.release("s1") is None
    assert dispatch.claim(MODEL, "w", "s2").job_id == jobs[1].job_id
    assert dispatch.claim(MODEL, "w", "s3") is None


def test_claim_skips_jobs_that_ended_or_are_cancelling(redis, names, dispatch):
    jobs = [_job(SchedulingMeta("a", 5, None, float(i))) for i in range(4)]
    for job, state in zip(jobs, ["expired", "cancelling", "completed", "queued"], strict=True):
        _create_records(redis, names, [job], state=state)
        dispatch.push(job)
    assert dispatch.claim(MODEL, "w", "s").job_id == jobs[3].job_id
    assert dispatch.waiting(MODEL) == 0
    for job in jobs[:3]:
        assert redis.hget(names.fair_index, job.job_id) is None
        assert redis.exists(names.fair_message(job.job_id)) == 0


def test_refund_gives_back_unused_output_divided_by_weight(redis, names, dispatch):
    redis.hset(names.tenant_weights, "heavy", "2.0")
    job = _job(SchedulingMeta("heavy", 5, None, 1.0), prompt=40, max_tokens=100)
    _create_records(redis, names, [job])
    dispatch.push(job)
    dispatch.claim(MODEL, "w", "s")
    assert dispatch.counters(MODEL)["heavy"] == 70.0  # (40 + 100) / 2
    dispatch.refund(MODEL, "heavy", 64)
    assert dispatch.counters(MODEL)["heavy"] == 38.0


def test_unbind_with_a_refund_gives_back_the_output_in_the_same_call(redis, names, dispatch):
    redis.hset(names.tenant_weights, "heavy", "4.0")
    prompt, max_tokens = random.randint(1, 200), random.randint(8, 200)
    unused = random.randint(1, max_tokens)
    jobs = [_job(SchedulingMeta("heavy", 5, None, float(i)), prompt=prompt, max_tokens=max_tokens) for i in range(2)]
    _create_records(redis, names, jobs)
    for job in jobs:
        dispatch.push(job)
    bound = dispatch.claim(MODEL, "w", "s1")
    charged = dispatch.counters(MODEL)["heavy"]
    assert charged == (prompt + max_tokens) / 4.0
    dispatch.unbind("s1", bound.job_id, MODEL, "heavy", unused)
    assert dispatch.bound_job("s1") is None
    assert redis.hget(names.fair_index, bound.job_id) is None
    assert dispatch.counters(MODEL)["heavy"] == charged - unused / 4.0
    # A slot rebound to another job keeps its binding; the ended job's refund is still given back.
    other = dispatch.claim(MODEL, "w", "s1")
    after = dispatch.counters(MODEL)["heavy"]
    dispatch.unbind("s1", bound.job_id, MODEL, "heavy", unused)
    assert dispatch.bound_job("s1") == other.job_id
    assert dispatch.counters(MODEL)["heavy"] == after - unused / 4.0


def test_a_fenced_worker_leaves_the_slot_its_restored_token_bound_again(redis, names, dispatch):
    """A worker froze past its lease: its token was restored (the job released, same slot name) and another worker
    took the job again under that slot (the epoch moved on).  The woken worker's unbind and release, fenced at its
    old epoch, change nothing: not the binding, not the index entry, not the counters."""
    job = _job(SchedulingMeta("a", 5, None, 1.0))
    _create_records(redis, names, [job], state="in_progress")
    dispatch.push(job)
    old_epoch = random.randint(1, 50)
    redis.hset(names.job(job.job_id), "epoch", old_epoch)
    assert dispatch.claim(MODEL, "frozen", "s1").job_id == job.job_id
    assert dispatch.release("s1") == job.job_id  # the restore: no fence
    assert dispatch.claim(MODEL, "other", "s1").job_id == job.job_id
    redis.hset(names.job(job.job_id), "epoch", old_epoch + 1)  # the other worker's admit
    entry, counters = redis.hget(names.fair_index, job.job_id), dispatch.counters(MODEL)
    dispatch.unbind("s1", job.job_id, MODEL, "a", random.randint(1, 20), fence=old_epoch)
    assert dispatch.release("s1", fence=old_epoch) is None
    assert dispatch.bound_job("s1") == job.job_id
    assert redis.hget(names.fair_index, job.job_id) == entry
    assert redis.exists(names.fair_message(job.job_id)) == 1
    assert dispatch.counters(MODEL) == counters
    # The holder's own fence unbinds.
    dispatch.unbind("s1", job.job_id, MODEL, "a", 0, fence=old_epoch + 1)
    assert dispatch.bound_job("s1") is None and redis.hget(names.fair_index, job.job_id) is None


def test_two_concurrent_claimers_never_share_a_job(redis_url, names):
    from pagedq.store.connection import redis_client

    clients = [redis_client(redis_url) for _ in range(2)]
    try:
        setup = FairDispatch(clients[0], names)
        jobs = [_job(_random_meta(["a", "b", "c"], [2, 6])) for _ in range(300)]
        _create_records(clients[0], names, jobs)
        for job in jobs:
            setup.push(job)
        taken: list[list[str]] = [[], []]

        def claimer(i: int) -> None:
            d = FairDispatch(clients[i], names)
            n = 0
            while True:
                slot = f"w{i}-slot-{n % 4}"
                job = d.claim(MODEL, f"w{i}", slot)
                if job is None:
                    return
                taken[i].append(job.job_id)
                if n % 5 == 4 and d.release(slot) == job.job_id:  # sometimes hand it back instead
                    taken[i].pop()
                else:
                    d.unbind(slot)
                n += 1

        threads = [threading.Thread(target=claimer, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert all(taken), "both claimers got work"
        everything = taken[0] + taken[1]
        assert len(everything) == len(set(everything)) == len(jobs)
        assert setup.waiting(MODEL) == 0
    finally:
        for c in clients:
            c.close()


def _redis_now(redis) -> float:
    sec, usec = redis.time()
    return sec + usec / 1e6


def test_a_placed_claim_decides_as_the_placement_oracle_on_random_fleets(redis, names, dispatch):
    """``claim_placed`` (Lua) against ``fleet.placement.decide`` over ``FairQueue.candidates`` (Python): random
    workers (cache sets of random prefixes of shared chains, loads, free seats, some dead), random jobs (tenants,
    bands, chains), random claimers; every claim takes the same job for the same reason, or skips with the same
    nudge.  The oracle reads the workers' loads, the counters and the nudge marks back from Redis after each
    claim (the claim changes them), and decides on its own."""
    policy = PlacementPolicy(block_size=16, load_weight=random.choice([0.5, 1.0, 2.0]),
                             slack_tokens=random.choice([0.0, 32.0]), steal_s=0.5,
                             candidates=random.randint(2, 8), per_tenant=random.randint(1, 3))
    chains = [[uuid.uuid4().hex for _ in range(random.randint(3, 12))] for _ in range(5)]
    hosts = [f"gpu-{i}-{uuid.uuid4().hex[:4]}" for i in range(random.randint(2, 4))]
    now = _redis_now(redis)
    dead = {hosts[-1]} if random.random() < 0.5 else set()
    for h in hosts:
        redis.sadd(names.placement_workers(MODEL), h)
        redis.hset(names.worker(h), mapping={
            "beat_at": f"{now - (60 if h in dead else 0.5):.6f}", "ttl_s": "15", "role": "gpu",
            "load_tokens": str(random.randint(1, 600)), "free_seats": str(random.choice([0, 1, 3]))})
        cached = [b for chain in random.sample(chains, random.randint(1, 3)) for b in chain[:random.randint(1, len(chain))]]
        redis.sadd(names.kv_blocks(MODEL, h), *cached)
    redis.sadd(names.placement_workers(MODEL), "gone-host")  # no record: dropped by the first claim
    tenants = [f"t{i}-{uuid.uuid4().hex[:4]}" for i in range(3)]
    sessions = [f"s{i}-{uuid.uuid4().hex[:4]}" for i in range(4)]
    for session in sessions[:3]:  # the last one has no worker yet
        redis.set(names.placement_session(MODEL, session), random.choice(hosts))
    oracle: FairQueue[str] = FairQueue()
    jobs: dict[str, GenerateJob] = {}
    for i in range(random.randint(12, 30)):
        chain = random.choice(chains)
        blocks = chain[:random.randint(1, len(chain))] + [uuid.uuid4().hex for _ in range(random.randint(0, 2))]
        if random.random() < 0.3:  # a prompt no worker holds any of (a summarised history)
            blocks = [uuid.uuid4().hex for _ in range(random.randint(1, 6))]
        meta = SchedulingMeta(random.choice(tenants), random.choice([3, 5]), None, float(i),
                              random.choice([None, *sessions]))
        job = _job(meta, prompt=16 * len(blocks) + random.randint(1, 15), max_tokens=random.randint(1, 40))
        jobs[job.job_id] = job
        _create_records(redis, names, [job])
        dispatch.push(job, blocks)
        oracle.push(job.job_id, meta)
        entry = json.loads(redis.hget(names.fair_index, job.job_id))
        entry["since"] = f"{now + random.choice([-60, 60]):.6f}"  # far from the steal boundary either way
        redis.hset(names.fair_index, job.job_id, json.dumps(entry))
    oracle.counters.counters.update(dispatch.counters(MODEL))
    seen: dict[str, int] = {}
    for step in range(60):
        if not len(oracle):
            break
        claimer = random.choice([h for h in hosts if h not in dead])
        workers = {}
        for h in hosts:
            rec = redis.hgetall(names.worker(h))
            if h not in dead or h == claimer:
                workers[h] = WorkerLoad(h, redis.smembers(names.kv_blocks(MODEL, h)),
                                        float(rec["load_tokens"]) + float(rec.get("claimed_tokens", 0)),
                                        int(rec["free_seats"]))
        candidates = []
        for key in oracle.candidates(policy.candidates, policy.per_tenant):
            entry = json.loads(redis.hget(names.fair_index, key))
            session = entry.get("session")
            candidates.append(Candidate(key, entry.get("blocks", []), int(entry["prompt"]), float(entry["since"]),
                                        entry.get("nudged"), session and redis.get(names.placement_session(MODEL,
                                                                                                             session))))
        want = decide(candidates, claimer, workers, _redis_now(redis), policy)
        before = dispatch.placement_stats(MODEL)
        got = dispatch.claim_placed(MODEL, claimer, f"slot-{step}", policy)
        after = dispatch.placement_stats(MODEL)
        if want.key is None:
            assert got == Skip(want.nudge, got.retry_in), f"step {step}: {got} vs {want}"
            assert after.get("skipped", 0) == before.get("skipped", 0) + 1
        else:
            assert isinstance(got, GenerateJob) and got.job_id == want.key, f"step {step}: {got} vs {want}"
            assert after.get(want.reason, 0) == before.get(want.reason, 0) + 1
            if got.meta.session:
                assert redis.get(names.placement_session(MODEL, got.meta.session)) == claimer
            oracle.remove(want.key)
            oracle.counters.counters.update(dispatch.counters(MODEL))
        seen[want.reason] = seen.get(want.reason, 0) + 1
    assert redis.sismember(names.placement_workers(MODEL), "gone-host") == 0
    assert sum(n for r, n in seen.items() if r != "skipped") > 0


def test_status_and_exporter_show_placement_decisions_and_the_fleet_hit_ratio(redis, names):
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from pagedq.pipeline.exporter import deployment_registry
    from pagedq.pipeline.status import render, snapshot
    from pagedq.store.registry import Heartbeat, ModelInfo, register_model

    register_model(redis, names, ModelInfo(MODEL, "fp", 2048, 1000, names.generate_queue(MODEL), block_size=16))
    decisions = {"by_cache": random.randint(1, 50), "by_load": random.randint(1, 50), "skipped": random.randint(1, 9)}
    redis.hset(names.placement_stats(MODEL), mapping=decisions)
    hits, computed = [random.randint(100, 900) for _ in range(2)], [random.randint(100, 900) for _ in range(2)]
    for i in range(2):
        Heartbeat(redis, names.worker(f"gpu-{i}"), {"role": "gpu", "model": MODEL, "prefix_hits": hits[i],
                                                   "prompt_tokens_computed": computed[i]}, ttl_s=30)
    snap = snapshot(redis, names)
    ratio = sum(hits) / (sum(hits) + sum(computed))
    assert snap.placement[MODEL] == {**decisions, "hit_ratio": round(ratio, 4)}
    assert "PLACEMENT" in render(snap) and f"{ratio:.1%}" in render(snap)
    text = generate_latest(deployment_registry(redis, names)).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    for decision, n in decisions.items():
        assert samples[("pagedq_placement_decisions_total", (("decision", decision), ("model", MODEL)))] == n
    assert samples[("pagedq_fleet_prefix_hit_ratio", (("model", MODEL),))] == round(ratio, 4)


def test_a_fresh_token_skips_a_claim_beyond_the_seats_only_when_its_own_job_could_not_win():
    from pagedq.config.celery_app import DispatchToken
    from pagedq.workers.gpu_worker import parse_token, sent_for_a_winner

    seats, low = random.randint(2, 64), random.randint(0, 8)
    alone = SeatsHeld(seats, {"a": seats}, low)
    assert not sent_for_a_winner(DispatchToken(MODEL, "s", low, "a"), alone), "its tenant holds every seat"
    assert sent_for_a_winner(DispatchToken(MODEL, "s", low + 1, "a"), alone), "a higher band than any running"
    assert sent_for_a_winner(DispatchToken(MODEL, "s", low, "b"), alone), "another tenant: maybe below its share"
    assert sent_for_a_winner(DispatchToken(MODEL, "s", low, None), alone), "a spare or an older sender's token"
    shared = SeatsHeld(seats, {"a": seats - 1, "b": 1}, low)
    assert sent_for_a_winner(DispatchToken(MODEL, "s", low, "a"), shared), "shares may have moved"
    # The tenant travels in the token's body; an older sender's body has none.
    assert parse_token({"model": MODEL, "slot": "s", "priority": low, "tenant": "a"}, "t").tenant == "a"
    assert parse_token({"model": MODEL, "slot": "s", "priority": low}, "t").tenant is None
