"""The result cache through the real pipeline: hits skip the GPU worker; new weights or invalidation recompute.

A small random Llama model (SmolLM2's tokenizer, 2 layers) keeps loads and reloads
fast; it is served from a folder the test can rewrite.  Real redis-server, real
worker processes; prefixes ``prc:`` / ``prc.``.  The control tests that need a
running worker (a cancel that lands without its message, a replayed reload) use
this module's stack too (the rest are in test_control.py).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest
import torch
from queue_helpers import wait_until
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedq.config import Settings
from pagedq.config.names import Names
from pagedq.pipeline import Client
from pagedq.pipeline.local.stack import settings_env
from pagedq.store import control
from pagedq.store.registry import ModelInfo, lookup_model, register_model
from pagedq.store.result_cache import ResultCache, request_digest

TIMEOUT = 120
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from engine_fixtures import engine

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    engine().tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def settings(redis_url, model_dir) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="prc:", queue_prefix="prc.", model=str(model_dir),
                    kv_cache_memory="64MiB", progress_interval_s=0.5)


@pytest.fixture(scope="module")
def cli_env(settings, stack) -> dict[str, str]:
    return {**os.environ, **settings_env(settings), "PAGEDQ_BROKER_URL": stack.url}


def worker_stats(client: Client) -> dict[str, str]:
    workers = [k for k in client.r.scan_iter(match=client.names.worker_pattern)]
    gpu = [client.r.hgetall(k) for k in workers if client.r.hget(k, "role") == "gpu"]
    assert len(gpu) == 1
    return gpu[0]


def jobs_received(client: Client) -> int:
    return int(worker_stats(client).get("jobs_received", 0))


def ask(client: Client, question: str, **fields) -> dict:
    job = client.submit([{"role": "user", "content": question}], **{**GREEDY, **fields})
    return client.result(job, timeout=TIMEOUT) | {"job": job}


def stored(client: Client, job: str) -> None:
    """The result consumer stores a cache entry right after publishing; wait for it."""
    key = client.r.hget(client.names.job(job), "cache_key")
    assert key, "a deterministic request of a served model gets a cache key"
    deadline = time.monotonic() + 10
    while not client.r.exists(key):
        assert time.monotonic() < deadline, "the cache entry was never written"
        time.sleep(0.01)


def text(result: dict) -> str:
    return result["choices"][0]["message"]["content"]


def test_repeated_deterministic_requests_are_answered_from_redis(client):
    for fields in ({"temperature": 0}, {"temperature": 0.9, "seed": 7}):
        first = ask(client, f"Tell me about queues {fields}", **fields)
        assert not first.get("cached")
        stored(client, first["job"])
        received = jobs_received(client)

        start = time.perf_counter()
        job = client.submit([{"role": "user", "content": f"Tell me about queues {fields}"}], **{**GREEDY, **fields})
        again = client.result(job, timeout=TIMEOUT)
        elapsed_ms = (time.perf_counter() - start) * 1000
        print(f"{fields}: cached result {elapsed_ms:.2f} ms after submit")
        assert again["cached"] is True and again["id"].endswith(job) and again["id"] != first["id"]
        assert text(again) == text(first) and again["usage"] == first["usage"]
        status = client.status(job)
        assert status.state == "completed" and status.cached == 1 and status.completed_at is not None
        time.sleep(0.5)
        assert jobs_received(client) == received, "no generate task reached the GPU worker"


def test_requests_that_are_not_cached(client):
    sampled = ask(client, "Name a colour.", temperature=0.9)  # no seed: not deterministic
    assert not client.r.hget(client.names.job(sampled["job"]), "cache_key")
    first = ask(client, "Name a fruit.")
    stored(client, first["job"])
    received = jobs_received(client)
    opted_out = ask(client, "Name a fruit.", use_result_cache=False)
    assert not opted_out.get("cached") and text(opted_out) == text(first)
    assert jobs_received(client) == received + 1
    other_params = ask(client, "Name a fruit.", max_tokens=5)  # every sampling field is part of the key
    assert not other_params.get("cached")


def test_invalidate_makes_the_same_request_recompute(client, settings, cli_env):
    first = ask(client, "What is Redis?")
    stored(client, first["job"])
    assert ask(client, "What is Redis?")["cached"]
    proc = subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "cache", "invalidate",
                           "--model", settings.model], capture_output=True, text=True, env=cli_env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    received = jobs_received(client)
    recomputed = ask(client, "What is Redis?")
    assert not recomputed.get("cached") and text(recomputed) == text(first)
    assert jobs_received(client) == received + 1
    stored(client, recomputed["job"])
    assert ask(client, "What is Redis?")["cached"], "the new version caches again"


def test_new_weights_recompute_and_drop_the_prefix_cache(client, settings, model_dir, cli_env):
    question = "Describe a priority queue in detail, please."
    before = ask(client, question)
    stored(client, before["job"])
    warm = ask(client, question, use_result_cache=False)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "the prefix cache served the prompt"
    old_fingerprint = worker_stats(client)["fingerprint"]

    weights_file = model_dir / "model.safetensors"
    weights = load_file(weights_file)
    weights["model.norm.weight"] = weights["model.norm.weight"] * torch.linspace(0.5, 1.5, 64)
    save_file(weights, weights_file, metadata={"format": "pt"})
    proc = subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "reload", "--model", settings.model],
                          capture_output=True, text=True, env=cli_env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert worker_stats(client)["fingerprint"] != old_fingerprint

    received = jobs_received(client)
    after = ask(client, question)
    assert not after.get("cached"), "an entry made with other weights is unreachable"
    assert jobs_received(client) == received + 1
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, "the prefix cache was dropped"
    assert ask(client, question, use_result_cache=False)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_cache_stays_within_its_bound_and_never_touches_queue_data(redis):
    names = Names("pqb:", "pqb.")
    queue_lists = names.broker_lists(names.generate_queue("m"))[:3]
    for i, key in enumerate(queue_lists):
        redis.rpush(key, *[json.dumps({"job": f"{i}-{n}", "pad": "x" * 500}) for n in range(20)])
    for n in range(20):
        redis.hset(names.job(f"job{n}"), mapping={"state": "queued", "priority": 5})
    bound = 50_000
    cache = ResultCache(redis, names, ttl_s=3600, max_bytes=bound)
    keys = [cache.key("m", 0, "fp", request_digest("/v1/completions", {"prompt": f"p{i}"})) for i in range(60)]
    for key in keys:
        assert cache.put(key, {"choices": [{"text": "y" * 2000}]})
    live = [k for k in keys if redis.exists(k)]
    assert cache.total_bytes() <= bound
    assert sum(redis.strlen(k) for k in live) == cache.total_bytes()
    assert len(live) < len(keys) and live == keys[-len(live):], "the oldest entries were evicted"
    assert cache.get(keys[-1]) is not None
    assert [redis.llen(k) for k in queue_lists] == [20, 20, 20]
    assert all(redis.hget(names.job(f"job{n}"), "state") == "queued" for n in range(20))
    assert not cache.put(cache.key("m", 0, "fp", request_digest("/v1/completions", {"prompt": "huge"})),
                         {"t": "z" * (bound + 1)})
    assert redis.info("memory")["maxmemory_policy"] == "noeviction"  # CONFIG is disabled: INFO tells


# --- answers filed under the weights that produced them --------------------------------------------------------
def words(n: int = 4) -> str:
    return " ".join(random.choice(["queue", "lease", "token", "model", "cache", "redis", "batch", "stream"])
                    for _ in range(n)) + f" {random.randrange(10**6)}"


def entry_key(client: Client, job: str, fingerprint: str) -> str:
    """The cache entry of a job's request under ``fingerprint`` (what the producer recorded at submit)."""
    request, version = client.r.hmget(client.names.job(job), "cache_request", "cache_version")
    assert request, "a deterministic request records its digest"
    return client.cache.key(client.settings.model, int(version), fingerprint, request)


