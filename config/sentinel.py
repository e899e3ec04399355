"""Sentinel broker URLs, in Celery's form (kombu's and Flower's too): one ``sentinel://`` URL per sentinel,
joined with ``;``; the user, password and db in them are the data nodes' (the master's).  Parsed and checked
once here, for the clients (``store/connection.py``) and the Celery transport (``config/celery_app.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit, urlunsplit

if TYPE_CHECKING:
    from pagedq.config.settings import Settings


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
    URL's), short timeouts, and no retries: asking the next sentinel is the retry.  (redis-py's default retry
    spent 3.6-4 s on a dead first-listed sentinel at every master lookup, and every new connection looks the
    master up; with none, 4 ms.)"""
    secret = settings.redis_sentinel_password if settings is not None else None
    password = secret.get_secret_value() if secret is not None else address.password
    return {"password": password, "socket_timeout": SENTINEL_TIMEOUT_S,
            "socket_connect_timeout": SENTINEL_TIMEOUT_S, "retry": None}
