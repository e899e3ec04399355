"""A local Redis HA topology: one master, N replicas and M sentinels from the embedded redis-server binary.

``pagedq up --replicas 1 --sentinels 3`` runs it (``ensure_topology``); tests and chaos runs use ``Topology``.
Its files live under the redis data dir: ``node-0``, ``node-1``, ... (data nodes; node-0 is the first
master) and ``sentinel-0``, ... (sentinels), beside the run file ``redis.json``.

Invariants:
- Everything listens on 127.0.0.1 only, and every part (data nodes and sentinels) requires the one password
  of the data dir's ``password`` file (the embedded ``RedisServer``'s).  Dirs are 0700, files 0600, and no
  secret is ever on a command line.
- CONFIG is renamed on the data nodes to a random secret (``config-name``), which the sentinels are given
  (``sentinel rename-command``): a failover runs ``CONFIG REWRITE`` inside a MULTI, which a disabled CONFIG
  would abort.  Clients cannot call it; DEBUG and MODULE stay disabled.
- A sentinel's config file is written only when absent: Sentinel rewrites it (epochs, known replicas, the
  current master), and that state must survive a restart.
- A node never starts as a second master: ``start`` asks a live sentinel for the master first, and every other
  node starts as its replica (a returning old master is resynced, and loses what only it had).  With no
  sentinel alive, the node recorded as master last (``topology.json``) starts as master.
- The run file names the sentinel URL, the owner's pid and every server's pid, so other pagedq processes of
  the same user find the broker (``broker_url()``).  Stop order: sentinels (no failover during a planned
  stop), replicas, then the master.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from urllib.parse import quote

import redis

from pagedq.config.settings import Settings
from pagedq.store.connection import RUN_FILE, BrokerNotFoundError
from pagedq.workers.processes import free_port, spawn, stop

from .redis_server import (
    PORT_FILE,
    RedisServer,
    ensure_running,
    find_redis_server,
    private_dir,
    write_private,
)

log = logging.getLogger(__name__)

CONFIG_NAME_FILE = "config-name"  # the secret CONFIG is renamed to on the data nodes
TOPOLOGY_FILE = "topology.json"  # {"master": "node-1"}: the node that was master when last seen
SENTINEL_CONF = "sentinel.conf"
Address = tuple[str, int]


def quorum(sentinels: int) -> int:
    """Sentinels that must agree the master is down: a majority (2 of 3)."""
    return sentinels // 2 + 1


def _secret(path: Path) -> str:
    """The secret in ``path``, made (0600) on first use."""
    if not path.is_file():
        write_private(path, secrets.token_urlsafe(32))
    return path.read_text().strip()


def _running(proc: Popen | None) -> bool:
    return proc is not None and proc.poll() is None


@dataclass
class SentinelServer:
    """One ``redis-server --sentinel`` watching ``master_name``; its port is kept in its dir across restarts."""

    data_dir: Path
    password: str = field(repr=False)  # never in a log line
    config_name: str = field(repr=False)
    master_name: str
    quorum: int
    down_after_ms: int
    failover_timeout_ms: int
    port: int | None = None
    proc: Popen | None = None

    def __post_init__(self) -> None:
        try:
            self.port = self.port or int((self.data_dir / PORT_FILE).read_text())
        except (OSError, ValueError):
            pass

    def client(self, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=timeout,
                           socket_connect_timeout=timeout, decode_responses=True)

    def _write_conf(self, master: Address) -> Path:
        """Written once: afterwards the file is Sentinel's own (it records failovers there)."""
        path = self.data_dir / SENTINEL_CONF
        if path.is_file():
            return path
        name, pw = self.master_name, self.password
        lines = ["bind 127.0.0.1", "protected-mode yes", f"dir {self.data_dir}", "daemonize no",
                 f"requirepass {pw}", f"sentinel sentinel-pass {pw}",
                 f"sentinel monitor {name} {master[0]} {master[1]} {self.quorum}", f"sentinel auth-pass {name} {pw}",
                 f"sentinel down-after-milliseconds {name} {self.down_after_ms}",
                 f"sentinel failover-timeout {name} {self.failover_timeout_ms}", f"sentinel parallel-syncs {name} 1",
                 f"sentinel rename-command {name} CONFIG {self.config_name}"]
        write_private(path, "\n".join(lines) + "\n")
        return path

    def start(self, master: Address, timeout: float = 15) -> None:
        private_dir(self.data_dir)
        conf = self._write_conf(master)
        for _ in range(5):  # a free port can be taken between our probe and the sentinel binding it
            self.port = self.port or free_port()
            self.proc = spawn([find_redis_server(), str(conf), "--sentinel", "--port", str(self.port)],
                              self.data_dir / "sentinel.log", umask=0o077)
            if self._wait_ready(timeout):
                write_private(self.data_dir / PORT_FILE, str(self.port))
                return
            stop(self.proc, 5)
            self.port = None
        raise BrokerNotFoundError(f"redis sentinel did not start; see {self.data_dir / 'sentinel.log'}")

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if self.client(0.2).ping():
                    return True
            except (redis.RedisError, OSError):
                time.sleep(0.05)
        return False

    def master(self) -> Address | None:
        """The master this sentinel names now, or None if it does not answer."""
        if not self.port:
            return None
        try:
            addr = self.client(0.5).sentinel_get_master_addr_by_name(self.master_name)
        except (redis.RedisError, OSError):
            return None
        return (addr[0], int(addr[1])) if addr else None

    def stop(self, timeout: float = 15) -> None:
        if self.proc is not None:
            stop(self.proc, timeout)  # SIGTERM; its config file is already current
            self.proc = None


