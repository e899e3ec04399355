"""Connections to Redis, and finding the broker.

``broker_url()`` is ``PAGEDQ_BROKER_URL`` when set, else the URL of the
embedded redis-server that ``pagedq up`` (or ``run-batch``) runs on this
machine, read from the run file it keeps in its data dir.
"""

from __future__ import annotations

import json
from pathlib import Path

import redis

from pagedq.config.settings import Settings

RUN_FILE = "redis.json"  # in the embedded server's data dir: {"url": ..., "pid": ...}


class BrokerNotFoundError(RuntimeError):
    pass


class BrokerUnavailable(ConnectionError):
    """The broker did not answer in time (down, restarting, paused); nothing was written, or the call may be
    retried."""


def redis_client(url: str, timeout_s: float | None = 30) -> redis.Redis:
    """A client whose every call answers or raises within ``timeout_s`` (blocking reads wait less than that)."""
    return redis.Redis.from_url(url, decode_responses=True, health_check_interval=30, socket_timeout=timeout_s,
                                socket_connect_timeout=timeout_s, retry_on_timeout=False)


def ping(url: str, timeout: float = 1.0) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


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
