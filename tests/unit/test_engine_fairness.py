"""The engine's admission order under the ``priority`` policy: strict priority, then the least-served tenant
(weighted virtual token counters), then deadline, then arrival.  The scheduler alone: no model, no processes."""

from __future__ import annotations

import random

from pagedq.config.sampling_params import SamplingParams
from pagedq.config.scheduling import SchedulingMeta
from pagedq.fleet.policy import VirtualTokenCounters
from pagedq.workers.engine.block_manager import BlockManager
from pagedq.workers.engine.executor import SamplerOutput, StepResult
from pagedq.workers.engine.scheduler import Scheduler
from pagedq.workers.engine.sequence import Sequence, SequenceStatus


def make_scheduler(seats: int = 1, policy: str = "priority", weights: dict | None = None) -> Scheduler:
    return Scheduler(BlockManager(4096, block_size=4, enable_prefix_caching=False), max_num_seqs=seats,
                     max_num_batched_tokens=512, policy=policy,
                     counters=VirtualTokenCounters(weights=weights or {}))


def seq(name: str, tenant: str, priority: int = 5, deadline: float | None = None,
        prompt_len: int | None = None, max_tokens: int | None = None) -> Sequence:
    prompt = [random.randrange(1000) for _ in range(prompt_len or random.randint(4, 40))]
    params = SamplingParams(max_tokens=max_tokens or random.randint(2, 12), temperature=0, ignore_eos=True)
    return Sequence(name, prompt, params, priority, SchedulingMeta(tenant, priority, deadline, 0.0))


def run(sched: Scheduler, arrivals: dict[int, list[Sequence]] | None = None,
        seen: list[dict[str, float]] | None = None) -> list[Sequence]:
    """Step the scheduler until nothing is left (``arrivals``: sequences added before step i); the admission
    order.  ``seen`` gets the tenants' counters at each admission."""
    admitted: list[Sequence] = []
    arrivals = dict(arrivals or {})
    for _ in range(100_000):
        for s in arrivals.pop(sched.stats.steps, []):
            sched.add(s)
        counters = dict(sched.counters.counters)
        out = sched.schedule()
        if out.is_empty and not arrivals:
            return admitted
        fresh = [s for s, _ in out.scheduled if s not in admitted]
        admitted += fresh
        if seen is not None:
            seen += [counters] * len(fresh)
        sampled = [s for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens]
        sched.update_from_output(StepResult(out, sampled, SamplerOutput([1] * len(sampled), [None] * len(sampled))))
    raise AssertionError("the scheduler did not finish")


def cost(s: Sequence) -> int:
    return s.num_prompt_tokens + s.params.max_tokens


def test_backlogged_tenants_are_served_by_weight_within_the_vtc_bound():
    weights = {"a": random.choice([1.0, 2.0, 3.0]), "b": 1.0}
    sched = make_scheduler(weights=weights)
    jobs = [seq(f"{t}{i}", t) for t in "ab" for i in range(60)]
    random.shuffle(jobs)
    for s in jobs:
        sched.add(s)
    seen: list[dict[str, float]] = []
    order = run(sched, seen=seen)
    assert sorted(s.request_id for s in order) == sorted(s.request_id for s in jobs)
    bound = 2 * max(cost(s) for s in jobs)  # VTC: two backlogged clients' weighted service differs by at most this
    last_a = max(i for i, s in enumerate(order) if s.tenant == "a")
    last_b = max(i for i, s in enumerate(order) if s.tenant == "b")
    for counters in seen[1:min(last_a, last_b)]:  # while both are backlogged
        assert abs(counters.get("a", 0.0) - counters.get("b", 0.0)) <= bound, (counters, weights)
    both = order[:min(last_a, last_b)]
    ratio = sum(cost(s) for s in both if s.tenant == "a") / sum(cost(s) for s in both if s.tenant == "b")
    assert abs(ratio - weights["a"]) <= 0.25 * weights["a"], f"token ratio {ratio:.2f}, weights {weights}"


def test_priority_is_strict_across_tenants():
    sched = make_scheduler(seats=2)
    sched.counters.charge("busy", prompt_tokens=10_000)  # far more served than anyone
    low = [seq(f"low{i}", "idle", priority=random.randint(0, 4)) for i in range(6)]
    high = [seq(f"high{i}", "busy", priority=random.randint(5, 9)) for i in range(6)]
    for s in random.sample(low + high, 12):
        sched.add(s)
    order = run(sched)
    assert {s.request_id for s in order[:6]} == {s.request_id for s in high}
    prios = [s.priority for s in order]
    assert prios == sorted(prios, reverse=True), "bands are strict, whatever the tenants' service"


