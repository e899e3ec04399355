"""The HTTP gateway end to end, driven by the official ``openai`` package.

A real uvicorn process (``pagedq serve --workers 2``, with an API keys file)
in front of the module's real redis-server, GPU worker and CPU worker
(prefixes ``pgw:`` / ``pgw.``).  Greedy results over HTTP are compared with
the Python ``Client``'s for the same requests.  The GPU worker runs at most 2
sequences at once, so a batch of 10 lines is still running when it is
cancelled.

The last tests run schemathesis against the app's OpenAPI schema, in process,
on its own prefixes with a registered (but absent) worker: nothing is ever
served, so the requests that wait for a worker carry a short ``timeout_s``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import queue_helpers
import schemathesis
from hypothesis import HealthCheck, given, strategies
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from pagedq.config import Settings
from pagedq.config.names import Names
from pagedq.pipeline.client import Client
from pagedq.pipeline.gateway.app import create_app
from pagedq.pipeline.gateway.config import HANDOFF_VARIABLE, KEYS_FILE_VARIABLE, GatewayConfig
from pagedq.pipeline.gateway.keys import hash_key
from pagedq.pipeline.local.stack import settings_env
from pagedq.store.connection import redis_client
from pagedq.store.registry import Heartbeat, ModelInfo, register_model
from pagedq.workers.processes import free_port, spawn, stop

TIMEOUT = 120
CHAT = "/v1/chat/completions"
MAX_REQUEST_BYTES = 64 << 10
TENANTS = {  # API key -> its keys-file entry
    "sk-alpha": {"tenant": "alpha"},
    "sk-beta": {"tenant": "beta"},
    "sk-small": {"tenant": "small", "max_priority": 3, "max_queued": 2},
    "sk-slow": {"tenant": "slow", "rpm": 3},
}


def wait_until(predicate, timeout: float = TIMEOUT, interval: float = 0.05, what: str = "condition"):
    return queue_helpers.wait_until(predicate, timeout, interval, what)


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    # result_cache off: requests are repeated through HTTP and the Client, and each must reach the engine
    return Settings(broker_url=redis_url, key_prefix="pgw:", queue_prefix="pgw.", result_cache=False,
                    max_num_seqs=2, kv_cache_memory="256MiB", progress_interval_s=0.5)


def start_gateway(args: list[str], env: dict[str, str], log_path) -> subprocess.Popen:
    return spawn([sys.executable, "-m", "pagedq.pipeline.cli", "serve", *args], log_path, env)


def gateway_env(settings: Settings, url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (KEYS_FILE_VARIABLE, HANDOFF_VARIABLE)}
    return {**env, **settings_env(settings), "PAGEDQ_BROKER_URL": url}


def wait_healthy(base: str, proc: subprocess.Popen, log_path) -> None:
    def healthy() -> bool:
        assert proc.poll() is None, f"the gateway exited with {proc.returncode}: {log_path.read_text()}"
        try:
            return httpx.get(f"{base}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    wait_until(healthy, 60, 0.2, "the gateway to answer /health")


@pytest.fixture(scope="module")
def gateway(settings, stack, tmp_path_factory) -> str:
    """The base URL of a `pagedq serve` process (2 uvicorn workers) with the TENANTS keys file."""
    folder = tmp_path_factory.mktemp("gateway")
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hash_key(k), **v} for k, v in TENANTS.items()]}))
    port = free_port()
    args = ["--port", str(port), "--workers", "2", "--api-keys-file", str(keys), "--max-request-bytes",
            str(MAX_REQUEST_BYTES)]
    proc = start_gateway(args, gateway_env(settings, stack.url), folder / "gateway.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, folder / "gateway.log")
        yield base
    finally:
        stop(proc, 30)


def sdk(base: str, key: str = "sk-alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


def auth(key: str = "sk-alpha") -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def text_of(result: dict) -> str:
    choice = result["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def sse_data(text: str) -> list:
    """The data of each Server-Sent Event, JSON-decoded except ``[DONE]``."""
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def job_state(client: Client, job_id: str) -> str:
    return client.status(job_id).state


# --- chat and text completions -----------------------------------------------------------------------------
def offline_results(settings: Settings, bodies: list[tuple[str, dict]], tmp_path) -> list[dict]:
    """The response bodies ``pagedq run-batch --offline`` gives for (url, body) requests, in order."""
    lines = [json.dumps({"custom_id": str(i), "url": url, "body": body}) for i, (url, body) in enumerate(bodies)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    env = {**os.environ, **settings_env(settings), "OMP_WAIT_POLICY": "PASSIVE"}
    subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "run-batch", "--offline", "-i",
                    str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")], env=env, check=True, timeout=600)
    return [json.loads(ln)["response"]["body"] for ln in (tmp_path / "out.jsonl").read_text().splitlines()]


def test_chat_and_text_completions_match_the_client(gateway, client, settings, tmp_path):
    api = sdk(gateway)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = api.chat.completions.create(model=settings.model, messages=messages, max_tokens=12, temperature=0)
    ref = client.result(client.submit(messages, max_tokens=12, temperature=0), timeout=TIMEOUT)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-") and chat.model == settings.model
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == text_of(ref)
    assert chat.choices[0].finish_reason == ref["choices"][0]["finish_reason"]
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (ref["usage"]["prompt_tokens"],
                                                                        ref["usage"]["completion_tokens"])

    extras = {"top_k": 1, "min_p": 0.0, "repetition_penalty": 1.0, "ignore_eos": True, "priority": 9}
    text = api.completions.create(model=settings.model, prompt="The capital of France is", max_tokens=12,
                                  temperature=0, extra_body=extras)
    ref = client.result(client.submit(prompt="The capital of France is", max_tokens=12, temperature=0, **extras),
                        timeout=TIMEOUT)
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    assert text.choices[0].text == text_of(ref) and text.usage.completion_tokens == 12  # ignore_eos honoured

    job = httpx.get(f"{gateway}/v1/jobs/{text.id.removeprefix('cmpl-')}", headers=auth()).json()
    assert (job["state"], job["priority"], job["kind"], job["completion_tokens"]) == ("completed", 9, "text", 12)
    assert text_of(job["result"]) == text.choices[0].text

    offline = offline_results(settings, [
        ("/v1/chat/completions", {"messages": messages, "max_tokens": 12, "temperature": 0}),
        ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, **extras})],
        tmp_path)
    assert [text_of(x) for x in offline] == [chat.choices[0].message.content, text.choices[0].text]


def test_streaming_deltas_join_to_the_text(gateway, client, settings):
    api = sdk(gateway)
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    chunks = list(api.chat.completions.create(model=settings.model, messages=messages, max_tokens=16,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    ref = client.result(client.submit(messages, max_tokens=16, temperature=0), timeout=TIMEOUT)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1 and "".join(deltas) == text_of(ref)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    finishing = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishing == [ref["choices"][0]["finish_reason"]]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == ref["usage"]["completion_tokens"]
    assert chunks[-1].usage.prompt_tokens == ref["usage"]["prompt_tokens"]
    assert all(c.usage is None for c in chunks[:-1])

    body = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, headers=auth(), timeout=TIMEOUT) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = sse_data(raw)
    assert raw.endswith("data: [DONE]\n\n") and events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])  # no include_usage: no usage chunk
    ref = client.result(client.submit(prompt="Once upon a time", max_tokens=10, temperature=0, ignore_eos=True),
                        timeout=TIMEOUT)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text_of(ref)
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_models(gateway, settings):
    api = sdk(gateway)
    models = api.models.list().data
    assert [m.id for m in models] == [settings.model]
    assert models[0].owned_by == "pagedq" and models[0].model_extra["max_model_len"] > 1000
    assert api.models.retrieve(settings.model).id == settings.model
    with pytest.raises(openai.NotFoundError) as e:
        api.chat.completions.create(model="no/such-model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found"


# --- files and batches -------------------------------------------------------------------------------------
def _line(custom_id: str, url: str = CHAT, **body) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def _chat(text: str, max_tokens: int = 12, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, **extra}


def _comparable(line: dict) -> dict:
    body = dict(line["response"]["body"])
    for key in ("id", "created"):
        body.pop(key)
    body["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return {"custom_id": line["custom_id"], "body": body}


def wait_batch(api: openai.OpenAI, batch_id: str, states=("completed", "cancelled", "expired", "failed")):
    return wait_until(lambda: (b := api.batches.retrieve(batch_id)).status in states and b, TIMEOUT, 0.2,
                      f"batch {batch_id} to end")


def test_files_and_batches_lifecycle(gateway, client):
    api = sdk(gateway)
    good = [_line("c1", **_chat("Name three colors.")),
            _line("c2", messages=[{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": "What is Redis?"}], max_tokens=10, temperature=0),
            _line("c3", **_chat("Count to ten.", 16, stop=[","]))]
    lines = [good[0], _line("bad", messages=[], max_tokens=4), good[1],
             _line("other-endpoint", "/v1/completions", prompt="x", max_tokens=2), good[2]]
    data = ("\n".join(lines) + "\n").encode()

    upload = api.files.create(file=("requests.jsonl", data), purpose="batch")
    assert (upload.bytes, upload.purpose, upload.filename) == (len(data), "batch", "requests.jsonl")
    assert api.files.retrieve(upload.id).id == upload.id
    assert api.files.content(upload.id).content == data
    assert upload.id in [f.id for f in api.files.list(purpose="batch")]

    batch = api.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h",
                               metadata={"run": "lifecycle"})
    assert batch.status == "in_progress" and batch.metadata == {"run": "lifecycle"}
    assert batch.request_counts.total == 5
    assert api.batches.list(limit=1).data[0].id == batch.id  # newest first

    done = wait_batch(api, batch.id)
    assert done.status == "completed" and done.completed_at >= done.created_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (5, 3, 2)
    output = [json.loads(ln) for ln in api.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(ln) for ln in api.files.content(done.error_file_id).text.splitlines()]
    assert [x["custom_id"] for x in output] == ["c1", "c2", "c3"]
    assert [x["custom_id"] for x in errors] == ["bad", "other-endpoint"]
    assert all(x["response"]["status_code"] == 400 for x in errors)
    assert "messages" in errors[0]["error"]["message"] and "url" in errors[1]["error"]["message"]
    assert api.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert api.batches.retrieve(batch.id).output_file_id == done.output_file_id  # written once, then kept

    # The same requests through the Python client give the same completions.
    ref = client.batch_results(client.submit_batch(good), timeout=TIMEOUT)
    assert [_comparable(x) for x in output] == [_comparable(x) for x in ref]
    assert "," not in text_of(output[2]["response"]["body"])

    assert api.files.delete(upload.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        api.files.retrieve(upload.id)


def test_cancel_a_running_batch(gateway):
    api = sdk(gateway)
    lines = [_line(f"req-{i}", **_chat(f"Tell me a fact about the number {i}.", 16, ignore_eos=True))
             for i in range(10)]
    upload = api.files.create(file=("many.jsonl", "\n".join(lines).encode()), purpose="batch")
    batch = api.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    wait_until(lambda: api.batches.retrieve(batch.id).request_counts.completed >= 1, TIMEOUT, 0.05,
               "the first line to complete")
    assert api.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    done = wait_batch(api, batch.id)
    assert done.status == "cancelled" and done.cancelled_at and done.cancelling_at
    completed = done.request_counts.completed
    assert 1 <= completed < 10 and done.request_counts.failed == 10 - completed
    output = [json.loads(ln) for ln in api.files.content(done.output_file_id).text.splitlines()]
    errors = [json.loads(ln) for ln in api.files.content(done.error_file_id).text.splitlines()]
    assert len(output) == completed and all(x["response"]["body"]["usage"]["completion_tokens"] == 16
                                            for x in output)
    assert {x["error"]["code"] for x in errors} == {"cancelled"}
    index = {f"req-{i}": i for i in range(10)}
    for part in (output, errors):  # each file in input order
        assert [index[x["custom_id"]] for x in part] == sorted(index[x["custom_id"]] for x in part)
    assert sorted(index[x["custom_id"]] for x in output + errors) == list(range(10))


# --- jobs over HTTP, disconnects ---------------------------------------------------------------------------
def test_async_jobs(gateway, client):
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True, "priority": 7}
    resp = httpx.post(f"{gateway}/v1/jobs", json=body, headers=auth())
    assert resp.status_code == 202
    job = resp.json()
    assert (job["object"], job["state"], job["priority"], job["kind"], job["result"]) == (
        "job", "queued", 7, "text", None)
    with httpx.stream("GET", f"{gateway}/v1/jobs/{job['id']}/events", headers=auth(), timeout=TIMEOUT) as r:
        assert r.status_code == 200
        events = sse_data(r.read().decode())
    assert events[-1] == "[DONE]" and events[-2]["type"] == "end"
    deltas = [e["text"] for e in events if isinstance(e, dict) and e["type"] == "delta"]
    final = events[-2]["job"]
    assert final["state"] == "completed" and "".join(deltas) == text_of(final["result"])
    got = httpx.get(f"{gateway}/v1/jobs/{job['id']}", headers=auth()).json()
    assert got["state"] == "completed" and got["completion_tokens"] == 12
    assert got["created_at"] <= got["started_at"] <= got["completed_at"]
    assert text_of(got["result"]) == text_of(client.result(job["id"], timeout=5))

    long = httpx.post(f"{gateway}/v1/jobs", json={**body, "max_tokens": 400}, headers=auth()).json()
    wait_until(lambda: httpx.get(f"{gateway}/v1/jobs/{long['id']}", headers=auth()).json()["state"] == "in_progress",
               what="the job to start")
    assert httpx.delete(f"{gateway}/v1/jobs/{long['id']}", headers=auth()).json()["state"] in (
        "cancelling", "cancelled")
    wait_until(lambda: job_state(client, long["id"]) == "cancelled", what="the job to be cancelled")
    assert client.status(long["id"]).completion_tokens < 400

    expiring = httpx.post(f"{gateway}/v1/jobs", json={**body, "timeout_s": 0}, headers=auth()).json()
    ended = wait_until(lambda: (j := httpx.get(f"{gateway}/v1/jobs/{expiring['id']}", headers=auth()).json())[
        "state"] not in ("queued", "in_progress") and j, what="the job to end")
    assert ended["state"] == "expired" and ended["error"]["code"] == "expired"


def test_a_client_that_disconnects_cancels_its_job(gateway, client, settings):
    api = sdk(gateway)
    stream = api.chat.completions.create(model=settings.model, max_tokens=400, temperature=0, stream=True,
                                         messages=[{"role": "user", "content": "Tell me a long story."}],
                                         extra_body={"ignore_eos": True})
    chunks = iter(stream)
    job_id = next(chunks).id.removeprefix("chatcmpl-")
    next(c for c in chunks if c.choices and c.choices[0].delta.content)  # generation has started
    stream.close()
    wait_until(lambda: job_state(client, job_id) == "cancelled", 30, what="the streamed job to be cancelled")
    assert client.status(job_id).completion_tokens < 400

    before = set(client.r.scan_iter(match=client.names.job("*"), count=1000))
    with pytest.raises(httpx.ReadTimeout):  # a blocking request whose client gives up
        httpx.post(f"{gateway}{CHAT}", headers=auth(), timeout=3,
                   json=_chat("Tell me another long story.", 400, ignore_eos=True))
    new = set(client.r.scan_iter(match=client.names.job("*"), count=1000)) - before
    assert len(new) == 1
    job_id = new.pop().removeprefix(client.names.job(""))
    wait_until(lambda: job_state(client, job_id) == "cancelled", 30, what="the blocking job to be cancelled")


# --- tenants ------------------------------------------------------------------------------------------------
def test_tenant_isolation(gateway):
    alpha, beta = sdk(gateway, "sk-alpha"), sdk(gateway, "sk-beta")
    job = httpx.post(f"{gateway}/v1/jobs", json={"prompt": "Hi", "max_tokens": 2}, headers=auth()).json()
    upload = alpha.files.create(file=("a.jsonl", _line("a", **_chat("Hi", 2)).encode()), purpose="batch")
    batch = alpha.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")

    for method, path in (("GET", f"/v1/jobs/{job['id']}"), ("DELETE", f"/v1/jobs/{job['id']}"),
                         ("GET", f"/v1/jobs/{job['id']}/events"), ("GET", f"/v1/files/{upload.id}"),
                         ("GET", f"/v1/files/{upload.id}/content"), ("DELETE", f"/v1/files/{upload.id}"),
                         ("GET", f"/v1/batches/{batch.id}"), ("POST", f"/v1/batches/{batch.id}/cancel")):
        resp = httpx.request(method, f"{gateway}{path}", headers=auth("sk-beta"))
        assert resp.status_code == 404, (method, path)
        assert resp.json()["error"]["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        beta.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    assert upload.id not in [f.id for f in beta.files.list()]
    assert batch.id not in [b.id for b in beta.batches.list()]

    assert httpx.get(f"{gateway}/v1/jobs/{job['id']}", headers=auth()).status_code == 200
    assert alpha.files.retrieve(upload.id).id == upload.id and wait_batch(alpha, batch.id).status == "completed"
    for headers in ({}, auth("sk-nobody"), {"Authorization": "sk-alpha"}):
        resp = httpx.get(f"{gateway}/v1/models", headers=headers)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_tenant_limits(gateway, client):
    small = sdk(gateway, "sk-small")
    with pytest.raises(openai.BadRequestError) as e:
        small.completions.create(model=client.settings.model, prompt="x", max_tokens=2, extra_body={"priority": 9})
    assert e.value.param == "priority"

    lines = "\n".join(_line(f"l{i}", **_chat("Hi", 2)) for i in range(3)).encode()
    upload = small.files.create(file=("three.jsonl", lines), purpose="batch")
    with pytest.raises(openai.RateLimitError) as e:  # 3 jobs at once, at most 2 queued
        small.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    assert int(e.value.response.headers["retry-after"]) >= 1 and e.value.code == "too_many_queued_jobs"

    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    jobs = [httpx.post(f"{gateway}/v1/jobs", json=body, headers=auth("sk-small")) for _ in range(3)]
    assert [r.status_code for r in jobs] == [202, 202, 429]
    assert int(jobs[2].headers["retry-after"]) >= 1
    assert jobs[2].json()["error"]["code"] == "too_many_queued_jobs"
    assert {r.json()["priority"] for r in jobs[:2]} == {3}  # the default 5, capped at the tenant's highest
    for r in jobs[:2]:
        httpx.delete(f"{gateway}/v1/jobs/{r.json()['id']}", headers=auth("sk-small"))
    for r in jobs[:2]:
        wait_until(lambda r=r: job_state(client, r.json()["id"]) == "cancelled", what="a job to be cancelled")
    again = httpx.post(f"{gateway}/v1/jobs", json={**body, "max_tokens": 2}, headers=auth("sk-small"))
    assert again.status_code == 202  # ended jobs no longer count

    if time.time() % 60 > 55:  # the four requests must fall in one clock minute
        time.sleep(60.5 - time.time() % 60)
    codes = [httpx.get(f"{gateway}/v1/models", headers=auth("sk-slow")) for _ in range(4)]
    assert [r.status_code for r in codes[:3]] == [200, 200, 200] and codes[3].status_code == 429
    assert 1 <= int(codes[3].headers["retry-after"]) <= 60
    assert codes[3].json()["error"]["code"] == "rate_limit_exceeded"


# --- errors and health --------------------------------------------------------------------------------------
def test_errors_the_openai_way(gateway, settings):
    def post(path: str, **kw) -> httpx.Response:
        return httpx.post(f"{gateway}{path}", headers=auth(), timeout=TIMEOUT, **kw)

    resp = post(CHAT, json=_chat("hi", temperature=3))
    assert resp.status_code == 400
    assert resp.json() == {"error": {"message": "temperature: Input should be less than or equal to 2",
                                     "type": "invalid_request_error", "param": "temperature",
                                     "code": "invalid_request_error"}}
    assert post(CHAT, json={"max_tokens": 2}).json()["error"]["param"] == "messages"
    resp = post(CHAT, json=_chat("hi", 10**6))
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "context_length_exceeded"
    assert post(CHAT, json={**_chat("hi"), "stream_options": {"include_usage": True}}).json()["error"][
        "param"] == "stream_options"
    assert post(CHAT, content=b"{not json").status_code == 400
    assert post("/v1/jobs", json=[1, 2]).json()["error"]["message"] == "body: must be a JSON object"
    resp = post(CHAT, json=_chat("x" * MAX_REQUEST_BYTES))
    assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
    resp = post("/v1/batches", json={"input_file_id": "file-x", "endpoint": "/v1/embeddings",
                                     "completion_window": "24h"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "endpoint"
    resp = httpx.get(f"{gateway}/v1/jobs/0123", headers=auth())
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "invalid_request_error"

    assert httpx.get(f"{gateway}/health").json() == {"status": "ok", "redis": "ok", "workers": None}
    ready = httpx.get(f"{gateway}/ready")
    assert ready.status_code == 200 and ready.json()["workers"] == {settings.model: 1}


def test_serve_without_keys_only_on_loopback(settings, redis_url, tmp_path):
    env = gateway_env(settings, redis_url)
    refused = subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "serve", "--host", "0.0.0.0",
                              "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "refusing to bind 0.0.0.0 without API keys" in refused.stderr

    port = free_port()
    proc = start_gateway(["--port", str(port)], env, tmp_path / "gateway.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, tmp_path / "gateway.log")
        assert "serving on loopback only, without authentication" in (tmp_path / "gateway.log").read_text()
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 200  # no key needed
    finally:
        stop(proc, 30)


# --- schemathesis -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def schema_app(redis_url):
    """The app in process, on its own prefixes, with a GPU worker and its model registered but no worker running."""
    settings = Settings(broker_url=redis_url, key_prefix="pgs:", queue_prefix="pgs.", result_cache=False)
    names, r = Names.from_settings(settings), redis_client(redis_url)
    register_model(r, names, ModelInfo(name=settings.model, fingerprint="none", max_model_len=2048,
                                       vocab_size=49152, queue=names.generate_queue(settings.model)))
    Heartbeat(r, names.worker("gpu.absent@test"), {"role": "gpu", "model": settings.model, "ready": 1}, ttl_s=3600)
    yield create_app(settings, redis_url, GatewayConfig(max_file_bytes=1 << 20))
    for key in r.scan_iter(match="pgs:*", count=1000):
        r.delete(key)


@pytest.fixture(scope="module")
def api_schema(schema_app):
    return schemathesis.openapi.from_asgi("/openapi.json", schema_app)


OPERATIONS = ["GET /health", "GET /ready", "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models",
              "GET /v1/models/{model}", "POST /v1/jobs", "GET /v1/jobs/{job_id}", "DELETE /v1/jobs/{job_id}",
              "GET /v1/jobs/{job_id}/events", "POST /v1/files", "GET /v1/files", "GET /v1/files/{file_id}",
              "GET /v1/files/{file_id}/content", "DELETE /v1/files/{file_id}", "POST /v1/batches",
              "GET /v1/batches", "GET /v1/batches/{batch_id}", "POST /v1/batches/{batch_id}/cancel",
              "POST /v1/responses", "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}",
              "GET /v1/responses/{response_id}/input_items", "POST /v1/responses/{response_id}/cancel"]
_WAITING = ("/v1/chat/completions", "/v1/completions", "/v1/jobs", "/v1/responses")
EXAMPLES = int(os.environ.get("SCHEMATHESIS_MAX_EXAMPLES", "30"))  # per operation; raise it for a longer search


def test_openapi_schema_lists_every_operation(api_schema):
    found = {f"{op.method.upper()} {op.path}" for op in (r.ok() for r in api_schema.get_all_operations())}
    assert found == set(OPERATIONS)


@pytest.mark.parametrize("label", OPERATIONS)
def test_openapi_schema_no_server_errors(api_schema, label):
    """Valid and invalid requests alike: no 5xx, and every response as the schema documents it."""
    method, path = label.split()

    operation = api_schema[path][method]

    @given(case=strategies.one_of(operation.as_strategy(), operation.as_strategy(GenerationMode.NEGATIVE)))
    @hypothesis_settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def check(case) -> None:
        if path in _WAITING and isinstance(case.body, dict):
            case.body["timeout_s"] = 0.05  # nothing is served: a valid request ends expired (429) at once
        case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                       response_schema_conformance])

    check()
