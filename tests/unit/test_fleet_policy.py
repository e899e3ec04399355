"""The fleet order (pagedq.fleet.policy) in plain Python: bands, VTC fair share, deadlines, arrival."""

from __future__ import annotations

import random

import pytest

from pagedq.config.scheduling import SchedulingMeta
from pagedq.fleet.policy import FairQueue, VirtualTokenCounters, below_share, seat_share


def _random_jobs(n: int, tenants: list[str], priorities: list[int]) -> dict[int, SchedulingMeta]:
    return {i: SchedulingMeta(tenant=random.choice(tenants), priority=random.choice(priorities),
                              deadline=random.choice([None, random.uniform(1, 100)]), arrival=random.uniform(0, 50))
            for i in range(n)}


def test_strict_priority_across_bands_whatever_the_counters():
    q: FairQueue[int] = FairQueue()
    jobs = _random_jobs(300, ["a", "b", "c"], [1, 5, 9])
    for key, meta in jobs.items():
        q.push(key, meta)
    popped = []
    while (key := q.pop()) is not None:
        q.counters.charge(jobs[key].tenant, random.randint(1, 500), random.randint(1, 200))
        popped.append(jobs[key].priority)
    assert len(popped) == 300
    assert popped == sorted(popped, reverse=True)


def test_within_a_tenant_earliest_deadline_then_arrival():
    q: FairQueue[int] = FairQueue()
    jobs = _random_jobs(100, ["only"], [5])
    for key, meta in jobs.items():
        q.push(key, meta)
    order = [q.pop() for _ in range(100)]
    assert [jobs[k].order_within_tenant() for k in order] == sorted(m.order_within_tenant() for m in jobs.values())


@pytest.mark.parametrize("weights", [(1.0, 1.0), (2.0, 1.0), (1.0, 3.0)])
def test_backlogged_tenants_share_by_weight_within_the_vtc_bound(weights):
    counters = VirtualTokenCounters(weights={"a": weights[0], "b": weights[1]})
    q: FairQueue[int] = FairQueue(counters)
    cost: dict[int, int] = {}
    for i in range(4000):  # both stay backlogged throughout
        cost[i] = random.randint(1, 300)
        q.push(i, SchedulingMeta(tenant="ab"[i % 2], arrival=float(i)))
    served = {"a": 0, "b": 0}
    max_cost = max(cost.values())
    for _ in range(1500):
        key = q.pop()
        tenant = "ab"[key % 2]
        served[tenant] += cost[key]
        counters.charge(tenant, prompt_tokens=cost[key])
        # VTC: weighted service of backlogged tenants never drifts apart by more than the largest request's cost
        assert abs(counters.get("a") - counters.get("b")) <= max_cost / min(weights) + 1e-9
    assert served["a"] / served["b"] == pytest.approx(weights[0] / weights[1], rel=0.1)


def test_a_returning_tenant_starts_at_the_least_served_counter():
    counters = VirtualTokenCounters()
    q: FairQueue[str] = FairQueue(counters)
    for i in range(200):
        q.push(f"a{i}", SchedulingMeta(tenant="a", arrival=float(i)))
        q.push(f"c{i}", SchedulingMeta(tenant="c", arrival=float(i)))
    for _ in range(100):  # a and c have been served a lot; b was idle all along
        key = q.pop()
        counters.charge({"a": "a", "c": "c"}[key[0]], prompt_tokens=random.randint(50, 100))
    least = min(counters.get("a"), counters.get("c"))
    for i in range(200):
        q.push(f"b{i}", SchedulingMeta(tenant="b", arrival=1000.0 + i))
    assert counters.get("b") == least  # idle time banked no credit
    taken = {"a": 0, "b": 0, "c": 0}
    for _ in range(90):
        key = q.pop()
        taken[key[0]] += 1
        counters.charge(key[0], prompt_tokens=75)
    assert 20 <= taken["b"] <= 40  # about a third, not all 90 (no catch-up for the idle time)


def test_remove_and_membership():
    q: FairQueue[int] = FairQueue()
    jobs = _random_jobs(50, ["a", "b"], [2, 7])
    for key, meta in jobs.items():
        q.push(key, meta)
    gone = set(random.sample(sorted(jobs), 20))
    for key in gone:
        assert q.remove(key)
        assert not q.remove(key)
    with pytest.raises(KeyError):
        q.push(next(iter(set(jobs) - gone)), SchedulingMeta())
    rest = []
    while (key := q.pop()) is not None:
        rest.append(key)
    assert sorted(rest) == sorted(set(jobs) - gone)
    assert len(q) == 0 and q.peek() is None


def test_a_weight_must_be_positive():
    with pytest.raises(ValueError, match="tenant 'x'"):
        VirtualTokenCounters(weights={"x": 0}).charge("x", 1)


def test_meta_round_trips_through_its_dict():
    meta = SchedulingMeta(tenant="t-" + str(random.randint(1, 99)), priority=random.randint(0, 9),
                          deadline=random.uniform(1, 9), arrival=random.uniform(1, 9))
    assert SchedulingMeta.from_dict(meta.to_dict()) == meta
    assert SchedulingMeta.from_dict({"deadline": ""}).deadline is None


def test_seat_share_splits_a_workers_seats_among_the_tenants_holding_some():
    seats = random.randint(8, 64)
    held = {"a": seats - 3, "b": 3, "gone": 0}
    assert seat_share(held, "a", seats) == seats // 2
    assert seat_share(held, "c", seats) == seats // 3  # a newcomer counts itself
    below = below_share(held, seats)
    assert below("b") and below("c") and not below("a")
    assert seat_share({}, "a", 1) == 1 and below_share({"a": 1}, 1)("b") is False
    weights = {"a": 2.0, "b": 1.0}.get
    assert seat_share({"a": 10}, "b", 30, weights) == 10 and seat_share({"b": 10}, "a", 30, weights) == 20
