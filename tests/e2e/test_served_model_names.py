"""Served model names (vLLM's --served-model-name) through the real queue: two GPU workers serve the same weights
from two different folders under ``--served-model-name smollm2 --served-model-name default-chat``; a request
naming either name completes on both workers, through ``Client``, ``pagedq submit`` and the gateway, and the
result cache and placement treat the two names and the two folders as one model.

One module-scoped stack (real redis-server, one CPU worker, the gateway, two GPU worker processes, the packaged
model's converted folder linked file by file into two temporary folders); prefixes ``srv:`` / ``srv.``.  Only the
GPU workers are given the names: the CPU worker tokenizes from the folder a GPU worker registered on its host
(and, the last test, a CPU worker on a host without that folder, from its own PAGEDQ_MODEL copy).
Outputs are 2-4 tokens; prompts are random token ids (never zeros), so no two runs share a cached answer.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import httpx
import pytest
from queue_helpers import wait_until
from transformers import AutoTokenizer

from pagedq.config import DEFAULT_MODEL, Settings
from pagedq.config.names import Names
from pagedq.config.served import local_model
from pagedq.pipeline.cpu_worker import Tokenizers
from pagedq.pipeline.local.stack import Stack
from pagedq.store.model_names import register_served_names, registered_folder
from pagedq.store.registry import ModelInfo, live_workers, lookup_model, register_model
from pagedq.workers.model.loader import ModelNotFoundError, resolve_model
from pagedq.workers.processes import free_port

NAME, ALIAS = "smollm2", "default-chat"
SERVED = {"PAGEDQ_SERVED_MODEL_NAME": f"{NAME},{ALIAS}"}
TIMEOUT = 300
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="srv:", queue_prefix="srv.", kv_cache_memory="128MiB",
                    max_num_seqs=2, placement_steal_s=8.0, worker_ttl_s=6, drain_timeout_s=1, send_grace_s=5)


def linked_copy(source: os.PathLike, target: os.PathLike) -> str:
    """A folder of its own holding ``source``'s files (symbolic links: the same bytes, another path)."""
    os.makedirs(target)
    for name in os.listdir(source):
        os.symlink(os.path.join(source, name), os.path.join(target, name))
    return str(target)


@pytest.fixture(scope="module")
def stack(settings, tmp_path_factory):
    converted = resolve_model(DEFAULT_MODEL, settings.state_dir).path
    base = tmp_path_factory.mktemp("folders")
    folders = [linked_copy(converted, base / "host-a" / "smol"), linked_copy(converted, base / "host-b" / "models")]
    with Stack(settings, gpu_workers=0, cpu_workers=1, log_dir=tmp_path_factory.mktemp("logs")) as s:
        s.wait_ready(TIMEOUT, [s.add_worker("gpu", extra_env=SERVED, model=folder) for folder in folders])
        yield s


@pytest.fixture(scope="module")
def gateway(stack) -> str:
    """The base URL of `pagedq serve` (no API keys: it answers loopback connections only), stopped with the stack."""
    port = free_port()
    stack.add_gateway(port)
    return f"http://127.0.0.1:{port}"


def gpu_hosts(stack) -> set[str]:
    return {c.hostname for c in stack.children if c.role == "gpu"}


def random_prompt(n: int) -> list[int]:
    return [random.randint(100, 30000) for _ in range(n)]


