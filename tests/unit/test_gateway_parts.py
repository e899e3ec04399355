"""The gateway's parts: API keys, multipart forms, request splitting, batch lines, chunk shapes, errors, and
the shared follower and admission count (the follower against the real redis-server).

No model: the HTTP behaviour end to end is in tests/e2e/test_gateway.py and test_gateway_load.py.
"""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import httpx
import pytest
import redis.asyncio as aredis

from pagedq.config.names import Names
from pagedq.pipeline.gateway.batches import prepare_line
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.follow import Follower
from pagedq.pipeline.gateway.forms import FormError, parse_form
from pagedq.pipeline.gateway.keys import KeyRing, KeysFileError, Tenant, hash_key
from pagedq.pipeline.gateway.requests import check_allowed, split_body
from pagedq.pipeline.gateway.serve import is_loopback
from pagedq.pipeline.gateway.shapes import ChunkShape, sse
from pagedq.pipeline.gateway.state import Admission
from pagedq.pipeline.protocol import CHAT_URL, COMPLETIONS_URL, RequestError, parse_request


# --- API keys ----------------------------------------------------------------------------------------------
def test_keys_file_json_and_toml(tmp_path):
    entries = [{"sha256": hash_key("sk-a"), "tenant": "a", "max_priority": 7, "rpm": 60, "max_queued": 3},
               {"sha256": hash_key("sk-a2").upper(), "tenant": "a"},  # a second key of the same tenant
               {"sha256": hash_key("sk-b"), "tenant": "b"}]
    (tmp_path / "keys.json").write_text(json.dumps({"keys": entries}))
    toml = "".join(f'[[keys]]\nsha256 = "{e["sha256"]}"\ntenant = "{e["tenant"]}"\n' for e in entries)
    (tmp_path / "keys.toml").write_text(toml)
    ring = KeyRing.load(tmp_path / "keys.json")
    assert len(ring) == 3
    assert ring.tenant_for("Bearer sk-a") == Tenant("a", 7, 60, 3)
    assert ring.tenant_for("bearer  sk-a2 ") == Tenant("a", 7, 60, 3)  # the first entry's limits
    assert ring.tenant_for("Bearer sk-b") == Tenant("b", 9, None, None)
    for header in (None, "", "Bearer", "Bearer sk-c", "Basic sk-a", "sk-a"):
        assert ring.tenant_for(header) is None
    assert KeyRing.load(tmp_path / "keys.toml").tenant_for("Bearer sk-b") == Tenant("b")


@pytest.mark.parametrize("content", ['{"keys": [{"sha256": "abc", "tenant": "a"}]}',
                                    '{"keys": [{"sha256": "' + "0" * 64 + '", "tenant": "a b"}]}',
                                    '{"keys": [{"sha256": "' + "0" * 64 + '", "tenant": "a", "rpm": 0}]}',
                                    '{"keys": [{"key": "plain-text", "tenant": "a"}]}',
                                    '{"keys": []}', "not json"])
def test_bad_keys_file_refused(tmp_path, content):
    (tmp_path / "keys.json").write_text(content)
    with pytest.raises(KeysFileError, match="keys.json"):
        KeyRing.load(tmp_path / "keys.json")


