"""Connections to Redis, and finding the broker.

``broker_url()`` is ``PAGEDQ_BROKER_URL`` when set, else the URL of the
embedded redis-server that ``pagedq up`` (or ``run-batch``) runs on this
machine, read from the run file it keeps in its data dir.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import kombu.exceptions
import redis
import redis.asyncio as aredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.sentinel import Sentinel, SentinelConnectionPool

from pagedq.config.sentinel import SentinelAddress, mask_url, parse_sentinel_url, sentinel_kwargs
from pagedq.config.settings import Settings

__all__ = ["SentinelAddress", "mask_url", "parse_sentinel_url", "sentinel_kwargs"]  # re-exported from config

RUN_FILE = "redis.json"  # in the embedded server's data dir: {"url": ..., "pid": ...}


class BrokerNotFoundError(RuntimeError):
    pass


class BrokerUnavailable(ConnectionError):
    """The broker did not answer in time (down, restarting, paused); nothing was written, or the call may be
    retried."""


class NotReplicated(BrokerUnavailable):
    """Written on the master, but fewer replicas than ``PAGEDQ_REDIS_MIN_REPLICAS_ACK`` confirmed it in time: a
    failover now may lose it.  ``job_ids``: the jobs it concerns; their writes stand on the master, so look at
    ``status`` before submitting again."""

    def __init__(self, message: str, job_ids: list[str] | None = None) -> None:
        super().__init__(message)
        self.job_ids = list(job_ids or [])


OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, kombu.exceptions.OperationalError)
OUTAGE_WAIT_S = 60.0  # a worker's last writes of a job wait this long for the broker (a failover takes seconds)
_T = TypeVar("_T")


def through_outage(fn: Callable[[], _T], what: str, wait_s: float = OUTAGE_WAIT_S) -> _T:
    """``fn()``, called again every half second while the broker is unreachable (a failover, a restart), for up
    to ``wait_s`` seconds; then its error is raised.  ``fn`` must be safe to repeat (idempotent writes, fenced or
    publish-once finishes): a write may have landed before its reply was lost."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return fn()
        except OUTAGE_ERRORS as e:
            if time.monotonic() >= deadline:
                raise
            logging.getLogger("pagedq.connection").warning("%s: the broker is unreachable, retrying: %s", what, e)
            time.sleep(0.5)


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


class BlockingSentinelPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """A Sentinel-managed pool (each new connection asks the sentinels for the master; connections to a demoted
    master are dropped) that blocks for a free connection as ``redis_client``'s does."""


class AsyncBlockingSentinelPool(AsyncSentinelConnectionPool, aredis.BlockingConnectionPool):
    """``BlockingSentinelPool`` for ``redis.asyncio``."""


def master_name(settings: Settings | None) -> str:
    return settings.redis_master_name if settings is not None else "pagedq"


def redis_client(url: str, timeout_s: float | None = 30, settings: Settings | None = None, *,
                 decode_responses: bool = True) -> redis.Redis:
    """A client whose every call answers or raises within ``timeout_s`` (blocking reads wait less than that).

    Its pool blocks for a free connection (up to ``timeout_s``) instead of raising: redis-py's default pool
    raises ``MaxConnectionsError`` past 100 connections, which a worker's hundreds of task threads reach.
    With a ``sentinel://`` URL it talks to whichever node the sentinels name master of
    ``PAGEDQ_REDIS_MASTER_NAME``, and follows a failover (a call during one raises a ``ConnectionError``).
    """
    return _client(_SYNC, url, settings, MAX_CONNECTIONS, _options(timeout_s, timeout_s, decode_responses))


def async_redis_client(url: str, socket_timeout_s: float, pool_timeout_s: float, max_connections: int,
                       settings: Settings | None = None) -> aredis.Redis:
    """``redis_client``'s asyncio twin (the gateway's): ``max_connections`` in a pool that waits up to
    ``pool_timeout_s`` for a free one; a ``sentinel://`` URL followed to the master, across failovers.  Closing
    the client closes its pool."""
    return _client(_ASYNC, url, settings, max_connections, _options(socket_timeout_s, pool_timeout_s, True))


# (the redis module, its Sentinel, the blocking Sentinel pool): redis_client's and async_redis_client's
_SYNC = (redis, Sentinel, BlockingSentinelPool)
_ASYNC = (aredis, AsyncSentinel, AsyncBlockingSentinelPool)


def _options(socket_timeout_s: float | None, pool_timeout_s: float | None, decode_responses: bool) -> dict:
    return {"timeout": pool_timeout_s, "socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s,
            "decode_responses": decode_responses, "health_check_interval": 30, "retry_on_timeout": False}


def _client(flavour: tuple, url: str, settings: Settings | None, max_connections: int, options: dict):
    lib, sentinel_class, sentinel_pool = flavour
    address = parse_sentinel_url(url)
    if address is not None:
        sentinels = sentinel_class(address.sentinels, sentinel_kwargs=sentinel_kwargs(settings, address))
        return sentinels.master_for(master_name(settings), connection_pool_class=sentinel_pool,
                                    max_connections=max_connections, socket_keepalive=True,
                                    username=address.username, password=address.password, db=address.db, **options)
    pool = lib.BlockingConnectionPool.from_url(url, max_connections=max_connections, **options,
                                               **tls_options(url, settings))
    return lib.Redis(connection_pool=pool) if lib is redis else lib.Redis.from_pool(pool)


def ping(url: str, timeout: float = 1.0, settings: Settings | None = None) -> bool:
    """True if the broker at ``url`` answers (with a ``sentinel://`` URL: the master the sentinels name
    ``settings.redis_master_name``)."""
    try:
        if parse_sentinel_url(url) is not None:
            client = redis_client(url, timeout, settings)
            try:
                return bool(client.ping())
            finally:
                client.close()
        return bool(redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, ValueError, TypeError):
        return False


def running_embedded_url(data_dir: Path, settings: Settings | None = None) -> str | None:
    """The URL of a live embedded server (or local Sentinel topology) using ``data_dir``, if there is one (its
    recorded process alive and answering with its password: a stale run file, or another program on that port,
    is not trusted)."""
    try:
        info = json.loads((Path(data_dir) / RUN_FILE).read_text())
    except (OSError, ValueError):
        return None
    url = info.get("url", "")
    return url if _alive(info.get("pid")) and ping(url, settings=settings) else None


def broker_url(settings: Settings) -> str:
    """PAGEDQ_BROKER_URL, else a running embedded server's URL."""
    url = settings.broker_url or running_embedded_url(settings.redis_data_dir)
    if not url:
        raise BrokerNotFoundError("no broker: set PAGEDQ_BROKER_URL, or start one with `pagedq up`")
    return url