def test_both_names_complete_on_both_workers_through_client_cli_and_gateway(settings, stack, client, gateway):
    assert set(client.served_models()) == {NAME, ALIAS}
    info = lookup_model(client.r, client.names, ALIAS)
    assert info is not None and info.name == NAME and info.queue == client.names.generate_queue(NAME)
    # one model: both workers registered under the first name, with the same weights' fingerprint
    records = [rec for host, rec in live_workers(client.r, client.names).items() if host in gpu_hosts(stack)]
    assert [r["model"] for r in records] == [NAME, NAME]
    assert {r["fingerprint"] for r in records} == {info.fingerprint}

    # Client: rounds of jobs alternating the two names until each name has run on both workers
    ran_on: dict[str, set[str]] = {NAME: set(), ALIAS: set()}
    for _ in range(4):
        jobs = [(name, client.submit(prompt=random_prompt(20), max_tokens=4, model=name, **GREEDY))
                for _ in range(4) for name in (NAME, ALIAS)]
        for name, job in jobs:
            result = client.result(job, timeout=TIMEOUT)
            assert result["model"] == NAME and result["usage"]["completion_tokens"] == 4
            status = client.status(job)
            assert status.model == NAME and not status.cached
            ran_on[name].add(status.worker)
        if all(hosts == gpu_hosts(stack) for hosts in ran_on.values()):
            break
    assert ran_on == {NAME: gpu_hosts(stack), ALIAS: gpu_hosts(stack)}

    # pagedq submit, each name
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}, "PAGEDQ_BROKER_URL": stack.url,
           "PAGEDQ_KEY_PREFIX": settings.key_prefix, "PAGEDQ_QUEUE_PREFIX": settings.queue_prefix}
    for name in (NAME, ALIAS):
        done = subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "submit", f"Say {random.random()}",
                               "--model", name, "--max-tokens", "2", "--wait"], env=env, capture_output=True,
                              text=True, timeout=TIMEOUT)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["model"] == NAME

    # the gateway: /v1/models lists both names; a chat completion by each
    with httpx.Client(base_url=gateway, timeout=TIMEOUT) as http:
        listed = http.get("/v1/models").json()["data"]
        assert sorted(m["id"] for m in listed) == sorted([NAME, ALIAS])
        assert http.get(f"/v1/models/{ALIAS}").json()["id"] == ALIAS
        for name in (NAME, ALIAS):
            resp = http.post("/v1/chat/completions", json={
                "model": name, "max_tokens": 2, "messages": [{"role": "user", "content": f"Hi {random.random()}"}]})
            assert resp.status_code == 200, resp.text
            assert resp.json()["model"] == NAME and resp.json()["usage"]["completion_tokens"] >= 1
        missing = http.post("/v1/chat/completions", json={"model": "smollm3", "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "hi"}]})
        assert missing.status_code == 404 and NAME in missing.json()["error"]["message"]


def test_the_result_cache_and_placement_treat_the_names_as_one_model(settings, stack, client):
    # the same greedy request, asked as one name then the other, is answered from the cache the second time
    prompt = random_prompt(30)
    first = client.submit(prompt=prompt, max_tokens=3, temperature=0, model=NAME)
    answer = client.result(first, timeout=TIMEOUT)
    request, version = client.r.hmget(client.names.job(first), "cache_request", "cache_version")
    fingerprint = lookup_model(client.r, client.names, ALIAS).fingerprint
    entry = client.cache.key(NAME, int(version), fingerprint, request)  # filed under the name, after the answer
    wait_until(lambda: client.r.exists(entry), 30, what="the cache entry")
    again = client.submit(prompt=prompt, max_tokens=3, temperature=0, model=ALIAS)
    cached = client.result(again, timeout=TIMEOUT)
    assert client.status(again).cached == 1 and cached["cached"] is True
    assert cached["choices"][0]["text"] == answer["choices"][0]["text"] and cached["model"] == NAME
    # invalidating by the alias is invalidating the model (`pagedq cache invalidate --model default-chat`)
    assert client.invalidate_cache(ALIAS) == client.cache.version(NAME) == int(version) + 1
    recomputed = client.submit(prompt=prompt, max_tokens=3, temperature=0, model=NAME)
    assert client.result(recomputed, timeout=TIMEOUT)["choices"][0]["text"] == answer["choices"][0]["text"]
    assert client.status(recomputed).cached == 0

    # placement: a conversation's next turn, asked by the alias, runs on the worker holding its history under
    # the name (the prompt's block names are the same whichever name and folder)
    before = client.r.hgetall(client.names.placement_stats(NAME))
    histories = [random_prompt(random.randint(100, 160)) for _ in range(4)]
    firsts = [client.submit(prompt=h, max_tokens=2, model=NAME, **GREEDY) for h in histories]
    for job in firsts:
        client.result(job, timeout=TIMEOUT)
    holders = [client.status(j).worker for j in firsts]
    turns, results = [], []
    for history in histories:  # one at a time: each placed on idle workers, where only the cache tells them apart
        turns.append(client.submit(prompt=history + random_prompt(12), max_tokens=2, model=ALIAS, **GREEDY))
        results.append(client.result(turns[-1], timeout=TIMEOUT))
    placed = client.r.hgetall(client.names.placement_stats(NAME))
    assert [client.status(j).worker for j in turns] == holders, f"placement decisions {before} -> {placed}"
    for history, result in zip(histories, results, strict=True):
        assert result["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(history) - 1) // 16 * 16
    after = client.r.hgetall(client.names.placement_stats(NAME))
    assert int(after.get("by_cache", 0)) > int(before.get("by_cache", 0))  # the fleet's stats are the name's
    assert client.r.smembers(client.names.placement_workers(NAME)) == gpu_hosts(stack)
    assert not client.r.exists(client.names.placement_stats(ALIAS))  # the alias has no fleet state of its own


def test_a_cpu_worker_on_a_host_without_the_registered_folder_tokenizes_from_its_own_copy(settings, redis,
                                                                                             tmp_path):
    """What run_cpu_worker gives its Tokenizers, on a host where neither registered folder exists: with the served
    names and PAGEDQ_MODEL set to a copy of its own, either name loads the model's tokenizer from that copy."""
    converted = resolve_model(DEFAULT_MODEL, settings.state_dir).path
    names = Names(key_prefix="srv-elsewhere:", queue_prefix="srv-elsewhere.")
    missing = str(tmp_path / "not-on-this-host")
    register_served_names(redis, names, NAME, [ALIAS], missing, host="gpu-host")
    register_model(redis, names, ModelInfo(NAME, "f" * 32, 2048, 49152, names.generate_queue(NAME), missing))
    here = Settings(model=linked_copy(converted, tmp_path / "elsewhere"), served_model_name=[NAME, ALIAS])
    tokenizers = Tokenizers(here.state_dir, lambda model: registered_folder(redis, names, model, host="cpu-host")
                            or local_model(here, model))
    text = f"Served names {random.random()}"
    expected = AutoTokenizer.from_pretrained(converted)(text)["input_ids"]
    assert tokenizers.get(ALIAS)(text)["input_ids"] == expected == tokenizers.get(NAME)(text)["input_ids"]
    # without the names, a name is no folder: a clear error naming it
    bare = Tokenizers(here.state_dir, lambda model: registered_folder(redis, names, model, host="cpu-host")
                      or local_model(Settings(), model))
    with pytest.raises(ModelNotFoundError, match=f"unknown model '{ALIAS}'"):
        bare.get(ALIAS)
