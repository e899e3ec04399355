"""The gateway under many concurrent requests, and its admission limit, through a real ``pagedq serve`` process.

- Hundreds of streaming and blocking chat completions at once (more than the
  100 connections redis-py's asyncio pool held before the shared follower)
  through one uvicorn process in front of a real stack: every one ends with
  its whole text (and ``[DONE]``), and no job is cancelled.
- With ``--limit-concurrency``, the request past the limit is answered 503
  with ``Retry-After`` and creates no job; a place frees when a client leaves.
  This one needs no model: a registered (absent) GPU worker makes the model
  look served, and its jobs wait in the queue.

The full-size figures (1,000 streams, 1,000 blocking requests) come from
``scripts/bench_http.py --connections 1000`` (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import random
import uuid

import httpx
import pytest
from test_gateway import gateway_env, sse_data, start_gateway, wait_healthy

from pagedq.config import Settings
from pagedq.config.names import Names
from pagedq.pipeline.client import Client
from pagedq.store.connection import redis_client
from pagedq.store.registry import Heartbeat, ModelInfo, register_model
from pagedq.workers.processes import free_port, stop

CHAT = "/v1/chat/completions"
STREAMS, BLOCKING = 120, 40


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="pgl:", queue_prefix="pgl.", result_cache=False,
                    max_num_seqs=256, kv_cache_memory="512MiB", progress_interval_s=0.5)


def serve(settings: Settings, url: str, folder, *args: str) -> tuple[str, object]:
    port = free_port()
    proc = start_gateway(["--port", str(port), *args], gateway_env(settings, url), folder / "gateway.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, folder / "gateway.log")
    except BaseException:
        stop(proc, 30)
        raise
    return base, proc


def _body(i: int, stream: bool) -> dict:
    body = {"messages": [{"role": "user", "content": f"Say something about the number {random.randrange(10**6)}."}],
            "max_tokens": random.randint(2, 4), "temperature": 0, "ignore_eos": True}
    return {**body, "stream": True} if stream else body


async def _streamed(http: httpx.AsyncClient, body: dict) -> tuple[str, str, bool]:
    """(job id, the streamed text, whether it ended with [DONE])."""
    async with http.stream("POST", CHAT, json=body) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        events = sse_data((await resp.aread()).decode())
    chunks = [e for e in events if e != "[DONE]"]
    assert not any("error" in c for c in chunks), chunks
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return chunks[0]["id"].removeprefix("chatcmpl-"), text, events[-1] == "[DONE]"


async def _blocking(http: httpx.AsyncClient, body: dict) -> tuple[str, str]:
    resp = await http.post(CHAT, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()["id"].removeprefix("chatcmpl-"), resp.json()["choices"][0]["message"]["content"]


def test_hundreds_of_concurrent_requests_all_end_whole(settings, stack, client, tmp_path):
    base, proc = serve(settings, stack.url, tmp_path, "--workers", "1")
    limits = httpx.Limits(max_connections=STREAMS + BLOCKING, max_keepalive_connections=0)

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as http:
            return await asyncio.gather(*(_streamed(http, _body(i, True)) for i in range(STREAMS)),
                                        *(_blocking(http, _body(i, False)) for i in range(BLOCKING)))

    try:
        answers = asyncio.run(main())
    finally:
        stop(proc, 30)
    streamed, blocked = answers[:STREAMS], answers[STREAMS:]
    assert all(done for _, _, done in streamed)
    jobs = {job_id: text for job_id, text, _ in streamed} | dict(blocked)
    assert len(jobs) == STREAMS + BLOCKING
    assert {client.status(job_id).state for job_id in jobs} == {"completed"}  # none cancelled
    for job_id, text in jobs.items():  # every token: the text the job produced, whole
        assert text == client.result(job_id, timeout=60)["choices"][0]["message"]["content"], job_id


def _job_keys(client: Client) -> set[str]:
    return set(client.r.scan_iter(match=client.names.job("*"), count=1000))


def test_past_the_limit_503_with_retry_after_and_no_job(redis_url, tmp_path):
    """Two requests hold the two places (their jobs wait: no worker runs); the third is refused before it
    creates a job; a client that leaves cancels its job and frees its place."""
    settings = Settings(broker_url=redis_url, key_prefix=f"pll{uuid.uuid4().hex[:6]}:", queue_prefix="pll.",
                        result_cache=False)
    names, r = Names.from_settings(settings), redis_client(redis_url)
    register_model(r, names, ModelInfo(name=settings.model, fingerprint="none", max_model_len=2048,
                                       vocab_size=49152, queue=names.generate_queue(settings.model)))
    Heartbeat(r, names.worker("gpu.absent@test"), {"role": "gpu", "model": settings.model, "ready": 1}, ttl_s=3600)
    base, proc = serve(settings, redis_url, tmp_path, "--limit-concurrency", "2")
    client = Client(settings, redis_url)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            async with http.stream("POST", CHAT, json=_body(0, True)) as held:
                assert held.status_code == 200
                lines = held.aiter_lines()
                while not (line := await anext(lines)).startswith("data: "):
                    pass
                streamed_job = sse_data(line)[0]["id"].removeprefix("chatcmpl-")
                before = _job_keys(client)
                waiting = asyncio.create_task(http.post(CHAT, json=_body(1, False)))
                while len(_job_keys(client)) == len(before):  # the blocking request's job exists
                    await asyncio.sleep(0.05)
                jobs = _job_keys(client)
                refused = await http.post(CHAT, json=_body(2, random.random() < 0.5))
                assert refused.status_code == 503, refused.text
                assert int(refused.headers["retry-after"]) >= 1
                assert refused.json()["error"]["code"] == "service_unavailable"
                assert _job_keys(client) == jobs  # refused before any job was created
                waiting.cancel()  # that client leaves too
            for job_id in {streamed_job, *(k.removeprefix(names.job("")) for k in jobs - before)}:
                for _ in range(600):
                    if client.status(job_id).state == "cancelled":
                        break
                    await asyncio.sleep(0.05)
                assert client.status(job_id).state == "cancelled", job_id
            for _ in range(100):  # both places free again: a request is served (and expires at once, queued)
                again = await http.post(CHAT, json={**_body(3, False), "timeout_s": 0.2})
                if again.status_code != 503:
                    break
                await asyncio.sleep(0.1)
            assert again.status_code == 429 and again.json()["error"]["code"] == "expired", again.text

    try:
        asyncio.run(main())
    finally:
        stop(proc, 30)
        client.close()
        for key in r.scan_iter(match=f"{settings.key_prefix}*", count=1000):
            r.delete(key)
