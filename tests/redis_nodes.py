"""Real redis-server processes from config files, for tests of replicas and sentinels."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import redis
from queue_helpers import wait_until

from pagedq.pipeline.local.redis_server import find_redis_server
from pagedq.workers.processes import free_port


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

    def pause(self) -> None:
        """SIGSTOP: it answers nothing (a replica then acknowledges nothing) until ``resume``."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one too
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)


def pings(port: int, password: str) -> bool:
    try:
        return bool(redis.Redis(port=port, password=password, socket_timeout=1).ping())
    except redis.RedisError:
        return False




def replica_synced(port: int, password: str) -> bool:
    try:
        info = redis.Redis(port=port, password=password, socket_timeout=1).info("replication")
    except redis.RedisError:
        return False
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


@contextlib.contextmanager
def master_and_replica(workdir: Path) -> Iterator[tuple[Node, Node, str]]:
    """A password-protected master and one synced replica of it: (master, replica, password)."""
    pw = secrets.token_urlsafe(16)
    master = Node(workdir / "m", "master", [f"requirepass {pw}", f"masterauth {pw}"])
    nodes = [master]
    try:
        wait_until(lambda: pings(master.port, pw), 15, what="the master up")
        replica = Node(workdir / "r", "replica", [f"requirepass {pw}", f"masterauth {pw}",
                                                  f"replicaof 127.0.0.1 {master.port}"])
        nodes.append(replica)
        wait_until(lambda: replica_synced(replica.port, pw), 30, interval=0.1, what="the replica synced")
        yield master, replica, pw
    finally:
        for node in nodes:
            node.kill()