def test_loopback():
    assert all(map(is_loopback, ["127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "10.0.0.1", "example.org", ""]))


# --- multipart forms -----------------------------------------------------------------------------------------
def _encoded(files, data) -> tuple[bytes, str]:
    request = httpx.Request("POST", "http://x/v1/files", files=files, data=data)
    return request.read(), request.headers["content-type"]


def test_form_round_trip_keeps_bytes_exactly():
    content = b'{"a": 1}\r\n{"b": "\xc3\xa9"}\n\n--not-a-boundary\r\n\xff\xfe'
    body, content_type = _encoded({"file": ("in put.jsonl", content, "application/jsonl")}, {"purpose": "batch"})
    form = parse_form(body, content_type)
    assert form["file"].content == content and form["file"].filename == "in put.jsonl"
    assert form["file"].content_type == "application/jsonl"
    assert form["purpose"].content == b"batch" and form["purpose"].filename is None


@pytest.mark.parametrize("mangle", [
    lambda b, ct: (b, "application/json"),
    lambda b, ct: (b, "multipart/form-data"),
    lambda b, ct: (b"", ct),
    lambda b, ct: (b.rsplit(b"--", 1)[0], ct),  # no closing delimiter
    lambda b, ct: (b.replace(b"Content-Disposition: form-data; ", b"Content-Disposition: attachment; "), ct),
    lambda b, ct: (b.replace(b"\r\n\r\n", b"\r\n", 1), ct),
])
def test_malformed_forms_are_form_errors(mangle):
    body, content_type = _encoded({"file": ("a.jsonl", b"{}\n")}, {"purpose": "batch"})
    with pytest.raises(FormError):
        parse_form(*mangle(body, content_type))


# --- requests -----------------------------------------------------------------------------------------------
def test_split_body_reads_gateway_fields_and_caps_the_default_priority():
    tenant = Tenant("t", max_priority=3)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7, "timeout_s": 2.5,
            "stream": True, "stream_options": {"include_usage": True}}
    sub = split_body(CHAT_URL, body, tenant, default_priority=5)
    assert sub.body == {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "stream": True,
                        "priority": 3}
    assert (sub.timeout_s, sub.include_usage, sub.kind) == (2.5, True, "chat")
    assert sub.submit_kwargs() == {"messages": [{"role": "user", "content": "hi"}], "timeout_s": 2.5,
                                   "max_tokens": 7, "stream": True, "priority": 3}
    text = split_body(COMPLETIONS_URL, {"prompt": "x", "priority": 2}, Tenant("t"), 5)
    assert text.submit_kwargs() == {"prompt": "x", "timeout_s": None, "priority": 2} and text.kind == "text"
    assert "max_completion_tokens" in split_body(COMPLETIONS_URL, {"max_completion_tokens": 3}, tenant, 5).body


@pytest.mark.parametrize("extra,param", [({"stream_options": {"include_usage": 1}}, "stream_options"),
                                         ({"stream_options": {"other": True}}, "stream_options"),
                                         ({"stream_options": []}, "stream_options"),
                                         ({"timeout_s": -1}, "timeout_s"), ({"timeout_s": "5"}, "timeout_s"),
                                         ({"timeout_s": float("inf")}, "timeout_s"),
                                         ({"timeout_s": True}, "timeout_s")])
def test_split_body_refuses_bad_gateway_fields(extra, param):
    with pytest.raises(RequestError) as e:
        split_body(CHAT_URL, {"messages": [], **extra}, Tenant("t"), 5)
    assert e.value.param == param


def test_check_allowed():
    tenant = Tenant("t", max_priority=4)
    body = {"prompt": "x", "priority": "6"}  # the schema reads "6" as 6: the cap applies to what it reads
    sub = split_body(COMPLETIONS_URL, body, tenant, 5)
    with pytest.raises(RequestError, match="at most 4") as e:
        check_allowed(sub, parse_request(COMPLETIONS_URL, sub.body), tenant)
    assert e.value.param == "priority"
    sub = split_body(COMPLETIONS_URL, {"prompt": "x", "stream_options": {"include_usage": True}}, tenant, 5)
    with pytest.raises(RequestError, match="only allowed when stream is true"):
        check_allowed(sub, parse_request(COMPLETIONS_URL, sub.body), tenant)
    sub = split_body(COMPLETIONS_URL, {"prompt": "x", "stream": True, "stream_options": {}}, tenant, 5)
    check_allowed(sub, parse_request(COMPLETIONS_URL, sub.body), tenant)


# --- batch lines --------------------------------------------------------------------------------------------
def _line(url=COMPLETIONS_URL, **body) -> str:
    return json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": {"prompt": "x", **body}})


def test_prepare_line():
    same = _line(priority=9)
    assert prepare_line(same, COMPLETIONS_URL, 9, 5) is same  # an unlimited tenant's lines pass unchanged
    assert json.loads(prepare_line(same, COMPLETIONS_URL, 3, 5))["body"]["priority"] == 3
    assert json.loads(prepare_line(_line(priority="8"), COMPLETIONS_URL, 3, 5))["body"]["priority"] == 3
    assert json.loads(prepare_line(_line(), COMPLETIONS_URL, 3, 5))["body"]["priority"] == 3
    assert prepare_line(_line(priority=2), COMPLETIONS_URL, 3, 5) == _line(priority=2)
    assert prepare_line(_line(), COMPLETIONS_URL, 7, 5) == _line()  # the default is allowed
    for garbage in ("not json", "[1, 2]", '{"body": 3}'):
        assert prepare_line(garbage, COMPLETIONS_URL, 3, 5) == garbage
    other = prepare_line(_line(url=CHAT_URL), COMPLETIONS_URL, 9, 5)
    with pytest.raises(RequestError) as e:  # the schema now refuses the line, naming url
        parse_request(json.loads(other)["url"], {})
    assert e.value.param == "url" and "this batch's endpoint is /v1/completions" in str(e.value)


# --- shapes and errors --------------------------------------------------------------------------------------
def test_chat_chunks():
    shape = ChunkShape("chat", "chatcmpl-1", "m", 5, include_usage=True)
    assert shape.opening() == {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5, "model": "m",
                               "usage": None, "choices": [{"index": 0, "logprobs": None, "finish_reason": None,
                                                           "delta": {"role": "assistant", "content": ""}}]}
    assert shape.delta("Hi")["choices"][0]["delta"] == {"content": "Hi"}
    finish = shape.finish("length")["choices"][0]
    assert finish["delta"] == {} and finish["finish_reason"] == "length"
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert shape.usage(usage)["choices"] == [] and shape.usage(usage)["usage"] == usage
    assert sse(shape.delta("é")).startswith(b"data: {") and sse(shape.delta("é")).endswith(b"}\n\n")
    assert sse("[DONE]") == b"data: [DONE]\n\n"


def test_text_chunks():
    shape = ChunkShape("text", "cmpl-1", "m", 5)
    assert shape.opening() is None
    assert shape.delta("Hi") == {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m",
                                 "choices": [{"index": 0, "logprobs": None, "finish_reason": None, "text": "Hi"}]}
    assert shape.finish("stop", "\n")["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "stop",
                                                        "text": "", "stop_reason": "\n"}


@pytest.mark.parametrize("code,status,retry", [("invalid_request_error", 400, None),
                                               ("context_length_exceeded", 400, None), ("queue_full", 429, "2"),
                                               ("expired", 429, "2"), ("model_not_found", 404, None),
                                               ("server_error", 503, "2")])
def test_request_errors_map_to_statuses(code, status, retry):
    response = ApiError.from_request_error(RequestError("temperature: too hot", "temperature", code)).response()
    assert response.status_code == status and response.headers.get("retry-after") == retry
    assert json.loads(response.body) == {"error": {"message": "temperature: too hot", "param": "temperature",
                                                   "code": code, "type": json.loads(response.body)["error"]["type"]}}
    assert json.loads(response.body)["error"]["type"] == {400: "invalid_request_error", 404: "invalid_request_error",
                                                          429: "rate_limit_error", 503: "server_error"}[status]


# --- configuration ------------------------------------------------------------------------------------------
def test_gateway_config_handed_to_worker_processes(monkeypatch, tmp_path):
    from pagedq.pipeline.gateway.config import HANDOFF_VARIABLE, KEYS_FILE_VARIABLE, GatewayConfig

    monkeypatch.setenv(HANDOFF_VARIABLE, "")  # restored (removed) after the test, hand_off's value too
    monkeypatch.setenv(KEYS_FILE_VARIABLE, str(tmp_path / "keys.json"))
    assert GatewayConfig.from_env() == GatewayConfig(api_keys_file=tmp_path / "keys.json")
    config = GatewayConfig(max_request_bytes="64KiB", max_file_bytes="2MiB")
    assert (config.max_request_bytes, config.max_file_bytes, config.api_keys_file) == (64 << 10, 2 << 20, None)
    config.hand_off()  # what a uvicorn worker started now sees, whatever PAGEDQ_API_KEYS_FILE says
    assert GatewayConfig.from_env() == config
    with pytest.raises(ValueError):
        GatewayConfig(max_file_bytes="lots")


# --- following many jobs at once ----------------------------------------------------------------------------
async def _no_tick(rec: dict[str, str]) -> None:
    pass


def _pool(redis_url: str, size: int) -> aredis.Redis:
    return aredis.Redis.from_pool(aredis.BlockingConnectionPool.from_url(
        redis_url, max_connections=size, timeout=30, decode_responses=True))


def test_one_follower_serves_hundreds_of_jobs_over_four_connections(redis_url):
    """300 streams and 300 end waits over a pool of 4 connections (2 of them the shared pub/sub and reader).
    Waiters look at their records only every 10 minutes: every stream and wait must end by the shared pub/sub
    and stream reader alone."""
    names, n = Names(key_prefix=f"pfw{uuid.uuid4().hex[:6]}:"), 300
    words = [f"w{random.randrange(10**6)} " for _ in range(50)]
    texts = {uuid.uuid4().hex: random.sample(words, random.randint(1, 6)) for _ in range(n)}

    async def main() -> tuple[list[str], list[dict]]:
        r = _pool(redis_url, 4)
        follower = Follower(r, names, poll_s=600)
        for job_id in texts:
            await r.hset(names.job(job_id), mapping={"state": "running"})

        async def text(job_id: str) -> str:
            return "".join([t async for t in follower.deltas(job_id, _no_tick)])

        streams = [asyncio.create_task(text(job_id)) for job_id in texts]
        ends = [asyncio.create_task(follower.wait_done(job_id, _no_tick)) for job_id in texts]
        while follower.waiting < 2 * n:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # every waiter has read its record and waits
        for job_id, pieces in texts.items():
            async with r.pipeline(transaction=False) as pipe:
                for piece in pieces:
                    pipe.xadd(names.stream(job_id), {"type": "delta", "text": piece})
                pipe.xadd(names.stream(job_id), {"type": "end"})
                pipe.hset(names.job(job_id), "state", "completed")
                pipe.publish(names.done_channel(job_id), "completed")
                await pipe.execute()
        async with asyncio.timeout(120):
            got = await asyncio.gather(*streams), await asyncio.gather(*ends)
        assert follower.waiting == 0
        await follower.close()
        await r.aclose()
        return got

    got_texts, records = asyncio.run(main())
    assert got_texts == ["".join(p) for p in texts.values()]
    assert [rec["state"] for rec in records] == ["completed"] * n


def test_a_missed_end_still_ends_the_wait(redis_url):
    """No publish, no end entry: the job's record alone (read every poll_s) ends both waits, with every delta."""
    names, job_id = Names(key_prefix=f"pfm{uuid.uuid4().hex[:6]}:"), uuid.uuid4().hex
    pieces = [f"p{random.randrange(10**6)} " for _ in range(random.randint(1, 5))]

    async def main() -> tuple[str, dict]:
        r = _pool(redis_url, 4)
        follower = Follower(r, names, poll_s=0.2)
        await r.hset(names.job(job_id), mapping={"state": "running"})
        ticks: list[str] = []

        async def tick(rec: dict[str, str]) -> None:
            ticks.append(rec["state"])

        async def text() -> str:
            return "".join([t async for t in follower.deltas(job_id, tick)])

        stream, end = asyncio.create_task(text()), asyncio.create_task(follower.wait_done(job_id, tick))
        await asyncio.sleep(0.5)
        for piece in pieces:
            await r.xadd(names.stream(job_id), {"type": "delta", "text": piece})
        await r.hset(names.job(job_id), "state", "failed")
        async with asyncio.timeout(30):
            got = await stream, await end
        assert "running" in ticks  # a waiting job is ticked
        await follower.close()
        await r.aclose()
        return got

    text, record = asyncio.run(main())
    assert text == "".join(pieces) and record["state"] == "failed"


def test_admission_refuses_past_its_limit_and_releases_once():
    limit = random.randint(1, 5)
    admission = Admission(limit)
    releases = [admission.enter() for _ in range(limit)]
    with pytest.raises(ApiError) as refused:
        admission.enter()
    assert refused.value.status == 503 and refused.value.response().headers["retry-after"] == "2"
    releases[0]()
    releases[0]()  # a second release gives back nothing more
    assert admission.serving == limit - 1
    admission.enter()
    with pytest.raises(ApiError):
        admission.enter()
