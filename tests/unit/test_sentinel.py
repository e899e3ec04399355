"""Sentinel broker URLs (``store/connection.py``): parsing in Celery's form, and a client that follows a failover,
against real redis-servers (a master, a replica, a sentinel; passwords on all three, the sentinel's its own)."""

from __future__ import annotations

import secrets
import signal
import subprocess
from pathlib import Path

import pytest
import redis
from queue_helpers import wait_until

from pagedq.config import Settings
from pagedq.pipeline.local.redis_server import find_redis_server
from pagedq.store.connection import (
    SENTINEL_PORT,
    SentinelAddress,
    mask_url,
    parse_sentinel_url,
    redis_client,
    sentinel_kwargs,
)
from pagedq.workers.processes import free_port


def test_a_sentinel_url_names_every_sentinel_and_the_data_nodes_credentials():
    pw = secrets.token_urlsafe(12)
    url = f"sentinel://:{pw}@127.0.0.1:26380/2;sentinel://:{pw}@10.0.0.7/2; sentinel://:{pw}@[::1]:26390/2"
    assert parse_sentinel_url(url) == SentinelAddress(
        (("127.0.0.1", 26380), ("10.0.0.7", SENTINEL_PORT), ("::1", 26390)), None, pw, 2)
    assert parse_sentinel_url(f"sentinel://ops:{pw}@h1") == SentinelAddress((("h1", SENTINEL_PORT),), "ops", pw, 0)
    assert parse_sentinel_url(f"redis://:{pw}@127.0.0.1:6379/0") is None
    assert pw not in mask_url(url) and mask_url(url).count("***") == 3
    settings = Settings(redis_sentinel_password="sentinels-own")
    assert sentinel_kwargs(settings, parse_sentinel_url(url))["password"] == "sentinels-own"
    assert sentinel_kwargs(None, parse_sentinel_url(url))["password"] == pw


@pytest.mark.parametrize("url, what", [
    ("sentinel://:a@h1:26379/0;sentinel://:b@h2:26379/0", "different"),
    ("sentinel://:a@h1:26379/0;sentinel://:a@h2:26379/1", "different"),
    ("sentinel://:a@h1:26379/0;redis://:a@h2:6379/0", "sentinel:// URLs only"),
    ("sentinel://:a@:26379/0", "no host"),
    ("sentinel://:a@h1:26379/x", "not a number"),
])
def test_a_bad_sentinel_url_is_refused_naming_what_is_wrong(url, what):
    with pytest.raises(ValueError, match=what) as e:
        parse_sentinel_url(url)
    assert "PAGEDQ_BROKER_URL" in str(e.value) and ":a@" not in str(e.value)


class Node:
    """One redis-server process from a config file (``--sentinel`` for a sentinel)."""

    def __init__(self, workdir: Path, name: str, lines: list[str], sentinel: bool = False) -> None:
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        conf = workdir / f"{name}.conf"
        conf.write_text("\n".join([f"port {self.port}", "bind 127.0.0.1", f"dir {workdir}", "save \"\"",
                                   "appendonly no", *lines]) + "\n")
        conf.chmod(0o600)
        self.proc = subprocess.Popen([find_redis_server(), str(conf), *(["--sentinel"] if sentinel else [])],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def topology(tmp_path):
    data_pw, sentinel_pw = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    master = Node(tmp_path / "m", "master", [f"requirepass {data_pw}", f"masterauth {data_pw}"])
    wait_until(lambda: _pings(master.port, data_pw), 15, what="the master up")
    replica = Node(tmp_path / "r", "replica", [f"requirepass {data_pw}", f"masterauth {data_pw}",
                                               f"replicaof 127.0.0.1 {master.port}"])
    sentinel = Node(tmp_path / "s", "sentinel", [
        f"requirepass {sentinel_pw}", f"sentinel monitor pagedq 127.0.0.1 {master.port} 1",
        f"sentinel auth-pass pagedq {data_pw}", "sentinel down-after-milliseconds pagedq 1000",
        "sentinel failover-timeout pagedq 5000"], sentinel=True)
    nodes = [master, replica, sentinel]
    try:
        wait_until(lambda: _pings(sentinel.port, sentinel_pw), 15, what="the sentinel up")
        yield master, replica, sentinel, data_pw, sentinel_pw
    finally:
        for node in nodes:
            node.kill()


def _pings(port: int, password: str) -> bool:
    try:
        return bool(redis.Redis(port=port, password=password, socket_timeout=1).ping())
    except redis.RedisError:
        return False


def test_a_client_on_a_sentinel_url_writes_to_the_master_and_follows_a_failover(topology):
    master, replica, sentinel, data_pw, sentinel_pw = topology
    settings = Settings(redis_sentinel_password=sentinel_pw)
    url = f"sentinel://:{data_pw}@127.0.0.1:{sentinel.port}/0"
    r = redis_client(url, timeout_s=5, settings=settings)
    key, value = f"k-{secrets.token_hex(4)}", secrets.token_hex(8)
    r.set(key, value)
    assert redis.Redis(port=master.port, password=data_pw, decode_responses=True).get(key) == value
    wait_until(lambda: r.wait(1, 1000) >= 1, 30, what="the replica to acknowledge the write")
    master.kill()  # kill -9

    def written_after_failover() -> bool:
        try:
            r.set(f"{key}-after", value)
            return True
        except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
            return False  # the failover is under way: the sentinels have not named a new master yet

    wait_until(written_after_failover, 60, interval=0.2, what="a write after the failover")
    new = redis.Redis(port=replica.port, password=data_pw, decode_responses=True)
    assert new.info("replication")["role"] == "master"
    assert new.get(key) == value and new.get(f"{key}-after") == value
    assert r.get(key) == value
