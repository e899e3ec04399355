"""Connections to Redis, and finding the broker.

``broker_url()`` is ``PAGEDQ_BROKER_URL`` when set, else the URL of the
embedded redis-server that ``pagedq up`` (or ``run-batch``) runs on this
machine, read from the run file it keeps in its data dir.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool

from pagedq.config.settings import Settings

RUN_FILE = "redis.json"  # in the embedded server's data dir: {"url": ..., "pid": ...}


class BrokerNotFoundError(RuntimeError):
    pass


class BrokerUnavailable(ConnectionError):
    """The broker did not answer in time (down, restarting, paused); nothing was written, or the call may be
    retried."""


def tls_options(url: str, settings: Settings | None) -> dict:
    """redis-py's TLS arguments for a ``rediss://`` URL: certificates always verified (CERT_REQUIRED), against
    ``PAGEDQ_REDIS_CA_FILE`` (else the system's CAs), with a client certificate when one is configured."""
    if not url.startswith("rediss://"):
        return {}
    options: dict = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    if settings is not None:
        for key, value in (("ssl_ca_certs", settings.redis_ca_file), ("ssl_certfile", settings.redis_cert_file),
                           ("ssl_keyfile", settings.redis_key_file)):
            if value is not None:
                options[key] = str(value)
    return options


MAX_CONNECTIONS = 1024  # per client; a GPU worker runs hundreds of task threads, each may be in a call at once


@dataclass(frozen=True)
class SentinelAddress:
    """A Sentinel broker URL, in Celery's (and kombu's, and Flower's) form: one ``sentinel://`` URL per sentinel,
    joined with ``;``.  The user, password and db are the data nodes' (the master's), as kombu reads them."""

    sentinels: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    db: int


SENTINEL_PORT = 26379
SENTINEL_TIMEOUT_S = 1.0  # a sentinel that hangs is skipped after this, not waited on (redis/redis-py#1125)


def parse_sentinel_url(url: str) -> SentinelAddress | None:
    """The sentinels of a ``sentinel://...;sentinel://...`` URL, or None for a ``redis(s)://`` URL.  Every part
    must name the same user, password and db: kombu would silently use the first part's."""
    parts = [p.strip() for p in url.split(";") if p.strip()]
    sentinel = [p.startswith("sentinel://") for p in parts]
    if not any(sentinel):
        return None
    if not all(sentinel):
        raise ValueError("PAGEDQ_BROKER_URL: a sentinel:// URL lists sentinel:// URLs only, joined with ';'")
    hosts, creds = [], set()
    for part in parts:
        u = urlsplit(part)
        if not u.hostname:
            raise ValueError(f"PAGEDQ_BROKER_URL: no host in {mask_url(part)!r}")
        db = (u.path or "/0").strip("/") or "0"
        if not db.isdigit():
            raise ValueError(f"PAGEDQ_BROKER_URL: the db in {mask_url(part)!r} is not a number")
        hosts.append((u.hostname, u.port or SENTINEL_PORT))
        creds.add((unquote(u.username) if u.username else None, unquote(u.password) if u.password else None,
                   int(db)))
    if len(creds) > 1:
        raise ValueError("PAGEDQ_BROKER_URL: the sentinel:// URLs name different users, passwords or dbs")
    username, password, db = creds.pop()
    return SentinelAddress(tuple(hosts), username, password, db)


def sentinel_kwargs(settings: Settings | None, address: SentinelAddress) -> dict:
    """How to reach the sentinels themselves: their password (``PAGEDQ_REDIS_SENTINEL_PASSWORD``, else the
    URL's) and short timeouts."""
    secret = settings.redis_sentinel_password if settings is not None else None
    password = secret.get_secret_value() if secret is not None else address.password
    return {"password": password, "socket_timeout": SENTINEL_TIMEOUT_S,
            "socket_connect_timeout": SENTINEL_TIMEOUT_S}


class BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """A Sentinel-managed pool (each new connection asks the sentinels for the master; connections to a demoted
    master are dropped) that blocks for a free connection as ``redis_client``'s does."""


def master_name(settings: Settings | None) -> str:
    return settings.redis_master_name if settings is not None else "pagedq"


def redis_client(url: str, timeout_s: float | None = 30, settings: Settings | None = None) -> redis.Redis:
    """A client whose every call answers or raises within ``timeout_s`` (blocking reads wait less than that).

    Its pool blocks for a free connection (up to ``timeout_s``) instead of raising: redis-py's default pool
    raises ``MaxConnectionsError`` past 100 connections, which a worker's hundreds of task threads reach.
    With a ``sentinel://`` URL it talks to whichever node the sentinels name master of
    ``PAGEDQ_REDIS_MASTER_NAME``, and follows a failover (a call during one raises a ``ConnectionError``).
    """
    address = parse_sentinel_url(url)
    if address is not None:
        sentinels = Sentinel(address.sentinels, sentinel_kwargs=sentinel_kwargs(settings, address))
        return sentinels.master_for(
            master_name(settings), connection_pool_class=BlockingSentinelPool, max_connections=MAX_CONNECTIONS,
            timeout=timeout_s, decode_responses=True, health_check_interval=30, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry_on_timeout=False, socket_keepalive=True,
            username=address.username, password=address.password, db=address.db)
    pool = redis.BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=timeout_s, decode_responses=True, health_check_interval=30,
        socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False,
        **tls_options(url, settings))
    return redis.Redis(connection_pool=pool)


def ping(url: str, timeout: float = 1.0) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def mask_url(url: str) -> str:
    """The URL fit for a log line: ``redis://user:***@host:port/0`` (each part of a ``;``-joined Sentinel URL)."""
    if ";" in url:
        return ";".join(mask_url(part) for part in url.split(";"))
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, ValueError, TypeError):
        return False


def running_embedded_url(data_dir: Path) -> str | None:
    """The URL of a live embedded server using ``data_dir``, if there is one (its recorded process alive
    and answering with its password: a stale run file, or another program on that port, is not trusted)."""
    try:
        info = json.loads((Path(data_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    url = info.get("url", "")
    return url if _alive(info.get("pid")) and ping(url) else None


def broker_url(settings: Settings) -> str:
    """PAGEDQ_BROKER_URL, else a running embedded server's URL."""
    url = settings.broker_url or running_embedded_url(settings.redis_data_dir)
    if not url:
        raise BrokerNotFoundError("no broker: set PAGEDQ_BROKER_URL, or start one with `pagedq up`")
    return url
