"""The embedded redis-server is private: a password, no admin commands, files only its owner reads."""

from __future__ import annotations

import json
import os
import stat

import pytest
import redis as redis_py

from pagedq.pipeline.local.redis_server import RedisServer
from pagedq.store.connection import RUN_FILE, mask_url, running_embedded_url


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_embedded_redis_needs_its_password_and_refuses_admin_commands(tmp_path):
    data = tmp_path / "redis"
    with RedisServer(data) as server:
        anonymous = redis_py.Redis(host="127.0.0.1", port=server.port)
        with pytest.raises(redis_py.AuthenticationError):  # NOAUTH
            anonymous.get("x")
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(host="127.0.0.1", port=server.port, password="guess").ping()
        own = redis_py.Redis.from_url(server.url)
        assert own.ping()
        with pytest.raises(redis_py.ResponseError, match="unknown command"):
            own.execute_command("CONFIG", "SET", "dir", "/tmp")
        with pytest.raises(redis_py.ResponseError, match="unknown command"):
            own.execute_command("DEBUG", "SLEEP", "0")
        assert len(server.password) >= 32 and server.password not in " ".join(server.proc.args)
        assert mode(data) == 0o700
        for name in ("password", "redis.conf", RUN_FILE):
            assert mode(data / name) == 0o600, name
        assert running_embedded_url(data) == server.url
        port = server.port
    # Stopped: its run file is gone; a restart on the same data dir keeps the port and the password.
    assert running_embedded_url(data) is None
    with RedisServer(data) as again:
        assert again.port == port and redis_py.Redis.from_url(again.url).ping()


def test_a_stale_run_file_is_not_trusted(tmp_path):
    data = tmp_path / "redis"
    with RedisServer(data, write_run_file=False) as server:  # something answers on that port...
        data.joinpath(RUN_FILE).write_text(json.dumps({"url": server.url, "pid": 2**22 + 12345}))  # ...dead pid
        assert running_embedded_url(data) is None


def test_urls_are_masked_for_logs():
    assert mask_url("redis://:s3cret@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert mask_url("rediss://producer:pw@redis.example:6380/1") == "rediss://producer:***@redis.example:6380/1"
    assert mask_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
