"""Cache-aware placement through the real queue (always on): two GPU workers
pull from one model queue; a conversation's next turn runs on the worker whose prefix cache holds its history,
and when that worker is killed -9 mid-run every turn completes once on the other.

One module-scoped stack (real redis-server, two GPU worker processes, one CPU worker, the packaged model);
prefixes ``ppl:`` / ``ppl.``.  Prompts are token ids (random, never zeros), so a turn's history is exactly the
previous turn's prompt.  ``placement_steal_s`` is long (8 s) so that a job waits for the worker holding its
history on this busy 2-core machine rather than being stolen by timing accident; the kill test needs the
steal all the same (the dead worker's record counts as alive for half its TTL, 3 s).
"""

from __future__ import annotations

import random
import signal

import pytest
from engine_fixtures import engine, hf_greedy, sharegpt_prompts
from queue_helpers import DoneCounter, completed_once_on, wait_until

from pagedq.config import Settings
from pagedq.pipeline import Client
from pagedq.pipeline.local.stack import Stack
from pagedq.pipeline.status import render, snapshot
from pagedq.store.dispatch import FairDispatch

TIMEOUT = 300
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="ppl:", queue_prefix="ppl.", result_cache=False,
                    kv_cache_memory="256MiB", placement_steal_s=8.0,
                    max_num_seqs=8, worker_ttl_s=6, drain_timeout_s=1, send_grace_s=5)


@pytest.fixture(scope="module")
def stack(settings, tmp_path_factory):
    with Stack(settings, gpu_workers=2, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def gpu_workers(stack) -> list:
    return [c for c in stack.children if c.role == "gpu"]


def history() -> list[int]:
    return [random.randint(100, 30000) for _ in range(random.randint(100, 200))]


def next_turn(prompt: list[int]) -> list[int]:
    return prompt + [random.randint(100, 30000) for _ in range(random.randint(10, 30))]


def first_turns(client: Client, n: int) -> tuple[list[list[int]], list[str]]:
    """``n`` conversations' first turns, run to the end: (their prompts, the worker that ran each)."""
    prompts = [history() for _ in range(n)]
    jobs = [client.submit(prompt=p, max_tokens=2, **GREEDY) for p in prompts]
    for job in jobs:
        client.result(job, timeout=TIMEOUT)
    return prompts, [client.status(j).worker for j in jobs]


def test_a_conversations_next_turn_runs_where_its_history_is_cached(settings, stack, client):
    fair = FairDispatch(client.r, client.names)
    before = fair.placement_stats(settings.model)
    prompts, holders = first_turns(client, 8)
    turns = [client.submit(prompt=next_turn(p), max_tokens=2, **GREEDY) for p in prompts]
    results = [client.result(j, timeout=TIMEOUT) for j in turns]
    assert [client.status(j).worker for j in turns] == holders, "each next turn on the worker holding its history"
    for prompt, result in zip(prompts, results, strict=True):  # and the engine served the history from its cache
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(prompt) - 1) // 16 * 16
    after = fair.placement_stats(settings.model)
    assert after.get("by_cache", 0) - before.get("by_cache", 0) >= len(turns)
    snap = snapshot(client.r, client.names)  # what `pagedq status` shows
    assert snap.placement[settings.model]["by_cache"] == after["by_cache"]
    assert 0 < snap.placement[settings.model]["hit_ratio"] < 1
    assert "PLACEMENT" in render(snap)


def test_a_worker_that_finished_its_jobs_shows_its_seats_free_when_their_results_arrive(settings, stack, client):
    """The step that finishes a job publishes its seat as free (it is released just after): placement never
    sees a worker that just finished as full until its next idle publish, seconds later."""
    jobs = [client.submit(prompt=history(), max_tokens=random.randint(2, 6), **GREEDY) for _ in range(2)]
    for job in jobs:
        client.result(job, timeout=TIMEOUT)
    for host in {client.status(j).worker for j in jobs}:
        record = client.r.hgetall(client.names.worker(host))
        assert int(record["free_seats"]) == settings.max_num_seqs, record
        assert float(record["load_tokens"]) == 0, record


def test_a_session_stays_on_its_worker_when_its_prompt_changes(settings, stack, client):
    """``prompt_cache_key`` names a session: a next turn no worker holds any of (a new, summarised history) runs
    where the session's last turn ran."""
    fair = FairDispatch(client.r, client.names)
    before = fair.placement_stats(settings.model).get("by_session", 0)
    keys = [f"conversation-{random.randrange(10**9)}" for _ in range(6)]
    first = [client.submit(prompt=history(), max_tokens=2, prompt_cache_key=k, **GREEDY) for k in keys]
    for job in first:
        client.result(job, timeout=TIMEOUT)
    holders = [client.status(j).worker for j in first]
    turns = []
    for key in keys:  # one at a time: a burst would weigh the holder's load (each computes its whole prompt)
        turns.append(client.submit(prompt=history(), max_tokens=2, prompt_cache_key=key, **GREEDY))
        client.result(turns[-1], timeout=TIMEOUT)
    assert [client.status(j).worker for j in turns] == holders
    assert fair.placement_stats(settings.model).get("by_session", 0) - before >= len(turns)


def test_greedy_outputs_through_two_placed_workers_are_hugging_faces(settings, stack, client):
    """Placement changes where a turn runs, never what it says: first turns (ShareGPT prompts) and next turns
    (the prompt, Hugging Face's own continuation, more tokens: served from a placed worker's prefix cache) all
    equal transformers' greedy text."""
    tokenizer = engine().tokenizer
    fair = FairDispatch(client.r, client.names)
    before = fair.placement_stats(settings.model).get("by_cache", 0)
    tokens = 12
    prompts = [p for p in sharegpt_prompts() if len(p) > 40][:4]

    def same_as_hf(turn: list[list[int]]) -> list[list[int]]:
        jobs = [client.submit(prompt=p, max_tokens=tokens, **GREEDY) for p in turn]
        expected = [hf_greedy(p, tokens) for p in turn]
        got = [client.result(j, timeout=TIMEOUT)["choices"][0]["text"] for j in jobs]
        assert got == [tokenizer.decode(e, skip_special_tokens=True) for e in expected]
        return expected

    replies = same_as_hf(prompts)
    same_as_hf([p + r + [random.randint(100, 30000) for _ in range(8)] for p, r in zip(prompts, replies, strict=True)])
    assert fair.placement_stats(settings.model).get("by_cache", 0) - before >= len(prompts)


def test_kill_9_of_the_worker_holding_the_history_every_turn_completes_once_on_the_other(settings, stack, client):
    counter = DoneCounter(client.r, client.names)
    prompts, holders = first_turns(client, 6)
    victim = next(c for c in gpu_workers(stack) if c.hostname == holders[0])
    survivor = next(c for c in gpu_workers(stack) if c is not victim)
    tokens = 160
    turns = [client.submit(prompt=next_turn(p), max_tokens=tokens, **GREEDY) for p in prompts]
    on_victim = [j for j, h in zip(turns, holders, strict=True) if h == victim.hostname]
    wait_until(lambda: any(int(client.status(j).completion_tokens or 0) > 0 and client.status(j).worker ==
                           victim.hostname for j in on_victim), TIMEOUT, what="a turn running on its holder")
    running = [j for j in on_victim if not client.status(j).done]
    assert running, "turns were mid-generation at the kill"
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    stack.children.remove(victim)
    completed_once_on(survivor, client, counter, turns, running, tokens)
    assert client.r.zcard(client.names.active_jobs) == 0
    assert client.r.hlen(client.names.fair_index) == 0