@dataclass
class Topology:
    """``replicas`` + 1 data nodes and ``sentinels`` sentinels under ``data_dir``; ``start()`` returns the
    sentinel URL (``sentinel://:PW@127.0.0.1:P1/0;sentinel://...``), for ``PAGEDQ_BROKER_URL``."""

    data_dir: Path
    replicas: int = 1
    sentinels: int = 3
    master_name: str = "pagedq"
    down_after_ms: int = 2000
    failover_timeout_ms: int = 10000
    appendfsync: str = "everysec"
    maxmemory: int = 0
    password: str = field(init=False, repr=False)  # one for every part: the data dir's (the embedded server's)
    config_name: str = field(init=False, repr=False)  # what CONFIG is renamed to on the data nodes
    nodes: list[RedisServer] = field(init=False)
    sentinel_servers: list[SentinelServer] = field(init=False)

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.sentinels < 1:
            raise ValueError("a Sentinel topology needs at least one replica and one sentinel")
        self.data_dir = private_dir(Path(self.data_dir))
        self.password = RedisServer(self.data_dir, write_run_file=False).password
        self.config_name = f"config-{_secret(self.data_dir / CONFIG_NAME_FILE)}"
        self.nodes = [self._node(i) for i in range(self.replicas + 1)]
        self.sentinel_servers = [
            SentinelServer(self.data_dir / f"sentinel-{i}", self.password, self.config_name, self.master_name,
                           quorum(self.sentinels), self.down_after_ms, self.failover_timeout_ms)
            for i in range(self.sentinels)]

    def _node(self, i: int) -> RedisServer:
        node_dir = private_dir(self.data_dir / f"node-{i}")
        write_private(node_dir / "password", self.password)  # one password for every part
        return RedisServer(node_dir, write_run_file=False, appendfsync=self.appendfsync, maxmemory=self.maxmemory,
                           config_name=self.config_name)

    @property
    def url(self) -> str:
        pw = quote(self.password, safe="")
        return ";".join(f"sentinel://:{pw}@127.0.0.1:{s.port}/0" for s in self.sentinel_servers)

    def sentinel_master(self) -> Address | None:
        """The master as the first sentinel that answers names it."""
        return next((addr for s in self.sentinel_servers if (addr := s.master()) is not None), None)

    def node_at(self, port: int) -> RedisServer | None:
        return next((n for n in self.nodes if n.port == port), None)

    def _recorded_master(self) -> RedisServer:
        try:
            name = json.loads((self.data_dir / TOPOLOGY_FILE).read_text())["master"]
            return next(n for n in self.nodes if n.data_dir.name == name)
        except (OSError, ValueError, KeyError, StopIteration):
            return self.nodes[0]

    def _record_master(self, node: RedisServer) -> None:
        write_private(self.data_dir / TOPOLOGY_FILE, json.dumps({"master": node.data_dir.name}))

    def start(self, timeout: float = 15) -> str:
        """Start every part that is not running (all of them, or one that was killed) and return the URL.

        The master is the one a live sentinel names, else the recorded one; it starts first, if it is down,
        and every other node starts as its replica."""
        try:
            addr = self.sentinel_master()
            master = self.node_at(addr[1]) if addr else self._recorded_master()
            if master is None:  # the sentinels name a server that is not ours: refuse rather than split
                raise BrokerNotFoundError(f"the sentinels name master {addr}, which is no node of {self.data_dir}")
            if not _running(master.proc):  # the master by the sentinels' word, or by the record
                master.replica_of = None
                master.start(timeout)
            master_addr = addr or ("127.0.0.1", master.port)
            for node in self.nodes:
                if node is not master and not _running(node.proc):
                    node.replica_of = master_addr
                    node.start(timeout)
            for sentinel in self.sentinel_servers:
                if not _running(sentinel.proc):
                    sentinel.start(master_addr, timeout)
            self._record_master(master)
            self._write_run_file()
        except BaseException:
            self.stop()
            raise
        log.info("redis topology: %d data nodes, %d sentinels, master %s:%d (data in %s)", len(self.nodes),
                 len(self.sentinel_servers), *master_addr, self.data_dir)
        return self.url

    def _write_run_file(self) -> None:
        pids = {n.data_dir.name: n.proc.pid for n in [*self.nodes, *self.sentinel_servers] if _running(n.proc)}
        write_private(self.data_dir / RUN_FILE, json.dumps({"url": self.url, "pid": os.getpid(), "pids": pids,
                                                            "master_name": self.master_name}))

    def stop(self, timeout: float = 15) -> None:
        """Sentinels first (no failover during a planned stop), then the replicas, then the master (recorded
        for the next start)."""
        (self.data_dir / RUN_FILE).unlink(missing_ok=True)
        for sentinel in self.sentinel_servers:
            sentinel.stop(timeout)
        masters = [n for n in self.nodes if _running(n.proc) and _role(n) == "master"]
        if masters:
            self._record_master(masters[0])
        for node in sorted(self.nodes, key=lambda n: n in masters):
            node.stop(timeout)

    def healthy(self) -> bool:
        """Every replica synced, and every sentinel sees the master, every replica and the other sentinels
        (only then can it vote for, and carry out, a failover)."""
        if not all(_running(s.proc) for s in self.sentinel_servers):
            return False
        for sentinel in self.sentinel_servers:
            try:
                client = sentinel.client()
                seen = client.sentinel_master(self.master_name)
                replicas = client.sentinel_slaves(self.master_name)
            except (redis.RedisError, OSError):
                return False
            ok = [r for r in replicas if r.get("master-link-status") == "ok" and not r.get("is_sdown")
                  and not r.get("is_disconnected")]
            if (seen.get("is_sdown") or len(ok) < self.replicas
                    or seen.get("num-other-sentinels", 0) < self.sentinels - 1):
                return False
        return True

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the redis topology in {self.data_dir} is not healthy after {timeout} s")
            time.sleep(0.1)

    def __enter__(self) -> Topology:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _role(node: RedisServer) -> str | None:
    try:
        return redis.Redis.from_url(node.url, socket_timeout=2).role()[0].decode()
    except (redis.RedisError, OSError, IndexError):
        return None


def ensure_topology(settings: Settings, replicas: int, sentinels: int, down_after_ms: int = 2000):
    """``ensure_running`` with a topology of one master, ``replicas`` and ``sentinels``."""
    return ensure_running(settings, lambda: Topology(
        settings.redis_data_dir, replicas, sentinels, settings.redis_master_name, down_after_ms,
        appendfsync=settings.redis_appendfsync, maxmemory=settings.redis_maxmemory))
