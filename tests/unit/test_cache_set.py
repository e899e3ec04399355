"""A GPU worker's prefix-cache set in Redis (``names.kv_blocks``, what placement reads), against a real
redis-server and the real engine core (no model): it lives as long as the worker's record even through a step
longer than the TTL, it is the pool's blocks exactly after a whole rewrite, and a claim reading it meanwhile never
finds it empty."""

from __future__ import annotations

import random
import threading
import time
import uuid
from types import SimpleNamespace

import pytest
from test_metrics_parts import ScriptedExecutor

from pagedq.config.names import Names
from pagedq.config.sampling_params import SamplingParams
from pagedq.store.registry import Heartbeat
from pagedq.workers.engine import EngineConfig, LLMEngine
from pagedq.workers.service import EngineService

TTL_S = 2


@pytest.fixture
def names() -> Names:
    tag = uuid.uuid4().hex[:8]
    return Names(key_prefix=f"cs{tag}:", queue_prefix=f"cs{tag}.")


def publisher(redis, names: Names, num_blocks: int = 256) -> tuple[EngineService, LLMEngine]:
    config = EngineConfig(model_name="scripted", fingerprint="f", max_model_len=8192, vocab_size=1000,
                          eos_token_ids=frozenset({1001}), block_size=4, max_num_batched_tokens=8192)
    engine = LLMEngine(config, ScriptedExecutor(num_blocks))
    svc = EngineService(lambda: None, client=redis, names=names, hostname=f"w-{uuid.uuid4().hex[:6]}",
                        worker_ttl_s=TTL_S, publish_cache=True)
    svc.engine = SimpleNamespace(block_manager=engine.block_manager, model_name="scripted")
    return svc, engine


def run(engine: LLMEngine, prompts: int, tokens: int) -> None:
    """``prompts`` random prompts of ``tokens`` tokens run to the end (their blocks stay in the prefix cache)."""
    for _ in range(prompts):
        engine.add_request(uuid.uuid4().hex, [random.randint(2, 999) for _ in range(tokens)],
                           SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def publish(svc: EngineService, redis) -> None:
    pipe = redis.pipeline(transaction=False)
    svc._publish_cache(pipe)
    pipe.execute()


def pool_names(engine: LLMEngine) -> set[str]:
    return {h.hex() for h in engine.block_manager.cached}


def test_the_heartbeat_keeps_the_cache_set_alive_as_long_as_the_record(redis, names):
    """A step longer than the TTL publishes nothing; the record's heartbeat (another thread) keeps the set alive
    with it.  A key it does not name expires; a named key that does not exist is not made."""
    kv, other, absent = names.kv_blocks("m", "w"), names.kv_blocks("m", "other"), names.kv_blocks("m", "absent")
    for key in (kv, other):
        redis.sadd(key, uuid.uuid4().hex)
        redis.expire(key, TTL_S)
    heartbeat = Heartbeat(redis, names.worker("w"), {"role": "gpu"}, ttl_s=TTL_S, also=[kv, absent])
    for _ in range(3):  # 3.6 s: past the TTL of anything not refreshed
        time.sleep(TTL_S * 0.6)
        heartbeat.beat()
    assert redis.scard(kv) == 1 and 0 < redis.ttl(kv) <= TTL_S
    assert not redis.exists(other), "a key the heartbeat does not name expires"
    assert not redis.exists(absent)


def test_a_whole_rewrite_leaves_exactly_the_pools_blocks_and_then_changes_follow(redis, names):
    svc, engine = publisher(redis, names)
    run(engine, 3, random.randint(20, 40))
    publish(svc, redis)  # the first publish: the whole set
    key = names.kv_blocks("scripted", svc.hostname)
    assert redis.smembers(key) == pool_names(engine) and len(pool_names(engine)) >= 15
    redis.sadd(key, "stale")  # e.g. left by a Redis that came back from an old snapshot
    svc.publish_failed()  # the next publish writes the set whole
    publish(svc, redis)
    assert redis.smembers(key) == pool_names(engine), "rewritten whole: the stale name gone"
    assert not redis.exists(names.kv_blocks_staging("scripted", svc.hostname))
    assert 0 < redis.ttl(key) <= TTL_S
    before = pool_names(engine)
    run(engine, 2, random.randint(20, 40))
    publish(svc, redis)  # changes only
    assert redis.smembers(key) == pool_names(engine) and pool_names(engine) > before


def test_a_reader_never_finds_the_set_empty_while_it_is_rewritten_whole(redis, names):
    """The rewrite is one rename: a claim in between (another connection) sees the old set or the new one,
    not a deleted one.  A set of thousands of names is a pipeline Redis reads in several pieces."""
    svc, engine = publisher(redis, names, num_blocks=4096)
    run(engine, 8, random.randint(1500, 1900))
    assert len(pool_names(engine)) > 2500
    publish(svc, redis)
    key, emptied, stop = names.kv_blocks("scripted", svc.hostname), [], threading.Event()
    pool = type(redis.connection_pool)(**redis.connection_pool.connection_kwargs)

    def read() -> None:  # on a connection of its own, as a claim is
        r = type(redis)(connection_pool=pool)
        while not stop.is_set():
            if r.scard(key) == 0:
                emptied.append(time.monotonic())

    t = threading.Thread(target=read)
    t.start()
    try:
        for _ in range(40):
            svc.publish_failed()
            publish(svc, redis)
    finally:
        stop.set()
        t.join()
    assert not emptied, f"the set was empty {len(emptied)} time(s) during whole rewrites"
    assert redis.smembers(key) == pool_names(engine)
