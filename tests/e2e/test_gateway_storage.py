"""The gateway's storage: per-tenant file quotas, the file store's share of Redis, batches finalized when
they end.

The first tests need no model: the gateway's stores (``Gateway``, built as a uvicorn worker builds it) on
the session's real redis-server, or on one started with a small ``maxmemory``; jobs are ended through
``JobStore.finish``, the one path every worker takes.  The last two run a real ``pagedq serve`` process
(with a keys file) in front of the module's GPU and CPU workers, with ``result_ttl_s`` of a few seconds.
"""

from __future__ import annotations

import json
import os
import random
import string
import subprocess
import sys
import time

import httpx
import openai
import pytest
import queue_helpers

from pagedq.config import Settings
from pagedq.config.names import JobState, Names
from pagedq.pipeline.gateway.batches import BatchCreate
from pagedq.pipeline.gateway.config import HANDOFF_VARIABLE, KEYS_FILE_VARIABLE, GatewayConfig
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.files import OutputFile
from pagedq.pipeline.gateway.keys import Tenant, hash_key
from pagedq.pipeline.gateway.ledger import RESULT_BUCKET_S, ROOM_CACHE_S
from pagedq.pipeline.gateway.state import Gateway
from pagedq.pipeline.local.redis_server import RedisServer
from pagedq.pipeline.local.stack import settings_env
from pagedq.store.connection import redis_client
from pagedq.workers.processes import free_port, spawn, stop

TIMEOUT = 120
CHAT = "/v1/chat/completions"
RESULT_TTL_S = 4
STORES_TTL_S = 2  # result_ttl_s of the tests without a model
QUOTA_BYTES = 96 << 10
MAX_FILE_BYTES = 8 << 20
SPENDER_QUOTA_BYTES = 4 << 10  # less than one answer with top logprobs (below)
TENANTS = {  # API key -> its keys-file entry
    "sk-full": {"tenant": "full", "max_stored_bytes": QUOTA_BYTES, "max_files": 3},
    "sk-other": {"tenant": "other"},
    "sk-spender": {"tenant": "spender", "max_stored_bytes": SPENDER_QUOTA_BYTES},
}


def random_text(n: int) -> str:
    return "".join(random.choices(string.ascii_letters + " ", k=n))


def random_file(nbytes: int) -> bytes:
    """Text bytes ending in a newline, fresh each time."""
    return os.urandom(nbytes).hex().encode()[:nbytes - 1] + b"\n"


def chat_line(custom_id: str, max_tokens: int = 3) -> str:
    body = {"messages": [{"role": "user", "content": random_text(30)}], "max_tokens": max_tokens,
            "temperature": 0}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


def content_keys(r, prefix: str) -> set[str]:
    return set(r.scan_iter(match=f"{prefix}gw:file:*:content"))


# --- without a model: the stores on a real redis-server ----------------------------------------------------
@pytest.fixture
def stores(redis_url):
    """The gateway's stores as a uvicorn worker builds them, on fresh prefixes of the session's Redis."""
    prefix = f"pgs{random.randrange(10**6)}"
    settings = Settings(broker_url=redis_url, key_prefix=f"{prefix}:", queue_prefix=f"{prefix}.",
                        result_ttl_s=STORES_TTL_S)
    gw = Gateway(settings, redis_url, GatewayConfig())
    yield gw
    gw.close()


def upload(gw: Gateway, tenant: Tenant, content: bytes) -> dict:
    return gw.files.create(tenant, "in.jsonl", "batch", content)


