"""The smaller holes between tenants, closed (issue 48): a reserved tenant name, keys never in argv, no prompt
text in task arguments, a keyless app refusing non-loopback connections, control nonces global."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import subprocess
import sys
import time

import httpx
import pytest

from pagedq.config import Settings
from pagedq.config.messages import Completion, PreprocessJob
from pagedq.config.names import Names
from pagedq.config.scheduling import SchedulingMeta
from pagedq.pipeline.gateway.app import create_app, reached_from_outside
from pagedq.pipeline.gateway.config import GatewayConfig
from pagedq.pipeline.gateway.keys import KeyRing, KeysFileError, hash_key
from pagedq.store import control

WORDS = "amber falcon granite willow sapphire tundra cobalt juniper".split()


def secret_text(n: int = 12) -> str:
    return " ".join(random.choice(WORDS) for _ in range(n)) + f" {secrets.token_hex(4)}"


def test_default_is_reserved_in_the_keys_file(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [{"sha256": hash_key(secrets.token_hex(8)), "tenant": "default"}]}))
    with pytest.raises(KeysFileError, match="reserved"):
        KeyRing.load(path)
    path.write_text(json.dumps({"keys": [{"sha256": hash_key(secrets.token_hex(8)), "tenant": "team-x",
                                          "cache_group": "team"}]}))
    assert KeyRing.load(path).tenants()[0].cache_scope == "group:team"


def _keys_helper(args: list[str], stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedq.pipeline.gateway.keys", *args], input=stdin,
                          capture_output=True, text=True, timeout=60)


def test_the_keys_helper_reads_the_key_from_stdin_or_a_file_never_argv(tmp_path):
    key = f"sk-{secrets.token_hex(12)}"
    piped = _keys_helper([], key)
    assert piped.returncode == 0 and json.loads(piped.stdout)["sha256"] == hash_key(key)
    (tmp_path / "key").write_text(key + "\n")
    from_file = _keys_helper(["--file", str(tmp_path / "key")])
    assert json.loads(from_file.stdout)["sha256"] == hash_key(key)
    in_argv = _keys_helper([key])
    assert in_argv.returncode == 2 and hash_key(key) not in in_argv.stdout and "stdin" in in_argv.stderr


def test_task_arguments_carry_no_prompt_or_completion_text():
    prompt, answer = secret_text(), secret_text()
    chat = PreprocessJob("j1", "/v1/chat/completions", {"model": "m", "priority": 5, "messages": [
        {"role": "system", "content": secret_text()}, {"role": "user", "content": prompt}]},
        SchedulingMeta(tenant="team-a"))
    text = PreprocessJob("j2", "/v1/completions", {"model": "m", "prompt": prompt})
    done = Completion("j1", "chat", "m", answer, [random.randrange(9) for _ in range(5)], 7, "stop")
    for shown, secret in ((chat.describe(), prompt), (text.describe(), prompt), (done.describe(), answer)):
        assert not any(word in shown for word in secret.split()), shown
    assert "job=j1" in chat.describe() and "tenant=team-a" in chat.describe() and "2 messages" in chat.describe()
    assert f"{len(prompt)} chars" in text.describe() and "completion_tokens=5" in done.describe()


def test_a_keyless_app_refuses_connections_to_a_non_loopback_address(redis_url, tmp_path):
    settings = Settings(broker_url=redis_url, key_prefix=f"pth{secrets.token_hex(3)}:", queue_prefix="pth.")
    outside = f"10.{random.randrange(256)}.{random.randrange(256)}.{random.randrange(1, 255)}"
    assert reached_from_outside(outside) and reached_from_outside("::ffff:8.8.8.8")
    assert not any(reached_from_outside(h) for h in ("127.0.0.1", "::1", "[::1]", "::ffff:127.0.0.1", "testserver"))
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hash_key("sk-x"), "tenant": "team-x"}]}))

    async def get(app, host: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}") as http:
            return await http.get("/v1/models")
    keyless = create_app(settings, redis_url, GatewayConfig())
    refused = asyncio.run(get(keyless, outside))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "no_api_keys"
    assert asyncio.run(get(keyless, "127.0.0.1")).status_code == 200
    keyed = create_app(settings, redis_url, GatewayConfig(api_keys_file=keys))
    assert asyncio.run(get(keyed, outside)).status_code == 401  # served, and asks for a key


def test_a_control_message_replayed_to_a_worker_started_since_is_ignored(redis, tmp_path):
    names = Names(f"pth{secrets.token_hex(3)}:", "pth.")
    key = control.ControlKey(redis, names, None)
    raw = control.sign(key.get(), "reload", model=f"m{secrets.token_hex(3)}")
    assert control.ControlReceiver(redis, names, key, "gpu-1").accept(raw)["op"] == "reload"
    assert control.ControlReceiver(redis, names, key, "gpu-2").accept(raw)["op"] == "reload", "a broadcast"
    first = names.control_first_seen(json.loads(raw)["nonce"])
    redis.set(first, int(time.time()) - control.DELIVERY_WINDOW_S - 1, keepttl=True)  # captured a while ago
    with pytest.raises(ValueError, match="replayed"):
        control.ControlReceiver(redis, names, key, f"gpu-new-{secrets.token_hex(2)}").accept(raw)
    assert 0 < redis.ttl(first) <= control.SEEN_TTL_S


def test_a_large_upload_is_written_into_redis_in_chunks_whole(redis_url):
    """Over WRITE_CHUNK, a file goes through its staging key chunk by chunk (no single SET holds Redis for a
    whole 64 MiB copy) and reads back byte for byte, counted once in the tenant's room; the staging key is gone."""
    from pagedq.pipeline.gateway.files import WRITE_CHUNK
    from pagedq.pipeline.gateway.keys import Tenant
    from pagedq.pipeline.gateway.state import Gateway

    settings = Settings(broker_url=redis_url, key_prefix=f"pth{secrets.token_hex(3)}:", queue_prefix="pth.")
    gw = Gateway(settings, redis_url, GatewayConfig())
    try:
        tenant = Tenant(f"t{secrets.token_hex(2)}")
        content = random.randbytes(2 * WRITE_CHUNK + random.randrange(1, WRITE_CHUNK))

        def appends() -> int:
            return int(gw.r.info("commandstats").get("cmdstat_append", {}).get("calls", 0))
        before = appends()
        made = gw.files.create(tenant, "in.jsonl", "batch", content)
        assert appends() - before >= 3, "written in three chunks"
        size, chunks = gw.files.content_chunks(made["id"], tenant)
        assert size == made["bytes"] == len(content) and b"".join(chunks) == content
        assert gw.files.usage(tenant) == (len(content), 1)
        assert not gw.raw.exists(gw.keys.file_staging(made["id"]))
    finally:
        gw.close()
