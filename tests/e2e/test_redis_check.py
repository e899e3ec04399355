"""An existing Redis is verified before a component starts: real redis-server processes configured the ways
shared instances are (an evicting maxmemory-policy, Cluster mode, ACL users), and the real `pagedq` commands
against them.  No model is loaded: the check runs first, and refuses in a second or two."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis
from test_security import acl_file_from_example

from pagedq.config import Settings
from pagedq.pipeline.local.redis_server import RedisServer, find_redis_server
from pagedq.pipeline.local.topology import Topology
from pagedq.store.connection import ping
from pagedq.store.redis_check import MIN_VERSION, RedisUnsuitable, ServerFacts, refusal, verify_broker
from pagedq.workers.processes import free_port, spawn, stop


def cluster_port() -> int:
    """A free port a cluster-mode redis-server can take: at most 55535 (its cluster bus listens 10,000 higher,
    and must be free too); ``free_port`` alone may give one above."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


@contextmanager
def redis_with(tmp_path: Path, *directives: str, port: int | None = None) -> Iterator[str]:
    """A password-protected redis-server with these extra redis.conf lines (on ``port``, default any free one);
    yields its URL."""
    data = tmp_path / f"redis-{secrets.token_hex(4)}"
    data.mkdir()
    password, port = secrets.token_hex(16), port or free_port()
    conf = data / "redis.conf"
    conf.write_text("\n".join([f"port {port}", "bind 127.0.0.1", f"dir {data}", f"requirepass {password}",
                               'save ""', *directives]) + "\n")
    proc = spawn([find_redis_server(), str(conf)], data / "redis.log")
    url = f"redis://:{password}@127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 15
        while not ping(url, 0.2):
            assert proc.poll() is None and time.monotonic() < deadline, (data / "redis.log").read_text()
            time.sleep(0.05)
        yield url
    finally:
        stop(proc, 10)


def pagedq_exits(url: str, state_dir: Path, *argv: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    env.update(PAGEDQ_BROKER_URL=url, PAGEDQ_STATE_DIR=str(state_dir))
    return subprocess.Popen([sys.executable, "-m", "pagedq.pipeline.cli", *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def one_error_line(proc: subprocess.Popen) -> str:
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the command did not exit: the check did not refuse the server") from None
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: broker: "), (proc.args, err)
    return lines[0]


COMMANDS = [("worker",), ("cpu-worker",), ("serve", "--port", "0"), ("up",), ("run-batch", "-i", __file__, "-o", "-")]


def test_an_evicting_redis_is_refused_by_each_command_with_one_line(tmp_path):
    with redis_with(tmp_path, "maxmemory 64mb", "maxmemory-policy allkeys-lru") as url:
        started = time.monotonic()
        procs = [pagedq_exits(url, tmp_path / "state", *argv) for argv in COMMANDS]  # side by side: ~2 s
        for argv, proc in zip(COMMANDS, procs, strict=True):
            line = one_error_line(proc)
            assert "maxmemory-policy is allkeys-lru" in line and "CONFIG SET maxmemory-policy noeviction" in line, \
                (argv, line)
        assert time.monotonic() - started < 60  # refused before any model is loaded
        with pytest.raises(RedisUnsuitable, match="maxmemory-policy is allkeys-lru"):
            verify_broker(url, Settings())
        redis.Redis.from_url(url).config_set("maxmemory-policy", "noeviction")  # the fix the line names
        facts = verify_broker(url, Settings())
        assert facts.maxmemory_policy == "noeviction" and facts.version >= MIN_VERSION


def test_a_volatile_policy_is_refused_too(tmp_path):
    with redis_with(tmp_path, "maxmemory-policy volatile-ttl") as url:
        with pytest.raises(RedisUnsuitable, match="maxmemory-policy is volatile-ttl"):
            verify_broker(url, Settings())


def test_a_cluster_mode_server_is_refused_with_one_line(tmp_path):
    with redis_with(tmp_path, "cluster-enabled yes", "cluster-config-file nodes.conf",
                    "maxmemory-policy noeviction", port=cluster_port()) as url:
        line = one_error_line(pagedq_exits(url, tmp_path / "state", "worker"))
        assert "Redis Cluster is not supported" in line and "cluster_enabled:1" in line and "Sentinel" in line


def test_pagedqs_own_server_and_the_acl_examples_users_pass(tmp_path, redis_url):
    """The suite's server (CONFIG disabled, as every pagedq-started one) passes; so do the ACL example's users,
    each for its role: a producer is refused as a consumer, naming BRPOP, and a user without INFO is refused
    naming it."""
    assert verify_broker(redis_url, Settings()).maxmemory_policy == "noeviction"
    acl, producer_pw, worker_pw = acl_file_from_example(tmp_path)
    with open(acl, "a") as f:
        f.write(f"user no-info on >{worker_pw} allchannels ~pagedq:* +@all -@admin -@dangerous\n")
    with RedisServer(tmp_path / "acl", write_run_file=False, acl_file=acl,
                     acl_user=("pagedq-worker", worker_pw)) as server:
        base = f"127.0.0.1:{server.port}/0"
        verify_broker(f"redis://pagedq-worker:{worker_pw}@{base}", Settings(), consumer=True)
        verify_broker(f"redis://pagedq-producer:{producer_pw}@{base}", Settings(), consumer=False)
        with pytest.raises(RedisUnsuitable, match=r"pop queue messages \(BRPOP\).*\+brpop"):
            verify_broker(f"redis://pagedq-producer:{producer_pw}@{base}", Settings(), consumer=True)
        with pytest.raises(RedisUnsuitable, match=r"may not run INFO.*\+info"):
            verify_broker(f"redis://no-info:{worker_pw}@{base}", Settings())
        with pytest.raises(RedisUnsuitable, match=r"key prefix 'other:'.*~other:\*"):
            verify_broker(f"redis://pagedq-worker:{worker_pw}@{base}", Settings(key_prefix="other:"))
        line = one_error_line(pagedq_exits(f"redis://pagedq-worker:wrong-{worker_pw}@{base}", tmp_path, "worker"))
        assert "refused the password" in line and worker_pw not in line


def test_the_minimum_version_is_named():
    assert "Redis 6.0.16 is too old: pagedq needs 6.2.0 or later" in refusal(ServerFacts((6, 0, 16), "noeviction",
                                                                                       False))
    assert refusal(ServerFacts((6, 2, 0), "noeviction", False)) is None


def test_a_sentinel_url_is_followed_to_the_master_and_checked_there(tmp_path):
    topo = Topology(tmp_path / "redis", replicas=1, sentinels=1)
    try:
        url = topo.start()
        assert url.startswith("sentinel://")
        facts = verify_broker(url, Settings())
        assert facts.maxmemory_policy == "noeviction" and not facts.cluster_enabled
    finally:
        topo.stop()
