"""What a tenant keeps in Redis, counted against its ``max_stored_bytes``: files, stored responses and the
results of its completions.

Three ledgers, one per kind (a hash: id -> "<bytes> <tenant>", and a sorted set: id -> when the entry
lapses, its object's expiry), add up into one usage hash (``GatewayKeys.storage_usage``: ``bytes:<tenant>``,
``files:<tenant>``, ``bytes`` for all).  Entries are settled (their bytes given back) by the scripts that
claim room, and by ``StoredBytes.used``, which admission asks before a completion is queued.

Results are counted after the fact: a job's result is written by the worker that ends it, whatever the
quota, so that every accepted job ends; the gateway that answered it records its size (``STRLEN``) until it
expires (``PTTL``), and a tenant over its quota is refused new completions until enough of its results,
files or responses lapse.  A result is counted once (a flag in its job's record), and a tenant's results
expiring within the same ``RESULT_BUCKET_S`` share one ledger entry, so the ledger stays small however many
results there are.  The results of batch lines are counted through their batch's output file.
"""

from __future__ import annotations

import logging
import time

import redis

from pagedq.config.names import Names
from pagedq.pipeline.gateway.config import GatewayKeys
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.keys import Tenant

log = logging.getLogger(__name__)

# Lua shared by every ledger's scripts.  ``files`` says whether the ledger's entries count in ``files:<tenant>``
# (files do; responses and results do not).
DROP = """
local function drop_entry(ledger, expiry, usage, id, files)
  local entry = redis.call('HGET', ledger, id)
  if entry then
    local bytes, tenant = string.match(entry, '^(%d+) (.+)$')
    local freed = 0 - tonumber(bytes)  -- not -n: Lua writes -0 for 0, which HINCRBY refuses
    redis.call('HINCRBY', usage, 'bytes:' .. tenant, freed)
    if files then redis.call('HINCRBY', usage, 'files:' .. tenant, -1) end
    redis.call('HINCRBY', usage, 'bytes', freed)
    redis.call('HDEL', ledger, id)
  end
  redis.call('ZREM', expiry, id)
end
local function settle(ledger, expiry, usage, now, files)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', expiry, '-inf', now, 'LIMIT', 0, 100)) do
    drop_entry(ledger, expiry, usage, id, files)
  end
end
"""

# KEYS: files ledger, files expiry, responses ledger, responses expiry, results ledger, results expiry, usage.
# ARGV: now, tenant.  Settles every ledger's lapsed entries; returns the tenant's bytes.
_USED = DROP + """
local now = tonumber(ARGV[1])
settle(KEYS[1], KEYS[2], KEYS[7], now, true)
settle(KEYS[3], KEYS[4], KEYS[7], now, false)
settle(KEYS[5], KEYS[6], KEYS[7], now, false)
return tonumber(redis.call('HGET', KEYS[7], 'bytes:' .. ARGV[2]) or '0')
"""

RESULT_BUCKET_S = 5  # a tenant's results expiring within one such span share a ledger entry (lapsing at its end)

# KEYS: results ledger, results expiry, usage, the job's result, the job's record.  ARGV: now, tenant, bucket s.
# Records the result's bytes until (just after) it expires, once: the job's record is flagged (no limit: the
# result is already written).  The entry's id: "<when it lapses> <tenant>".
_RECORD = DROP + """
local now = tonumber(ARGV[1])
settle(KEYS[1], KEYS[2], KEYS[3], now, false)
local bytes, ttl = redis.call('STRLEN', KEYS[4]), redis.call('PTTL', KEYS[4])
if bytes == 0 or ttl < 0 or redis.call('EXISTS', KEYS[5]) == 0 then return 0 end
if redis.call('HSETNX', KEYS[5], 'result_counted', 1) == 0 then return 0 end
local span = tonumber(ARGV[3])
local lapses = math.ceil((now + ttl / 1000) / span) * span
local id = lapses .. ' ' .. ARGV[2]
local old = redis.call('HGET', KEYS[1], id)
local have = old and tonumber(string.match(old, '^(%d+)')) or 0
redis.call('HSET', KEYS[1], id, (have + bytes) .. ' ' .. ARGV[2])
redis.call('ZADD', KEYS[2], lapses, id)
redis.call('HINCRBY', KEYS[3], 'bytes:' .. ARGV[2], bytes)
redis.call('HINCRBY', KEYS[3], 'bytes', bytes)
return bytes
"""

ROOM_CACHE_S = 1.0  # how long "the tenant has room" is believed without asking Redis again


class StoredBytes:
    """The tenant's stored bytes, all kinds together: admission's check, and the record of each result."""

    def __init__(self, r: redis.Redis, names: Names, keys: GatewayKeys) -> None:
        self.r, self.names = r, names
        self._all = [keys.storage_ledger, keys.storage_expiry, names.responses_ledger, names.responses_expiry,
                     names.results_ledger, names.results_expiry, keys.storage_usage]
        self._results = [names.results_ledger, names.results_expiry, keys.storage_usage]
        self._used = r.register_script(_USED)
        self._record = r.register_script(_RECORD)
        self._room: dict[str, float] = {}  # tenant -> when it last had room

    def used(self, tenant: Tenant) -> int:
        """Bytes the tenant stores now (lapsed entries settled first)."""
        return int(self._used(keys=self._all, args=[time.time(), tenant.name]))

    def check_room(self, tenant: Tenant) -> None:
        """429 if the tenant stores its ``max_stored_bytes`` or more already (remembered ``ROOM_CACHE_S`` while
        it has room: one script per tenant and second, not one per request)."""
        if time.monotonic() - self._room.get(tenant.name, float("-inf")) < ROOM_CACHE_S:
            return
        used = self.used(tenant)
        if used >= tenant.max_stored_bytes:
            raise ApiError(429, f"Storage quota reached: tenant {tenant.name!r} stores {used} bytes of files, "
                                f"responses and completion results, at most {tenant.max_stored_bytes} "
                                "(max_stored_bytes). A result counts until it expires (PAGEDQ_RESULT_TTL_S); "
                                "delete files or responses, or retry later.", None, "storage_quota_exceeded", 60)
        self._room[tenant.name] = time.monotonic()

    def record_result(self, tenant: str, job_id: str) -> int:
        """Count the job's result (its bytes, until it expires) in the tenant's storage; returns the bytes
        counted (0: already counted, or no result).  A broker error is logged, not raised: the answer it
        follows is already the client's."""
        try:
            return int(self._record(keys=[*self._results, self.names.result(job_id), self.names.job(job_id)],
                                    args=[time.time(), tenant, RESULT_BUCKET_S]))
        except redis.RedisError as e:
            log.warning("could not count the result of job %s in tenant %r's storage: %r", job_id, tenant, e)
            return 0