def test_within_a_tenant_the_earliest_deadline_goes_first_then_arrival():
    sched = make_scheduler()
    deadlines = random.sample(range(1_000, 2_000), 5)
    timed = [seq(f"d{d}", "a", deadline=float(d)) for d in deadlines]
    untimed = [seq(f"n{i}", "a") for i in range(3)]
    for s in untimed[:2] + timed + untimed[2:]:
        sched.add(s)
    order = [s.request_id for s in run(sched)]
    assert order == [f"d{d}" for d in sorted(deadlines)] + [s.request_id for s in untimed]


def test_a_returning_tenant_banks_no_credit_for_its_idle_time():
    sched = make_scheduler()
    a = [seq(f"a{i}", "a", prompt_len=20, max_tokens=4) for i in range(40)]
    b = [seq(f"b{i}", "b", prompt_len=20, max_tokens=4) for i in range(10)]
    order = run(sched, {0: a, 60: b})  # b arrives after a has been served alone for a while
    first_b = next(i for i, s in enumerate(order) if s.tenant == "b")
    assert first_b > 10, "a was served alone before b came"
    after = [s.tenant for s in order[first_b:first_b + 10]]
    assert 3 <= after.count("b") <= 7, f"b shares from its return on, neither starved nor caught up: {after}"


def test_one_steps_admissions_alternate_between_tenants_that_arrived_together():
    """The start of a flood: a tenant's many jobs and another's few arrive between two steps, the counters level
    (the newcomer was lifted to the flood's).  One step admits many, and they must not all be the flood's (as
    when the counters moved only once that step's tokens came back)."""
    sched = make_scheduler(seats=32)
    sched.max_num_batched_tokens = 16 * 40
    flood = [seq(f"f{i}", "flood", prompt_len=40) for i in range(30)]
    chat = [seq(f"c{i}", "chat", prompt_len=40) for i in range(random.randint(3, 6))]
    for s in flood + chat:  # the flood's are older: on equal counters its jobs would come first
        sched.add(s)
    out = sched.schedule()
    admitted = [s.tenant for s, _ in out.scheduled]
    assert len(admitted) == 16
    assert admitted.count("chat") == len(chat), f"every chat job in the first step: {admitted}"


def test_a_long_prompt_of_a_tenant_below_its_share_is_prefilled_before_the_flood_s():
    """A chat prompt longer than one step's budget, seated beside another tenant's backlog of long prompts (one
    of them always part-way through its prefill): each step, the chat's chunk takes all the budget the decodes
    leave, and the flood's prefill gets what is left after it."""
    budget = 128
    sched = make_scheduler(seats=16)
    sched.max_num_batched_tokens = budget
    flood = [seq(f"f{i}", "flood", prompt_len=random.randint(300, 500), max_tokens=400) for i in range(24)]
    for s in flood:
        sched.add(s)
    for _ in range(random.randint(5, 15)):
        step(sched)
    assert any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running), "a flood prompt mid-prefill"
    chat = seq("chat", "chat", prompt_len=random.randint(3 * budget, 4 * budget), max_tokens=4)
    sched.add(chat)
    steps = 0
    while chat.num_computed_tokens < chat.num_prompt_tokens:
        left = chat.num_prompt_tokens - chat.num_computed_tokens
        decoding = {s.request_id for s in sched.running if s.num_tokens - s.num_computed_tokens == 1}
        out = step(sched)
        steps += 1
        chunks = dict((s.request_id, n) for s, n in out.scheduled)
        decodes = sum(n for s, n in out.scheduled if s.request_id in decoding)
        assert chunks.get("chat", 0) == min(left, budget - decodes), \
            f"step {steps}: the chat's chunk first, then the flood's: {sorted(chunks.items())}"
    assert steps <= chat.num_prompt_tokens // (budget - 16) + 1


