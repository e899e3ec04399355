"""The placement rule (``fleet.placement``): a job goes to the worker holding its prompt's longest cached prefix,
weighed against load; a worker may take a job another worker prefers only when that worker is loaded or full, or
once the job has waited ``steal_s``; strict priority and the fleet order choose the candidates."""

from __future__ import annotations

import random
import uuid

from pagedq.config.scheduling import SchedulingMeta
from pagedq.fleet.placement import Candidate, PlacementPolicy, WorkerLoad, cost, decide, matched
from pagedq.fleet.policy import FairQueue

POLICY = PlacementPolicy(block_size=16, load_weight=1.0, slack_tokens=32, steal_s=0.5)


def names(n: int) -> list[str]:
    return [uuid.uuid4().hex for _ in range(n)]


def test_matched_counts_only_the_leading_run():
    blocks = names(6)
    assert matched(blocks, set(blocks)) == 6
    assert matched(blocks, set(blocks[:3]) | set(blocks[4:])) == 3  # a chain: block 5 without block 4 is no use
    assert matched(blocks, set()) == 0


def test_the_worked_example_of_docs():
    """Two workers; j1's history is cached on G0, j2's on G1, j3 is new (docs/queue.md, "Which worker")."""
    c1, c3 = names(40), names(40)
    g0 = WorkerLoad("G0", set(c1[:35]), load_tokens=300, free_seats=2)
    g1 = WorkerLoad("G1", set(c3[:30]), load_tokens=100, free_seats=3)
    workers = {"G0": g0, "G1": g1}
    j1 = Candidate("j1", c1[:37], 600, since=100.0)
    j2 = Candidate("j2", c3[:32], 520, since=100.0)
    j3 = Candidate("j3", names(37), 600, since=100.0)
    assert (cost(j1, g0, POLICY), cost(j1, g1, POLICY)) == (340, 700)
    assert (cost(j2, g0, POLICY), cost(j2, g1, POLICY)) == (820, 140)
    now = 100.05
    taken = decide([j1, j2, j3], "G1", workers, now, POLICY)
    assert (taken.key, taken.reason) == ("j2", "by_cache")
    taken = decide([j1, j3], "G1", workers, now, POLICY)
    assert (taken.key, taken.reason) == ("j3", "by_load")
    skipped = decide([j1], "G1", workers, now, POLICY)
    assert (skipped.key, skipped.reason, skipped.nudge) == (None, "skipped", "G0")
    assert abs(skipped.retry_in - 0.45) < 1e-9
    assert decide([j1], "G0", workers, now, POLICY).reason == "by_cache"
    assert decide([j1], "G1", workers, 100.5, POLICY).reason == "stolen"
    # G0 full: G1 takes j1 at once; G0 gone (not live, so not passed): the same.
    full = {"G0": WorkerLoad("G0", g0.cached, 300, free_seats=0), "G1": g1}
    assert decide([j1], "G1", full, now, POLICY).key == "j1"
    assert decide([j1], "G1", {"G1": g1}, now, POLICY).key == "j1"


def test_a_hot_prefix_spreads_once_its_worker_is_loaded():
    prefix = names(20)
    prompt = 16 * 20 + random.randint(1, 15)
    job = Candidate(uuid.uuid4().hex, prefix, prompt, since=1.0)
    saved = 16 * 20
    for extra in (0, saved - 40, saved - 33, saved - 32, saved + 50):
        hot = WorkerLoad("hot", set(prefix), load_tokens=500 + extra, free_seats=4)
        cold = WorkerLoad("cold", set(), load_tokens=500, free_seats=4)
        decision = decide([job], "cold", {"hot": hot, "cold": cold}, 1.01, POLICY)
        # cold computes the whole prompt; hot computes the tail but is `extra` tokens busier
        assert (decision.key is not None) == (prompt <= prompt - saved + extra + 32), extra


def test_nothing_cached_anywhere_goes_to_whoever_asks_and_a_job_is_nudged_once():
    workers = {w: WorkerLoad(w, set(names(5)), random.randint(1, 900), 3) for w in ("a", "b", "c")}
    fresh = Candidate("fresh", names(8), 130, since=5.0)
    assert decide([fresh], "c", workers, 5.0, POLICY).reason == "by_load"
    held = list(workers["a"].cached)[:1]
    workers["a"] = WorkerLoad("a", set(held) | set(names(3)), 0, 3)
    job = Candidate("j", held + names(7), 16 * 8 + 1, since=5.0)
    workers["b"] = WorkerLoad("b", set(), 200, 3)
    first = decide([job], "b", workers, 5.1, POLICY)
    assert (first.reason, first.nudge) == ("skipped", "a")
    again = decide([Candidate("j", job.blocks, job.prompt_tokens, 5.0, nudged="a")], "b", workers, 5.2, POLICY)
    assert (again.reason, again.nudge) == ("skipped", None)


def test_candidates_are_the_fleet_order_of_the_highest_band_a_few_per_tenant():
    queue: FairQueue[str] = FairQueue()
    for i in range(5):
        for tenant in ("heavy", "light", "mid"):
            queue.push(f"{tenant}-{i}", SchedulingMeta(tenant, 5, None, float(i)))
    queue.counters.counters.update({"light": 10.0, "heavy": 500.0, "mid": 70.0})  # after the pushes' lifts
    queue.push("urgent", SchedulingMeta("heavy", 9, None, 99.0))
    assert queue.candidates(8) == ["urgent"]
    assert queue.pop() == "urgent"
    assert queue.candidates(8) == ["light-0", "light-1", "mid-0", "mid-1", "heavy-0", "heavy-1"]
    assert queue.candidates(3) == ["light-0", "light-1", "mid-0"]
    assert queue.candidates(8, per_tenant=1) == ["light-0", "mid-0", "heavy-0"]
    assert queue.candidates(1) == [queue.peek()]


def test_a_session_stays_on_its_worker_when_no_worker_holds_its_prompt():
    """A prompt whose prefix changed (no worker holds any of its blocks) goes to its session's last worker, if that
    one is live and not much busier; without a session, or with its worker gone, to whoever asks."""
    a = WorkerLoad("a", set(names(4)), load_tokens=random.randint(1, 20), free_seats=2)
    b = WorkerLoad("b", set(names(4)), load_tokens=random.randint(1, 20), free_seats=2)
    job = Candidate("j", names(6), 16 * 6 + 3, since=10.0, session_worker="a")
    assert decide([job], "a", {"a": a, "b": b}, 10.1, POLICY).reason == "by_session"
    skipped = decide([job], "b", {"a": a, "b": b}, 10.1, POLICY)
    assert (skipped.reason, skipped.nudge) == ("skipped", "a")  # b would compute 64 tokens more than a
    assert decide([job], "b", {"b": b}, 10.1, POLICY).reason == "by_load"  # a is gone
    loose = Candidate("j", job.blocks, job.prompt_tokens, 10.0)
    assert decide([loose], "b", {"a": a, "b": b}, 10.1, POLICY).reason == "by_load"
    held = Candidate("j", job.blocks, job.prompt_tokens, 10.0, session_worker="a")
    b_holds = WorkerLoad("b", set(job.blocks[:3]), b.load_tokens, 2)
    assert decide([held], "b", {"a": a, "b": b_holds}, 10.1, POLICY).reason == "by_cache"  # a real hit wins
