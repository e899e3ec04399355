"""The local Sentinel topology (``pipeline/local/topology.py``) with real redis-servers and sentinels: a master,
a replica and three sentinels, all password-protected on 127.0.0.1; no model, no workers."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from queue_helpers import wait_until

from pagedq.config import Settings
from pagedq.pipeline.local.topology import CONFIG_NAME_FILE, Topology, quorum
from pagedq.store.connection import RUN_FILE, broker_url, redis_client


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def aof_bytes(data_dir: Path) -> bytes:
    return b"".join(p.read_bytes() for p in data_dir.glob("appendonly*") if p.is_file())


@pytest.fixture
def topology(tmp_path):
    """Started and healthy: the replica synced, each sentinel seeing it and the two others.  A short down-after,
    so a failover takes seconds."""
    topo = Topology(tmp_path / "redis", replicas=1, sentinels=3, down_after_ms=1000, failover_timeout_ms=5000)
    try:
        topo.start()
        topo.wait_healthy(30)
        yield topo
    finally:
        topo.stop()


def run_file(topo: Topology) -> dict:
    return json.loads((topo.data_dir / RUN_FILE).read_text())


def writes(r: redis.Redis, key: str, value: str) -> bool:
    try:
        r.set(key, value)
        return True
    except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
        return False  # a failover under way: no master named yet, or the old one's connection


def anonymous_ping(port: int) -> bytes:
    """A PING without a password, on a bare socket (redis-py retries an authentication error for seconds)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.sendall(b"PING\r\n")
        return sock.recv(256)


def role(node) -> list:
    return redis.Redis.from_url(node.url, socket_timeout=2, decode_responses=True).role()


def test_quorum_is_a_majority():
    assert [quorum(n) for n in (1, 2, 3, 5)] == [1, 2, 2, 3]


def test_the_topology_is_private_and_its_run_file_reaches_the_master(topology):
    info = run_file(topology)
    assert info["url"] == topology.url and info["url"].count("sentinel://") == 3
    assert info["master_name"] == "pagedq" and info["pid"] == os.getpid()
    assert set(info["pids"]) == {"node-0", "node-1", "sentinel-0", "sentinel-1", "sentinel-2"}
    r = redis_client(info["url"], timeout_s=5)
    key = f"k-{secrets.token_hex(4)}"
    r.set(key, "v")
    master = topology.nodes[0]
    assert redis.Redis.from_url(master.url, decode_responses=True).get(key) == "v", "written on node-0"
    assert role(master)[0] == "master" and role(topology.nodes[1])[0] == "slave"
    # Only the sentinels know CONFIG's name; a client gets "unknown command", and no password means nothing.
    for node in topology.nodes:
        with pytest.raises(redis.ResponseError, match="unknown command"):
            redis.Redis.from_url(node.url).execute_command("CONFIG", "GET", "dir")
    for part in [*topology.nodes, *topology.sentinel_servers]:
        assert anonymous_ping(part.port).startswith(b"-NOAUTH"), part.data_dir.name
    # Files only their owner reads; the password is on no command line.
    assert mode(topology.data_dir) == 0o700
    for path in topology.data_dir.rglob("*"):
        assert mode(path) == (0o700 if path.is_dir() else 0o600), path
    assert mode(topology.data_dir / CONFIG_NAME_FILE) == 0o600
    for part in [*topology.nodes, *topology.sentinel_servers]:
        assert topology.password not in " ".join(part.proc.args)
    r.close()


def test_kill_9_of_the_master_promotes_the_replica_and_the_old_master_returns_as_its_replica(topology):
    old, new = topology.nodes
    r = redis_client(topology.url, timeout_s=5)
    r.set("before", "1")
    assert r.wait(1, 5000) == 1
    # A key only the old master has: in its append-only file, never sent to the replica (REPL_AOF).
    only_old = f"only-old-{secrets.token_hex(4)}"
    script = "redis.replicate_commands(); redis.set_repl(redis.REPL_AOF); return redis.call('SET', KEYS[1], '1')"
    redis.Redis.from_url(old.url).eval(script, 1, only_old)
    assert redis.Redis.from_url(new.url).get(only_old) is None
    # appendfsync everysec may hold the write back while an earlier fsync runs (up to 2 s): wait for it in the file.
    wait_until(lambda: only_old.encode() in aof_bytes(old.data_dir), 5, interval=0.1, what="the key in the old AOF")
    os.kill(old.proc.pid, signal.SIGKILL)
    old.proc.wait(5)
    assert only_old.encode() in aof_bytes(old.data_dir)

    wait_until(lambda: writes(r, "after", "2"), 20, interval=0.2, what="a write through the sentinels")
    assert role(new)[0] == "master"
    wait_until(lambda: all(s.master() == ("127.0.0.1", new.port) for s in topology.sentinel_servers), 10,
               interval=0.2, what="every sentinel to name the new master")
    assert r.get("before") == "1" and r.get("after") == "2"

    topology.start()  # restarts what is down: the old master, as a replica of the new one
    wait_until(lambda: role(old)[:4] == ["slave", "127.0.0.1", new.port, "connected"], 15, interval=0.2,
               what="the old master to sync as a replica of the new one")
    back = redis.Redis.from_url(old.url, decode_responses=True)
    assert back.get("after") == "2" and back.get(only_old) is None, "resynced: what only it had is gone"
    assert json.loads((topology.data_dir / "topology.json").read_text()) == {"master": "node-1"}
    r.close()


def test_a_new_client_connects_with_the_first_listed_sentinel_dead(topology):
    first = topology.sentinel_servers[0]
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait(5)
    r = redis_client(run_file(topology)["url"], timeout_s=5)
    r.set("k", "v")
    assert r.get("k") == "v"
    r.close()


def test_pagedq_up_with_replicas_and_sentinels_runs_the_topology_and_stops_it(tmp_path):
    """``pagedq up --replicas 1 --sentinels 3`` without workers: the sentinel URL in the run file reaches the
    master; SIGTERM stops every server and removes the run file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    env["PAGEDQ_STATE_DIR"] = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "pagedq.pipeline.cli", "up", "--replicas", "1", "--sentinels",
                             "3", "--gpu-workers", "0", "--cpu-workers", "0"], env=env, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    data = tmp_path / "redis"
    try:
        line = proc.stderr.readline()
        while line and "pagedq up: broker" not in line:
            line = proc.stderr.readline()
        assert "broker sentinel://:***@127.0.0.1:" in line, line
        info = json.loads((data / RUN_FILE).read_text())
        r = redis_client(info["url"], timeout_s=5, settings=Settings(state_dir=tmp_path))
        assert r.ping() and r.role()[0] == "master"
        # Another process of the same user (`pagedq submit`, a second `pagedq up`) finds the topology.
        assert broker_url(Settings(state_dir=tmp_path)) == info["url"]
        r.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not (data / RUN_FILE).exists()
    for pid in info["pids"].values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
