"""Trust but verify the Redis a component is pointed at, before it starts work (or loads a model).

pagedq's own servers are configured right; an existing one (a shared instance, a managed service) may not be:

- ``maxmemory-policy`` must be ``noeviction``.  Any other policy lets Redis drop keys when it is full: a queued
  message, a job record, a lease or a result vanishes without an error (``volatile-*`` too: finished job
  records and results carry TTLs).  With ``noeviction`` a full Redis refuses writes, which pagedq reports
  (``queue_full``, 429).
- Redis 6.2 or later: the job store's Lua scripts use ``ZADD ... XX GT`` (6.2); ACL users need 6.0.
- Not Cluster mode: one Lua script changes a job, its queue, its tenant's counters and its model's backlog at
  once, keys in different hash slots, which a cluster refuses.  High availability is Sentinel's
  (``sentinel://`` broker URLs), which this check follows to the master.
- The broker user may run INFO (how the above is read; CONFIG is not needed, and pagedq's own servers and
  most managed services disable it), run Lua (EVAL), reach keys under ``PAGEDQ_KEY_PREFIX``, and, for a
  consumer (a worker), pop from a list (BRPOP).

Each refusal is one line naming the setting or permission and the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

from pagedq.config.settings import Settings
from pagedq.store.connection import BrokerUnavailable, mask_url, redis_client

log = logging.getLogger(__name__)

MIN_VERSION = (6, 2, 0)
_PROBE = "redis-check:probe"  # under the key prefix; never written


class RedisUnsuitable(RuntimeError):
    """The broker answers, but pagedq must not run on it as it is; the message says what to change."""


@dataclass(frozen=True)
class ServerFacts:
    version: tuple[int, ...]
    maxmemory_policy: str | None
    cluster_enabled: bool


def parse_version(text: str) -> tuple[int, ...]:
    """'7.2.4' -> (7, 2, 4); a suffix such as '-rc1' is dropped."""
    parts = []
    for part in text.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit()) or "0"
        parts.append(int(digits))
    return tuple(parts)


def server_facts(info: dict) -> ServerFacts:
    return ServerFacts(parse_version(str(info.get("redis_version", "0"))), info.get("maxmemory_policy"),
                       str(info.get("cluster_enabled", "0")) == "1")


def refusal(facts: ServerFacts) -> str | None:
    """The one line that refuses this server, or None when pagedq may run on it."""
    if facts.cluster_enabled:
        return ("Redis Cluster is not supported (INFO cluster: cluster_enabled:1): pagedq's Lua scripts change "
                "keys of many hash slots at once; use one Redis, or a master with replicas under Sentinel "
                "(a sentinel:// PAGEDQ_BROKER_URL, docs/deploy.md)")
    if facts.version < MIN_VERSION:
        have, need = ".".join(map(str, facts.version)), ".".join(map(str, MIN_VERSION))
        return (f"Redis {have} is too old: pagedq needs {need} or later (its Lua scripts use ZADD ... GT); "
                "upgrade the server")
    if facts.maxmemory_policy is not None and facts.maxmemory_policy != "noeviction":
        return (f"maxmemory-policy is {facts.maxmemory_policy}: Redis may evict queued jobs, leases and results "
                "without an error; set it to noeviction (CONFIG SET maxmemory-policy noeviction, and "
                "`maxmemory-policy noeviction` in redis.conf to keep it)")
    return None


def _denied(what: str, grant: str, e: redis.ResponseError) -> RedisUnsuitable:
    reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    return RedisUnsuitable(f"the broker user may not {what} ({reason}); allow it in the user's ACL with "
                           f"{grant} (docker/redis-users.acl.example)")


def check_server(r: redis.Redis, key_prefix: str, consumer: bool) -> ServerFacts:
    """Read the server's facts with one INFO, probe the permissions a component needs, and raise
    ``RedisUnsuitable`` with one line for the first thing that is not right."""
    try:
        info = r.info()
    except redis.ResponseError as e:
        if "unknown command" in str(e).lower():
            raise RedisUnsuitable("the broker refuses INFO (renamed or disabled): pagedq reads maxmemory-policy, "
                                  "the version and cluster mode with it; keep INFO available") from None
        raise _denied("run INFO, with which pagedq reads maxmemory-policy, the version and cluster mode",
                      "+info", e) from None
    facts = server_facts(info)
    problem = refusal(facts)
    if problem:
        raise RedisUnsuitable(problem)
    if facts.maxmemory_policy is None:
        log.warning("the broker's INFO has no maxmemory_policy: cannot tell whether it evicts keys")
    probes = [("run Lua scripts (EVAL)", "+@scripting", lambda: r.eval("return 1", 0)),
              (f"read keys under the key prefix {key_prefix!r} (PAGEDQ_KEY_PREFIX)", f"~{key_prefix}*",
               lambda: r.exists(key_prefix + _PROBE))]
    if consumer:  # kombu takes messages off its queue lists with BRPOP
        probes.append(("pop queue messages (BRPOP)", "+brpop", lambda: r.brpop([key_prefix + _PROBE], 0.01)))
    for what, grant, probe in probes:
        try:
            probe()
        except redis.ResponseError as e:
            raise _denied(what, grant, e) from None
    return facts


def verify_broker(url: str, settings: Settings, consumer: bool = True) -> ServerFacts:
    """``check_server`` on the broker at ``url`` (a ``sentinel://`` URL: on the master its sentinels name).
    Raises ``RedisUnsuitable`` (one line), or ``BrokerUnavailable`` when it does not answer."""
    client = redis_client(url, timeout_s=min(settings.broker_timeout_s, 10), settings=settings)
    try:
        facts = check_server(client, settings.key_prefix, consumer)
    except redis.AuthenticationError as e:
        raise RedisUnsuitable(f"{mask_url(url)} refused the password: {e}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        raise BrokerUnavailable(f"{mask_url(url)} does not answer: {e}") from None
    finally:
        client.close()
    log.info("broker %s: Redis %s, maxmemory-policy %s", mask_url(url), ".".join(map(str, facts.version)),
             facts.maxmemory_policy)
    return facts
