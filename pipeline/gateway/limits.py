"""A tenant's limits, kept in Redis so every gateway process sees the same counts.

- requests per minute: one counter per tenant and clock minute;
- jobs waiting or running at once: the tenant's job ids in a sorted set, pruned
  of ended jobs each time a new one asks for room.  Room is reserved before
  the jobs are sent (a reservation counts until it is replaced by the job ids,
  or for a minute if the gateway died meanwhile), so two gateways cannot both
  take the last place.
"""

from __future__ import annotations

import time
import uuid

import redis

from pagedq.pipeline.gateway.config import GatewayKeys
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.keys import Tenant

RESERVATION_TTL_S = 60

# KEYS: the tenant's active set.  ARGV: job key prefix, limit, now, reservation member, jobs wanted,
# reservation lifetime (s).
# Returns -1 when the reservation was added, else the number of jobs the tenant has waiting or running.
_RESERVE = """
local now, live = tonumber(ARGV[3]), 0
local members = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #members, 2 do
  local id, added = members[i], tonumber(members[i + 1])
  local reserved = string.match(id, '^reserve:[^:]+:(%d+)$')
  local weight, alive = 1, false
  if reserved then
    weight, alive = tonumber(reserved), now - added < tonumber(ARGV[6])
  else
    local st = redis.call('HGET', ARGV[1] .. id, 'state')
    alive = st == 'queued' or st == 'in_progress' or st == 'cancelling'
  end
  if alive then live = live + weight else redis.call('ZREM', KEYS[1], id) end
end
if live + tonumber(ARGV[5]) > tonumber(ARGV[2]) then return live end
redis.call('ZADD', KEYS[1], now, ARGV[4])
return -1
"""


class TenantLimits:
    def __init__(self, r: redis.Redis, keys: GatewayKeys, job_key_prefix: str) -> None:
        self.r = r
        self.keys = keys
        self.job_key_prefix = job_key_prefix  # names.job("") : job ids are appended to it
        self._reserve = r.register_script(_RESERVE)

    def count_request(self, tenant: Tenant) -> None:
        """Count one request against the tenant's requests per minute; 429 beyond it."""
        if tenant.rpm is None:
            return
        now = time.time()
        minute = int(now // 60)
        key = self.keys.requests_in_minute(tenant.name, minute)
        pipe = self.r.pipeline(transaction=True)
        pipe.incr(key)
        pipe.expire(key, 120)
        count, _ = pipe.execute()
        if count > tenant.rpm:
            raise ApiError(429, f"Rate limit reached: {tenant.rpm} requests per minute for tenant "
                                f"{tenant.name!r}.", None, "rate_limit_exceeded", (minute + 1) * 60 - now)

    def reserve(self, tenant: Tenant, jobs: int) -> str | None:
        """Room for ``jobs`` more jobs of the tenant (a reservation to ``commit`` or ``release``); 429 if none."""
        if tenant.max_queued is None:
            return None
        member = f"reserve:{uuid.uuid4().hex}:{jobs}"
        live = self._reserve(keys=[self.keys.active_jobs(tenant.name)],
                             args=[self.job_key_prefix, tenant.max_queued, time.time(), member, jobs,
                                   RESERVATION_TTL_S])
        if live != -1:
            raise ApiError(429, f"Too many jobs: tenant {tenant.name!r} has {live} waiting or running, at most "
                                f"{tenant.max_queued}; this request needs {jobs} more.", None,
                           "too_many_queued_jobs", 2)
        return member

    def commit(self, tenant: Tenant, reservation: str | None, job_ids: list[str]) -> None:
        """Replace a reservation with the jobs it was for."""
        if reservation is None:
            return
        key = self.keys.active_jobs(tenant.name)
        pipe = self.r.pipeline(transaction=True)
        if job_ids:
            pipe.zadd(key, dict.fromkeys(job_ids, time.time()))
        pipe.zrem(key, reservation)
        pipe.execute()

    def release(self, tenant: Tenant, reservation: str | None) -> None:
        if reservation is not None:
            self.r.zrem(self.keys.active_jobs(tenant.name), reservation)
