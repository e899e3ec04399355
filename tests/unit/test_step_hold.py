"""The GPU worker's step hold (``EngineService._hold_for_more``) over the real engine core, no model: before a
step with nothing to decode it waits for more jobs while they keep arriving and the step is not full, never
while sequences decode, never for a lone job (unless its model's backlog in Redis holds more jobs than the engine:
the first of a batch), and never past half the last such step's time (or two quiet gaps)."""

from __future__ import annotations

import random
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
from test_metrics_parts import ScriptedExecutor

from pagedq.config.names import JobState, Names
from pagedq.config.sampling_params import SamplingParams
from pagedq.store.jobs import JobStore
from pagedq.workers.engine import EngineConfig, LLMEngine
from pagedq.workers.service import EngineService

BUDGET = 64  # prompt tokens one step takes
MODEL = "scripted"


@pytest.fixture
def names() -> Names:
    tag = uuid.uuid4().hex[:8]
    return Names(key_prefix=f"h{tag}:", queue_prefix=f"h{tag}.")


@pytest.fixture
def service(redis, names):
    def make(hold_s: float, last_prefill_s: float | None) -> tuple[EngineService, LLMEngine]:
        return new_service(redis, names, hold_s, last_prefill_s)
    return make


def new_service(redis, names: Names, hold_s: float, last_prefill_s: float | None) -> tuple[EngineService, LLMEngine]:
    config = EngineConfig(model_name=MODEL, fingerprint="f", max_model_len=4096, vocab_size=1000,
                          eos_token_ids=frozenset({1001}), block_size=4, max_num_batched_tokens=BUDGET)
    engine = LLMEngine(config, ScriptedExecutor())
    svc = EngineService(lambda: None, client=redis, names=names, hostname="w", step_hold_s=hold_s)
    svc.engine = SimpleNamespace(engine=engine)
    svc._last_prefill_s = last_prefill_s
    return svc, engine


