"""Tenants cannot see or slow each other (issue 48), through the real pipeline.

One stack (a small random Llama with SmolLM2's tokenizer, 2 layers; real redis-server, GPU and CPU worker
processes; prefixes ``ptn:`` / ``ptn.``) and one ``pagedq serve`` process with a keys file of four tenants,
two of them sharing a cache group:

- request paths never scan the keyspace: Redis's own ``INFO commandstats`` counts no ``SCAN`` / ``KEYS``
  around 1,000 completions, a 1,000-line batch naming an unknown model, and 100 ``/ready`` calls;
- caches are private: tenant B replaying tenant A's greedy prompt gets no ``cached`` answer and 0
  ``cached_tokens``, while A itself (and a tenant in A's cache group) hits both caches as before.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys

import httpx
import pytest
import torch
from queue_helpers import wait_until
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedq.config import Settings
from pagedq.pipeline import Client
from pagedq.pipeline.gateway.config import HANDOFF_VARIABLE, KEYS_FILE_VARIABLE
from pagedq.pipeline.gateway.keys import hash_key
from pagedq.pipeline.local.stack import settings_env
from pagedq.workers.processes import free_port, spawn, stop

TIMEOUT = 120
MAX_REQUEST_BYTES = 64 << 10
CHAT = "/v1/chat/completions"
TENANTS = {  # API key -> its keys-file entry
    "sk-a": {"tenant": "team-a"},
    "sk-b": {"tenant": "team-b"},
    "sk-c1": {"tenant": "team-c1", "cache_group": "team-c"},
    "sk-c2": {"tenant": "team-c2", "cache_group": "team-c"},
}
WORDS = "river stone lantern orchard copper meadow harbor violet thunder cedar quartz ember".split()


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
    return Settings(broker_url=redis_url, key_prefix="ptn:", queue_prefix="ptn.", model=str(model_dir),
                    kv_cache_memory="64MiB", progress_interval_s=0.5)


@pytest.fixture(scope="module")
def gateway(settings, stack, tmp_path_factory) -> str:
    """The base URL of a `pagedq serve` process with the TENANTS keys file."""
    folder = tmp_path_factory.mktemp("gateway")
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hash_key(k), **v} for k, v in TENANTS.items()]}))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in (KEYS_FILE_VARIABLE, HANDOFF_VARIABLE)}
    env = {**env, **settings_env(settings), "PAGEDQ_BROKER_URL": stack.url}
    log_path = folder / "gateway.log"
    proc = spawn([sys.executable, "-m", "pagedq.pipeline.cli", "serve", "--port", str(port),
                  "--api-keys-file", str(keys), "--max-request-bytes", str(MAX_REQUEST_BYTES)], log_path, env)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, f"the gateway exited with {proc.returncode}: {log_path.read_text()}"
        try:
            return httpx.get(f"{base}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        wait_until(healthy, 90, 0.2, "the gateway to answer /ready")
        yield base
    finally:
        stop(proc, 30)


def scans(client: Client) -> int:
    """SCAN and KEYS calls the server has run, by anyone (scripts' calls included)."""
    stats = client.r.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{cmd}", {}).get("calls", 0)) for cmd in ("scan", "keys"))


def phrase(n: int) -> str:
    return " ".join(random.choice(WORDS) for _ in range(n))


def chat(base: str, key: str, content: str, **fields) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 4, **fields}
    reply = httpx.post(base + CHAT, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    return reply.json()


def cached_tokens(result: dict) -> int:
    return result["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


# --- no scans on request paths ----------------------------------------------------------------------------
def test_request_paths_issue_no_scan(client, gateway):
    """1,000 completions (50 computed, 950 answered from the result cache; through the Client and HTTP), a
    1,000-line batch naming an unknown model, 100 /ready calls: not one SCAN or KEYS on the server."""
    prompts = [phrase(6) for _ in range(50)]
    before = scans(client)
    computed = [client.submit([{"role": "user", "content": p}], temperature=0, max_tokens=1) for p in prompts]
    assert all(client.result(j, timeout=TIMEOUT)["usage"]["completion_tokens"] == 1 for j in computed)
    hits = [client.submit([{"role": "user", "content": prompts[i % 50]}], temperature=0, max_tokens=1)
            for i in range(900)]
    assert all(client.result(j, timeout=TIMEOUT).get("cached") for j in hits[-10:])
    for _ in range(50):  # HTTP: team-a's own scope, computed once then hits
        chat(gateway, "sk-a", prompts[0], max_tokens=1)
    lines = [{"custom_id": f"l{i}", "url": CHAT, "body": {"model": "no-such-model", "max_tokens": 1,
                                                          "messages": [{"role": "user", "content": phrase(3)}]}}
             for i in range(1000)]
    batch = client.submit_batch(lines)
    status = client.wait_batch(batch, timeout=TIMEOUT)
    out = client.batch_results(batch)
    for _ in range(100):
        assert httpx.get(f"{gateway}/ready", timeout=10).status_code == 200
    after = scans(client)
    assert status.failed == 1000
    error = out[0]["error"]
    assert error["code"] == "model_not_found" and repr(client.settings.model) in error["message"]
    assert after == before, f"{after - before} SCAN/KEYS calls on request paths"
    assert client.served_models() == [client.settings.model]


# --- private caches ---------------------------------------------------------------------------------------
def test_another_tenant_replaying_a_greedy_prompt_sees_no_cache_of_it(gateway):
    """team-a's greedy prompt, replayed by team-b: the same answer, computed (not ``cached``, 0
    ``cached_tokens``); team-a itself hits the result cache, and the prefix cache with the result cache off."""
    prompt = f"Continue this list of words: {phrase(60)}"  # several full blocks
    first = chat(gateway, "sk-a", prompt)
    assert not first.get("cached")
    own = wait_until(lambda: (r := chat(gateway, "sk-a", prompt)).get("cached") and r, 30, 0.2,
                     "team-a's answer from the result cache")
    assert own["choices"] == first["choices"]
    own_blocks = chat(gateway, "sk-a", prompt, use_result_cache=False)
    assert not own_blocks.get("cached") and cached_tokens(own_blocks) > 0, "team-a's prompt blocks are reused"
    other = chat(gateway, "sk-b", prompt)  # team-b's first request: nothing of its own is cached
    assert not other.get("cached") and cached_tokens(other) == 0, "team-b saw team-a's caches"
    assert other["choices"][0]["message"] == first["choices"][0]["message"]
    salted = chat(gateway, "sk-a", prompt, cache_salt="another conversation")
    assert not salted.get("cached") and cached_tokens(salted) == 0, "a request's own salt is its own scope"
    assert httpx.post(gateway + CHAT, headers={"Authorization": "Bearer sk-a"}, timeout=TIMEOUT, json={
        "messages": [{"role": "user", "content": "hi"}], "cache_salt": ""}).json()["error"]["param"] == "cache_salt"


def test_tenants_of_one_cache_group_share_their_caches(gateway):
    prompt = f"Continue this list of words: {phrase(60)}"
    first = chat(gateway, "sk-c1", prompt)
    shared = wait_until(lambda: (r := chat(gateway, "sk-c2", prompt)).get("cached") and r, 30, 0.2,
                        "team-c1's answer in team-c2's result cache")
    assert shared["choices"] == first["choices"]
    blocks = chat(gateway, "sk-c2", prompt, use_result_cache=False)
    assert cached_tokens(blocks) > 0
    outsider = chat(gateway, "sk-a", prompt)  # its own scope holds the chat template's first block at most
    assert not outsider.get("cached") and cached_tokens(outsider) < cached_tokens(blocks)


# --- bounded cost per request -----------------------------------------------------------------------------
def test_costly_requests_get_a_400_naming_the_field(gateway):
    headers = {"Authorization": "Bearer sk-a"}

    def refused(body: dict) -> str:
        reply = httpx.post(gateway + CHAT, json=body, headers=headers, timeout=TIMEOUT)
        assert reply.status_code == 400, reply.text
        return reply.json()["error"]["param"]
    base = {"messages": [{"role": "user", "content": phrase(3)}]}
    assert refused({**base, "stop_token_ids": random.sample(range(1, 49152), 65)}) == "stop_token_ids"
    assert refused({**base, "stop_token_ids": [49152 + random.randrange(1000)]}) == "stop_token_ids"
    assert refused({**base, "logit_bias": {str(t): 1 for t in random.sample(range(49152), 301)}}) == "logit_bias"
    assert refused({**base, "n": 128, "max_tokens": 1000, "logprobs": True, "top_logprobs": 20}) == "max_tokens"
    small = json.dumps({"custom_id": "ok", "url": CHAT, "body": {**base, "max_tokens": 1}})
    big = json.dumps({"custom_id": "big", "url": CHAT, "body": {"messages": [
        {"role": "user", "content": phrase(MAX_REQUEST_BYTES // 5)}]}})
    upload = httpx.post(f"{gateway}/v1/files", headers=headers, timeout=TIMEOUT, data={"purpose": "batch"},
                        files={"file": ("in.jsonl", f"{small}\n{big}\n".encode())})
    assert upload.status_code == 200, upload.text
    reply = httpx.post(f"{gateway}/v1/batches", headers=headers, timeout=TIMEOUT, json={
        "input_file_id": upload.json()["id"], "endpoint": CHAT, "completion_window": "24h"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input_file_id"
    assert "line 2" in reply.json()["error"]["message"]


def test_a_batch_naming_a_model_nobody_serves_is_refused_whole_before_any_job(gateway, client):
    headers = {"Authorization": "Bearer sk-a"}
    unknown = f"no-such-model-{random.randrange(10**6)}"
    lines = [{"custom_id": f"l{i}", "url": CHAT, "body": {"messages": [{"role": "user", "content": phrase(3)}],
                                                          "max_tokens": 1, **({"model": unknown} if i >= 2 else {})}}
             for i in range(5000)]
    upload = httpx.post(f"{gateway}/v1/files", headers=headers, timeout=TIMEOUT, data={"purpose": "batch"},
                        files={"file": ("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode())})
    assert upload.status_code == 200, upload.text
    batches = httpx.get(f"{gateway}/v1/batches", headers=headers, timeout=TIMEOUT).json()["data"]
    jobs = client.r.zcard(client.names.active_jobs)
    reply = httpx.post(f"{gateway}/v1/batches", headers=headers, timeout=TIMEOUT, json={
        "input_file_id": upload.json()["id"], "endpoint": CHAT, "completion_window": "24h"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "input_file_id" and error["code"] == "model_not_found"
    assert "line 3 " in error["message"] and repr(unknown) in error["message"]
    assert httpx.get(f"{gateway}/v1/batches", headers=headers, timeout=TIMEOUT).json()["data"] == batches
    assert client.r.zcard(client.names.active_jobs) == jobs  # not one job written


def test_uploads_at_once_are_bounded_per_tenant_and_per_gateway_process(gateway):
    """Uploads still sending their bodies hold their places: a tenant's upload beyond MAX_TENANT_UPLOADS is a
    429 naming ``file``; any upload beyond MAX_CONCURRENT_UPLOADS is a 503 with Retry-After, both before the
    body is read; once they end, uploads are taken again."""
    from pagedq.pipeline.gateway.state import MAX_CONCURRENT_UPLOADS, MAX_TENANT_UPLOADS

    keys = list(TENANTS)
    holders = [keys[i // MAX_TENANT_UPLOADS] for i in range(MAX_CONCURRENT_UPLOADS)]  # fill every place
    newcomer = keys[len(set(holders))]  # holds no place
    line = json.dumps({"custom_id": "x", "url": CHAT, "body": {"messages": [{"role": "user", "content": "hi"}]}})
    form = (b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b\r\nContent-Disposition: '
            b'form-data; name="file"; filename="in.jsonl"\r\n\r\n' + line.encode() + b"\n\r\n--b--\r\n")

    def headers(key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}", "Content-Type": "multipart/form-data; boundary=b"}

    async def main() -> tuple[list[int], httpx.Response, httpx.Response, httpx.Response]:
        go = asyncio.Event()

        async def slow_body():
            yield form[:50]
            await go.wait()
            yield form[50:]
        async with httpx.AsyncClient(base_url=gateway, timeout=TIMEOUT) as http:
            held = [asyncio.create_task(http.post("/v1/files", headers=headers(k), content=slow_body()))
                    for k in holders]
            await asyncio.sleep(1.0)  # every held upload has taken its place
            tenant_over = await http.post("/v1/files", headers=headers(holders[0]), content=form)
            process_over = await http.post("/v1/files", headers=headers(newcomer), content=form)
            go.set()
            codes = [r.status_code for r in await asyncio.gather(*held)]
            after = await http.post("/v1/files", headers=headers(holders[0]), content=form)
            return codes, tenant_over, process_over, after
    codes, tenant_over, process_over, after = asyncio.run(main())
    assert codes == [200] * MAX_CONCURRENT_UPLOADS
    assert tenant_over.status_code == 429 and tenant_over.json()["error"]["param"] == "file", tenant_over.text
    assert process_over.status_code == 503 and process_over.headers.get("retry-after"), process_over.text
    assert after.status_code == 200