def test_a_prompt_seated_with_part_of_its_prefill_gets_the_rest_before_its_tenant_seats_another():
    """One tenant's backlog of prompts: the step's last prompt is seated with the budget that is left (a part of
    its prefill).  It gets the rest at the next steps, before more of the backlog is seated; seated first, the
    backlog took every step's budget and the part-prefilled prompts waited until it ran out."""
    budget = random.randint(64, 160)
    sched = make_scheduler(seats=64)
    sched.max_num_batched_tokens = budget
    jobs = [seq(f"j{i}", "batch", prompt_len=random.randint(10, 60), max_tokens=1) for i in range(200)]
    for s in jobs:
        sched.add(s)
    for _ in range(1000):
        part = [s for s in sched.running if 1 < s.num_tokens - s.num_computed_tokens]
        if not len(sched.waiting) and not sched.running:
            break
        out = step(sched)
        scheduled = {s.request_id for s, _ in out.scheduled}
        assert all(s.request_id in scheduled for s in part), \
            f"a part-prefilled prompt skipped while {len(sched.waiting)} more were seated"
    assert all(s.status == SequenceStatus.FINISHED for s in jobs)


def test_fcfs_is_arrival_order_whatever_the_tenant_or_priority():
    sched = make_scheduler(policy="fcfs")
    jobs = [seq(f"j{i}", random.choice("abc"), priority=random.randint(0, 9)) for i in range(12)]
    for s in jobs:
        sched.add(s)
    assert [s.request_id for s in run(sched)] == [s.request_id for s in jobs]


def step(sched: Scheduler):
    out = sched.schedule()
    sampled = [s for s, n in out.scheduled if s.num_computed_tokens + n == s.num_tokens]
    sched.update_from_output(StepResult(out, sampled, SamplerOutput([1] * len(sampled), [None] * len(sampled))))
    return out


def test_a_tenant_below_its_seat_share_takes_a_seat_from_the_most_seated_tenant():
    """Every seat is held by one tenant's flood: another tenant's jobs are seated at the next step, each in place
    of one flood sequence, up to its share of the seats (half, with two tenants); beyond it they wait."""
    seats = random.randint(6, 12)
    sched = make_scheduler(seats=seats)
    flood = [seq(f"f{i}", "flood", max_tokens=500) for i in range(3 * seats)]
    for s in flood:
        sched.add(s)
    for _ in range(3):
        step(sched)
    assert [s.tenant for s in sched.running] == ["flood"] * seats
    chat = [seq(f"c{i}", "chat", max_tokens=500) for i in range(seats)]
    for s in chat:
        sched.add(s)
    out = step(sched)
    seated = [s for s, _ in out.scheduled if s.tenant == "chat"]
    assert len(seated) == seats // 2, "chat gets its share at once"
    assert sched.stats.preemptions == seats // 2, "one flood sequence out per chat sequence in"
    assert len(sched.running) == seats
    for _ in range(5):  # no more swaps while each holds its share
        step(sched)
    assert sched.stats.preemptions == seats // 2
    assert sum(s.tenant == "chat" for s in sched.running) == seats // 2


def test_no_seat_is_taken_across_a_higher_band_or_by_a_tenant_at_its_share():
    sched = make_scheduler(seats=4)
    high = [seq(f"h{i}", "a", priority=7, max_tokens=500) for i in range(4)]
    for s in high:
        sched.add(s)
    step(sched)
    lower = seq("low", "b", priority=3, max_tokens=5)
    sched.add(lower)
    for _ in range(3):
        step(sched)
    assert lower not in sched.running and sched.stats.preemptions == 0, "a lower band takes no seat"
    fcfs = make_scheduler(seats=2, policy="fcfs")
    for s in [seq(f"x{i}", "x", max_tokens=500) for i in range(2)] + [seq("y", "y", max_tokens=5)]:
        fcfs.add(s)
    for _ in range(3):
        step(fcfs)
    assert [s.tenant for s in fcfs.running] == ["x", "x"] and fcfs.stats.preemptions == 0


def test_seat_shares_follow_the_weights():
    """Tenant b (weight 1) holds all 12 seats; tenant a (weight 2) arrives with more jobs than seats: it is
    seated up to 2/3 of them at once (8), each in place of one of b's."""
    sched = make_scheduler(seats=12, weights={"a": 2.0, "b": 1.0})
    for s in [seq(f"b{i}", "b", max_tokens=500) for i in range(20)]:
        sched.add(s)
    step(sched)
    for s in [seq(f"a{i}", "a", max_tokens=500) for i in range(12)]:
        sched.add(s)
    step(sched)
    assert sorted(s.tenant for s in sched.running) == ["a"] * 8 + ["b"] * 4
    assert sched.stats.preemptions == 8