def test_file_quota_refuses_before_writing(stores):
    gw = stores
    full = Tenant("full", max_stored_bytes=QUOTA_BYTES, max_files=3)
    other = Tenant("other")
    first = upload(gw, full, random_file(QUOTA_BYTES * 2 // 3))
    before = (gw.files.usage(full), content_keys(gw.r, gw.keys.key_prefix))

    with pytest.raises(ApiError) as over:  # fits alone, not beside the first
        upload(gw, full, random_file(QUOTA_BYTES // 2))
    assert over.value.status == 429 and over.value.code == "storage_quota_exceeded"
    assert "max_stored_bytes" in str(over.value) and str(QUOTA_BYTES) in str(over.value)
    with pytest.raises(ApiError) as never:  # could never fit
        upload(gw, full, random_file(QUOTA_BYTES + 1))
    assert never.value.status == 413 and "max_stored_bytes" in str(never.value)
    assert (gw.files.usage(full), content_keys(gw.r, gw.keys.key_prefix)) == before  # no byte stored
    assert [f["id"] for f in gw.files.list(full, None, 100)["data"]] == [first["id"]]

    upload(gw, full, random_file(100))
    upload(gw, full, random_file(100))
    with pytest.raises(ApiError) as count:
        upload(gw, full, random_file(100))
    assert count.value.status == 429 and "max_files" in str(count.value)

    upload(gw, other, random_file(QUOTA_BYTES * 2))  # another tenant's room is its own
    gw.files.delete(first["id"], full)  # a deleted file gives its room back
    assert gw.files.usage(full) == (200, 2)
    upload(gw, full, random_file(QUOTA_BYTES // 2))


def test_a_full_file_store_refuses_files_never_jobs(tmp_path):
    maxmemory = 64 << 20
    with RedisServer(tmp_path / "redis", write_run_file=False, maxmemory=maxmemory) as server:
        settings = Settings(broker_url=server.url, key_prefix="pfs:", queue_prefix="pfs.", file_store_share=0.25)
        gw = Gateway(settings, server.url, GatewayConfig())
        try:
            roomy = Tenant("roomy", max_stored_bytes=1 << 30)
            size = 5 << 20
            for _ in range(3):  # 15 MiB of the store's 16 MiB
                upload(gw, roomy, random_file(size))
            keys_before = content_keys(gw.r, "pfs:")
            with pytest.raises(ApiError) as full:
                upload(gw, Tenant("newcomer"), random_file(size))
            assert full.value.status == 429 and full.value.code == "file_store_full"
            assert "PAGEDQ_FILE_STORE_SHARE=0.25" in str(full.value) and str(maxmemory // 4) in str(full.value)
            with pytest.raises(ApiError) as never:
                upload(gw, Tenant("newcomer"), random_file(maxmemory // 4 + 1))
            assert never.value.status == 413 and "PAGEDQ_FILE_STORE_SHARE" in str(never.value)
            assert content_keys(gw.r, "pfs:") == keys_before
            job_id = gw.client.submit([{"role": "user", "content": random_text(20)}], max_tokens=2)
            assert gw.client.status(job_id).state == JobState.QUEUED
        finally:
            gw.close()


def test_results_count_in_the_tenant_storage_until_they_expire(stores):
    gw = stores
    spender = Tenant("spender-u", max_stored_bytes=800)
    file = upload(gw, spender, random_file(300))
    job_ids = [gw.submit(spender, {"messages": [{"role": "user", "content": random_text(20)}], "max_tokens": 2})
               for _ in range(2)]
    end_jobs(gw, job_ids)
    sizes = [gw.r.strlen(gw.names.result(j)) for j in job_ids]
    assert [gw.stored.record_result(spender.name, j) for j in job_ids] == sizes and min(sizes) > 0
    assert gw.stored.record_result(spender.name, job_ids[0]) == 0  # counted once, however often it is answered
    assert gw.stored.used(spender) == file["bytes"] + sum(sizes) > spender.max_stored_bytes
    time.sleep(ROOM_CACHE_S)  # room seen at the submits is believed that long
    with pytest.raises(ApiError) as over:
        gw.submit(spender, {"messages": [{"role": "user", "content": random_text(20)}], "max_tokens": 2})
    assert over.value.status == 429 and over.value.code == "storage_quota_exceeded"
    assert "max_stored_bytes" in str(over.value) and "results" in str(over.value)
    gw.stored.check_room(Tenant("bystander", max_stored_bytes=1000))  # another tenant's room is its own

    time.sleep(STORES_TTL_S + RESULT_BUCKET_S)  # the results expired: their bytes are given back, the file's not
    assert gw.stored.used(spender) == file["bytes"]
    assert gw.submit(spender, {"messages": [{"role": "user", "content": random_text(20)}], "max_tokens": 2})


def end_jobs(gw: Gateway, job_ids: list[str]) -> None:
    """End each job as postprocess does: a completion body through ``finish``."""
    for job_id in job_ids:
        body = {"id": f"chatcmpl-{job_id}", "object": "chat.completion", "created": int(time.time()),
                "model": "m", "choices": [{"index": 0, "message": {"role": "assistant", "content": random_text(40)},
                                           "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
        assert gw.client.store.finish(job_id, JobState.COMPLETED, result=body)


def create_batch(gw: Gateway, tenant: Tenant, lines: list[str]) -> tuple[str, list[str]]:
    file = upload(gw, tenant, ("\n".join(lines) + "\n").encode())
    batch = gw.batches.create(tenant, BatchCreate(input_file_id=file["id"], endpoint=CHAT, completion_window="24h"))
    return batch["id"], gw.r.lrange(gw.names.batch_jobs(batch["id"]), 0, -1)


def test_batch_finalized_when_it_ends_and_records_kept_until_then(stores):
    gw, tenant = stores, Tenant("team")
    batch_id, job_ids = create_batch(gw, tenant, [chat_line(f"c{i}") for i in range(3)])
    end_jobs(gw, job_ids[:1])
    time.sleep(STORES_TTL_S + 1)  # the first job's record outlives result_ttl_s while its batch runs
    assert gw.r.exists(gw.names.job(job_ids[0])) and gw.r.ttl(gw.names.job(job_ids[0])) == -1
    end_jobs(gw, job_ids[1:])
    assert gw.r.zscore(gw.names.batches_to_finalize, batch_id) is not None  # queued by the last finish

    assert gw.batches.finalizer.run_once() == 1  # as a CPU worker's finalizer thread does
    meta = gw.r.hgetall(gw.keys.batch(batch_id))
    assert meta["status"] == "completed" and meta["completed"] == "3"
    assert gw.r.zscore(gw.names.batches_to_finalize, batch_id) is None
    assert 0 < gw.r.ttl(gw.names.job(job_ids[0])) <= STORES_TTL_S  # records expire from now on
    time.sleep(STORES_TTL_S + 1)
    assert not any(gw.r.exists(gw.names.job(j)) for j in job_ids)
    done = gw.batches.get(batch_id, tenant)  # first read after every record expired
    assert (done["status"], done["request_counts"]) == ("completed", {"total": 3, "completed": 3, "failed": 0})
    output = [json.loads(ln) for ln in gw.files.content(done["output_file_id"], tenant).splitlines()]
    assert [x["custom_id"] for x in output] == ["c0", "c1", "c2"]
    assert gw.files.usage(tenant)[1] == 2  # input and output files; the unused error file's place was freed


def test_a_finalizer_that_died_mid_write_is_not_counted_twice(stores):
    gw, tenant = stores, Tenant("crashy")
    batch_id, job_ids = create_batch(gw, tenant, [chat_line(f"c{i}") for i in range(6)])
    end_jobs(gw, job_ids)
    meta = gw.r.hgetall(gw.keys.batch(batch_id))
    dead = OutputFile(gw.files, tenant, meta["output_file"], "x.jsonl", 60)  # wrote half, then died
    dead.add([(1, random_file(3000))])

    done = gw.batches.get(batch_id, tenant)
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 6
    files = gw.files.list(tenant, None, 10)["data"]
    assert gw.files.usage(tenant) == (sum(f["bytes"] for f in files), 2)
    assert len(gw.files.content(done["output_file_id"], tenant).splitlines()) == 6


def test_missing_records_and_a_full_quota_never_fail_a_read(stores):
    gw = stores
    tenant = Tenant("tight", max_stored_bytes=16 << 10, max_files=4)  # the input file takes about half
    batch_id, job_ids = create_batch(gw, tenant, [chat_line(f"c{i}") for i in range(40)])
    end_jobs(gw, job_ids)
    gw.r.delete(gw.names.job(job_ids[3]))  # a record lost anyway (a batch from before finalizers)
    done = gw.batches.get(batch_id, tenant)  # the gateway finalizes a batch it finds ended
    assert done["status"] == "completed" and done["request_counts"]["total"] == 40
    assert done["request_counts"]["completed"] == 39 and done["request_counts"]["failed"] == 1
    output = gw.files.content(done["output_file_id"], tenant).splitlines()
    assert 0 < len(output) < 39  # the tenant's room ran out: a prefix of the lines, the rest named
    assert gw.files.usage(tenant)[0] <= tenant.max_stored_bytes
    [error] = [e for e in done["errors"]["data"] if e["message"].startswith("output file")]
    assert "max_stored_bytes" in error["message"] and error["line"] == len(output) + 2  # line 4 is the error
    lost = json.loads(gw.files.content(done["error_file_id"], tenant))
    assert lost["error"]["code"] == "expired" and lost["custom_id"] is None

    gw.files.delete(done["output_file_id"], tenant)
    with pytest.raises(ApiError) as no_room:  # input, error file, a new input: no 2 places for its outputs
        create_batch(gw, tenant, [chat_line("x")])
    assert no_room.value.status == 429 and "max_files" in str(no_room.value)
    assert gw.files.usage(tenant)[1] == 3  # the place it did take is given back


def test_a_batch_whose_records_are_all_gone_reads_expired_with_its_total(stores):
    gw, tenant = stores, Tenant("old")
    batch_id, job_ids = create_batch(gw, tenant, [chat_line(f"c{i}") for i in range(5)])
    gw.r.delete(gw.names.batch(batch_id), gw.names.batch_jobs(batch_id), *(gw.names.job(j) for j in job_ids))
    done = gw.batches.get(batch_id, tenant)
    assert done["status"] == "expired" and done["request_counts"]["total"] == 5
    assert done["output_file_id"] is None and done["errors"]["data"][0]["code"] == "expired"


# --- a real gateway in front of real workers, with a short result_ttl_s ------------------------------------
@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="pgst:", queue_prefix="pgst.", result_cache=False,
                    result_ttl_s=RESULT_TTL_S, max_num_seqs=4, kv_cache_memory="256MiB")


@pytest.fixture(scope="module")
def gateway(settings, stack, tmp_path_factory) -> str:
    """The base URL of a `pagedq serve` process with the TENANTS keys file."""
    folder = tmp_path_factory.mktemp("gateway")
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hash_key(k), **v} for k, v in TENANTS.items()]}))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in (KEYS_FILE_VARIABLE, HANDOFF_VARIABLE)}
    env = {**env, **settings_env(settings), "PAGEDQ_BROKER_URL": stack.url}
    args = ["serve", "--port", str(port), "--workers", "1", "--api-keys-file", str(keys), "--max-file-bytes",
            str(MAX_FILE_BYTES)]
    proc = spawn([sys.executable, "-m", "pagedq.pipeline.cli", *args], folder / "gateway.log", env)
    base = f"http://127.0.0.1:{port}"
    try:
        queue_helpers.wait_until(lambda: _healthy(base, proc), 60, 0.2, "the gateway to answer /health")
        yield base
    finally:
        stop(proc, 30)


def _healthy(base: str, proc: subprocess.Popen) -> bool:
    assert proc.poll() is None, f"the gateway exited with {proc.returncode}"
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def sdk(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=TIMEOUT)


def test_over_quota_tenant_is_refused_and_another_tenants_jobs_run(gateway, settings):
    full, other = sdk(gateway, "sk-full"), sdk(gateway, "sk-other")
    r = redis_client(settings.broker_url)
    full.files.create(file=("a.jsonl", random_file(QUOTA_BYTES * 2 // 3)), purpose="batch")
    stored = (r.hgetall("pgst:gw:storage:usage"), content_keys(r, "pgst:"), len(full.files.list().data))

    with pytest.raises(openai.RateLimitError) as over:
        full.files.create(file=("b.jsonl", random_file(QUOTA_BYTES // 2)), purpose="batch")
    assert over.value.status_code == 429 and "max_stored_bytes" in over.value.message
    with pytest.raises(openai.APIStatusError) as big:
        full.files.create(file=("c.jsonl", random_file(MAX_FILE_BYTES + 1000)), purpose="batch")
    assert big.value.status_code == 413 and "max_file_bytes" in big.value.message
    assert (r.hgetall("pgst:gw:storage:usage"), content_keys(r, "pgst:"), len(full.files.list().data)) == stored

    big = random_file(5 << 20)  # another tenant's room is its own; read back in chunks
    assert other.files.content(other.files.create(file=("big.jsonl", big), purpose="batch").id).content == big
    answer = other.chat.completions.create(model=settings.model, max_tokens=2,
                                           messages=[{"role": "user", "content": random_text(20)}])
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.usage.completion_tokens >= 1


def test_completion_results_count_in_the_quota_through_the_gateway(gateway, settings):
    spender, other = sdk(gateway, "sk-spender"), sdk(gateway, "sk-other")

    def ask(api: openai.OpenAI, stream: bool = False):
        return api.chat.completions.create(  # ~7 KB of result with its top logprobs: over the 4 KiB quota
            model=settings.model, max_tokens=24, logprobs=True, top_logprobs=5, temperature=0, stream=stream,
            messages=[{"role": "user", "content": random_text(30)}])
    for stream in (False, True):  # a blocking answer's result counts, and a streamed one's
        answer = ask(spender, stream)
        if stream:
            assert "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        time.sleep(ROOM_CACHE_S + 0.2)
        with pytest.raises(openai.RateLimitError) as over:
            ask(spender)
        assert over.value.code == "storage_quota_exceeded" and "max_stored_bytes" in over.value.message
        assert ask(other).choices[0].message.content  # nobody else is refused
        time.sleep(RESULT_TTL_S + RESULT_BUCKET_S)  # the result expired: the spender has room again


def test_batch_read_first_after_result_ttl_is_completed_with_its_output(gateway, settings):
    api = sdk(gateway, "sk-other")
    r = redis_client(settings.broker_url)
    names = Names.from_settings(settings)
    lines = [chat_line(f"line-{i}") for i in range(4)]
    file = api.files.create(file=("four.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    batch = api.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window="24h")
    job_ids = r.lrange(names.batch_jobs(batch.id), 0, -1)

    # Nobody reads the batch: the CPU worker's finalizer writes its files as its last job ends.
    queue_helpers.wait_until(lambda: r.hget(f"pgst:gw:batch:{batch.id}", "status"), TIMEOUT, 0.2,
                             "the batch to be finalized")
    queue_helpers.wait_until(lambda: not any(r.exists(names.job(j)) for j in job_ids), 3 * RESULT_TTL_S + 30,
                             0.2, "every job record to expire")

    done = api.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (4, 4, 0)
    output = [json.loads(ln) for ln in api.files.content(done.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in output] == [f"line-{i}" for i in range(4)]
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["usage"]["completion_tokens"] >= 1
               for x in output)