def test_an_answer_from_old_weights_is_never_served_under_new_ones(client, settings):
    """A rolling reload: another worker of the model has reloaded and registered weights B while this one still
    serves A.  A's answers are not filed where requests for B look, so none is served as B's."""
    question = f"Rolling reload: {words()}"
    before = ask(client, question)
    served = lookup_model(client.r, client.names, settings.model)
    assert entry_key(client, before["job"], served.fingerprint) == client.r.hget(
        client.names.job(before["job"]), "cache_key"), "lookup and insert compute the same key"
    stored(client, before["job"])
    reloaded = f"{random.getrandbits(128):032x}"  # weights B, registered by the other worker
    register_model(client.r, client.names, ModelInfo(**{**served.__dict__, "fingerprint": reloaded}))
    try:
        received = jobs_received(client)
        during = ask(client, question)  # looked up under B: computed by this worker, with A
        assert not during.get("cached") and text(during) == text(before)
        again = ask(client, question)
        assert not again.get("cached"), "A's answer was filed under B's key and served as B's"
        assert jobs_received(client) == received + 2
        assert not client.r.exists(entry_key(client, during["job"], reloaded))
    finally:
        register_model(client.r, client.names, served)  # the other worker gone: A is served again
    assert ask(client, question)["cached"], "back on A, A's entry serves again"