def add(svc: EngineService, engine: LLMEngine, rid: str, n_tokens: int, max_tokens: int = 1) -> None:
    """What ``submit`` does for the hold: the request in the engine, the arrival noted, the stepper woken."""
    engine.add_request(rid, [random.randint(2, 999) for _ in range(n_tokens)],
                       SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    svc.handles[rid] = None  # held by the engine (what ``submit`` records; the backlog is compared with it)
    svc._note_arrival(n_tokens, MODEL)


def timed_hold(svc: EngineService) -> tuple[bool, float]:
    start = time.monotonic()
    prefill_only = svc._hold_for_more()
    return prefill_only, time.monotonic() - start


def test_a_trickle_of_jobs_is_held_for_until_half_the_last_prefill_steps_time(service):
    svc, engine = service(hold_s=0.2, last_prefill_s=0.8)
    add(svc, engine, "first", 5)
    add(svc, engine, "second", 5)  # a stream under way: the second came within the gap of the first
    stop = threading.Event()

    def trickle() -> None:  # a job every 20 ms, each far under the budget
        i = 0
        while not stop.wait(0.02):
            add(svc, engine, f"j{i}", 1)
            i += 1

    t = threading.Thread(target=trickle)
    t.start()
    try:
        prefill_only, held = timed_hold(svc)
    finally:
        stop.set()
        t.join()
    assert prefill_only
    assert 0.35 <= held < 0.8, f"held {held:.3f} s: the cap is half the last prefill step (0.4 s)"


def test_a_lone_job_is_not_held_a_second_close_behind_waits_the_quiet_gap_a_full_step_not_at_all(service):
    svc, engine = service(hold_s=0.1, last_prefill_s=10.0)
    add(svc, engine, "lone", 5)  # the first job in a while (one client waiting for each answer)
    prefill_only, held = timed_hold(svc)
    assert prefill_only and held < 0.05, f"held {held:.3f} s for a lone job"
    svc._begin_step(prefill_only)
    engine.step()
    time.sleep(0.15)  # longer than the gap: the next job is lone again
    add(svc, engine, "later", 5)
    prefill_only, held = timed_hold(svc)
    assert prefill_only and held < 0.05, f"held {held:.3f} s for a job 0.15 s after the last (gap 0.1 s)"
    add(svc, engine, "close behind", 5)  # within the gap of "later": jobs keep coming, so wait for more
    prefill_only, held = timed_hold(svc)
    assert prefill_only and 0.08 <= held < 0.5, f"held {held:.3f} s for a second job (quiet gap 0.1 s)"
    svc._begin_step(prefill_only)
    engine.step()  # a step that took in two jobs: a backlog, whose CPU worker may fall quiet longer than the gap
    time.sleep(0.15)
    add(svc, engine, "after a pause in the backlog", 5)
    prefill_only, held = timed_hold(svc)
    assert prefill_only and 0.08 <= held < 0.5, f"held {held:.3f} s for a job after a two-job step"
    add(svc, engine, "big", BUDGET)  # a full step's worth waits: step at once
    _, held = timed_hold(svc)
    assert held < 0.05, f"held {held:.3f} s with a full step waiting"


def test_a_step_with_sequences_decoding_is_never_held(service):
    svc, engine = service(hold_s=0.5, last_prefill_s=10.0)
    add(svc, engine, "long", 5, max_tokens=8)
    engine.step()  # prefilled: it decodes from now on
    add(svc, engine, "new", 3)
    prefill_only, held = timed_hold(svc)
    assert not prefill_only and held < 0.05, f"held {held:.3f} s while a sequence decodes"


def test_no_hold_before_the_first_prefill_step_or_when_turned_off(service):
    for hold_s, last in ((0.5, None), (0.0, 10.0)):
        svc, engine = service(hold_s=hold_s, last_prefill_s=last)
        add(svc, engine, "a", 3)
        prefill_only, held = timed_hold(svc)
        assert prefill_only and held < 0.05, (hold_s, last, held)


def test_the_first_job_of_a_batch_waits_for_the_rest_a_lone_one_with_a_busy_fleet_only_the_quiet_gap(
        redis, names, service):
    """The first job in a while is held when more of its model's jobs were accepted than the engine holds (a
    batch on its way through preprocess), at least two quiet gaps even after a quick step (one job's, before
    the batch); without followers it waits only the quiet gap."""
    svc, engine = service(hold_s=0.1, last_prefill_s=0.01)  # the last prefill step: one short job's
    store = JobStore(redis, names, result_ttl_s=60)
    batch = [f"b{i}" for i in range(random.randint(8, 12))]
    store.create([(job_id, {"model": MODEL, "state": "queued"}) for job_id in batch], max_queued=1000)
    stop = threading.Event()

    def preprocess() -> None:  # the rest of the batch reaches the engine one by one, 15-25 ms apart
        for job_id in batch[1:]:
            if stop.wait(random.uniform(0.015, 0.025)):
                return
            add(svc, engine, job_id, 4)

    add(svc, engine, batch[0], 4)
    t = threading.Thread(target=preprocess)
    t.start()
    try:
        prefill_only, held = timed_hold(svc)
        taken = svc._arrived_jobs
    finally:
        stop.set()
        t.join()
    assert prefill_only
    assert 0.15 <= held < 0.3, f"held {held:.3f} s: at least two quiet gaps (0.2 s) while jobs kept coming"
    assert taken >= 6, f"the step would take {taken} of the batch's {len(batch)} jobs"

    svc2, engine2 = new_service(redis, names, hold_s=0.1, last_prefill_s=0.01)
    add(svc2, engine2, "lone, while the batch is elsewhere", 4)  # the backlog holds more than this engine
    prefill_only, held = timed_hold(svc2)
    assert prefill_only and 0.08 <= held < 0.15, f"held {held:.3f} s: one quiet gap (0.1 s), nobody followed"
    for job_id in batch:
        store.finish(job_id, JobState.COMPLETED, result={"ok": 1})
    svc3, engine3 = new_service(redis, names, hold_s=0.1, last_prefill_s=0.01)
    add(svc3, engine3, "lone, nothing else accepted", 4)
    prefill_only, held = timed_hold(svc3)
    assert prefill_only and held < 0.05, f"held {held:.3f} s for a lone job with an empty backlog"