def test_a_request_sent_before_any_worker_registered_is_cached(client, settings):
    """No model record at submit (a deployment starting): the answer is still filed, under the fingerprint of
    the worker that produced it, and the same request is answered from the cache the second time."""
    served = lookup_model(client.r, client.names, settings.model)
    client.r.delete(client.names.model(settings.model))  # as before any GPU worker registered it
    question = f"Before the workers: {words()}"
    try:
        job = client.submit([{"role": "user", "content": question}], **GREEDY)
        assert client.r.hget(client.names.job(job), "cache_key") is None, "nothing to look up under yet"
    finally:  # the worker registers the model (a reload re-registers it, as a start does)
        client.control.publish("reload", model=settings.model)
    first = client.result(job, timeout=TIMEOUT)
    assert not first.get("cached")
    fingerprint = lookup_model(client.r, client.names, settings.model).fingerprint
    assert fingerprint == served.fingerprint
    wait_until(lambda: client.r.exists(entry_key(client, job, fingerprint)), 10, what="the cache entry")
    received = jobs_received(client)
    second = ask(client, question)
    assert second["cached"] is True and text(second) == text(first)
    assert jobs_received(client) == received


# --- control messages to a running worker ------------------------------------------------------------------------
def listener_connections(client: Client) -> list[dict]:
    """The GPU worker's control listener: the one connection subscribed to a channel (Celery's use patterns)."""
    return [c for c in client.r.client_list(_type="pubsub") if c.get("sub") == "1" and c.get("psub") == "0"]


def test_a_cancel_lands_while_the_control_listener_is_disconnected(client, settings):
    info = lookup_model(client.r, client.names, settings.model)
    job = client.submit([{"role": "user", "content": words()}], temperature=0, ignore_eos=True,
                        max_tokens=info.max_model_len - 64, use_result_cache=False)
    wait_until(lambda: client.status(job).state == "in_progress", TIMEOUT, what="the job running")
    [listener] = listener_connections(client)
    client.r.execute_command("CLIENT", "KILL", "ID", listener["id"])
    # Client.cancel marks the record, then publishes: the message is what a reconnecting listener misses.
    assert client.store.request_cancel(job) == "in_progress"
    marked = time.monotonic()
    status = client.wait(job, timeout=15)  # re-checked every progress_interval_s (0.5 s here)
    assert status.state == "cancelled", status
    print(f"cancelled {time.monotonic() - marked:.2f} s after its record was marked, with no message heard")
    assert int(client.r.hget(client.names.job(job), "completion_tokens")) < info.max_model_len - 64
    wait_until(lambda: len(listener_connections(client)) == 1, 30, what="the listener back")


def test_a_replayed_control_message_changes_nothing(client, settings):
    def registered_at() -> float:
        return lookup_model(client.r, client.names, settings.model).updated_at

    def ignored() -> int:
        return int(worker_stats(client).get("control_ignored", 0))

    before, ignored_before = registered_at(), ignored()
    raw = control.sign(client.control.secret, "reload", model=settings.model)
    client.r.publish(client.names.control_channel, raw)
    wait_until(lambda: registered_at() > before, TIMEOUT, what="the reload")
    once = registered_at()
    client.r.publish(client.names.control_channel, raw)  # the same signed bytes, within their freshness window
    client.control.publish("reload", model=settings.model)  # a new message: heard after the replay
    wait_until(lambda: registered_at() > once, TIMEOUT, what="the second reload")
    assert ignored() == ignored_before + 1, "the replay was acted on"
    seen = client.names.control_seen(json.loads(raw)["nonce"])
    [gpu] = [k for k in client.r.scan_iter(match=client.names.worker_pattern) if client.r.hget(k, "role") == "gpu"]
    assert client.r.smembers(seen) == {gpu[len(client.names.worker("")):]}
    assert 0 < client.r.ttl(seen) <= control.SEEN_TTL_S


def test_an_answer_is_filed_only_under_the_weights_served_now(redis):
    names = Names(f"pqf{random.getrandbits(32):x}:", "pqf.")
    cache = ResultCache(redis, names, ttl_s=3600, max_bytes=1 << 20)
    old, new = (f"{random.getrandbits(128):032x}" for _ in range(2))
    info = ModelInfo(name="m", fingerprint=new, max_model_len=2048, vocab_size=100, queue="q")
    register_model(redis, names, info)
    request = request_digest("/v1/completions", {"prompt": words(), "temperature": 0})
    answer = {"choices": [{"text": words()}]}
    assert not cache.put_answer("m", 0, old, request, answer), "an old worker's answer, after the reload"
    assert not cache.put_answer("m", 0, "", request, answer), "weights changed while it ran"
    assert not redis.exists(cache.key("m", 0, old, request)) and not redis.exists(cache.key("m", 0, new, request))
    assert cache.put_answer("m", 0, new, request, answer)
    assert cache.get(cache.key("m", 0, new, request)) == answer and cache.total_bytes() > 0
    redis.delete(names.model("m"))  # no worker serves it any more
    other = request_digest("/v1/completions", {"prompt": words(), "temperature": 0})
    assert not cache.put_answer("m", 0, new, other, answer)
