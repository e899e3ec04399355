"""Stored responses (the Responses API's ``store: true``), kept in Redis per tenant.

A stored response is one hash (``names.response(id)``) holding what the job
does not: its tenant, its job id, the request's Responses fields, its input
items, and the history its chain carries (the items of every earlier
response of a ``previous_response_id`` chain, their outputs included).  Its
status, output and usage are read from the job's record and result whenever
it is asked for, so any gateway process, or one started later, answers the
same, and a response follows its job through worker failures.

The hash expires ``ttl_s`` (``PAGEDQ_RESULT_TTL_S``) after it was created; the
job's result expires that long after the job ends, so it outlives the
response that reads it.

Stored responses count in their tenant's ``max_stored_bytes`` beside its
files (not in ``max_files``): a ledger (``names.responses_ledger``) holds each
one's bytes and tenant and adds them to the files' sums
(``GatewayKeys.storage_usage``), in one script that first settles lapsed
entries, so the files' own script sees them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from pagedq.config.names import Names
from pagedq.pipeline.gateway.config import GatewayKeys
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.keys import Tenant
from pagedq.pipeline.gateway.ledger import DROP

# KEYS: responses ledger, responses expiry, the files' usage hash.  drop(id) forgets a ledger entry.
_DROP = DROP + """
local function drop(id) drop_entry(KEYS[1], KEYS[2], KEYS[3], id, false) end
"""

# ARGV: now, id, tenant, bytes, lapses at, tenant's max bytes, store cap (0: none).
# Returns 'ok', or {limit, used} (nothing recorded).
_CLAIM = _DROP + """
local now = tonumber(ARGV[1])
settle(KEYS[1], KEYS[2], KEYS[3], now, false)
local tenant, add = ARGV[3], tonumber(ARGV[4])
local used = tonumber(redis.call('HGET', KEYS[3], 'bytes:' .. tenant) or '0')
if used + add > tonumber(ARGV[6]) then return {'max_stored_bytes', used} end
local total = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0')
local cap = tonumber(ARGV[7])
if cap > 0 and total + add > cap then return {'file_store_share', total} end
redis.call('HSET', KEYS[1], ARGV[2], add .. ' ' .. tenant)
redis.call('ZADD', KEYS[2], tonumber(ARGV[5]), ARGV[2])
redis.call('HINCRBY', KEYS[3], 'bytes:' .. tenant, add)
redis.call('HINCRBY', KEYS[3], 'bytes', add)
return 'ok'
"""

_RELEASE = _DROP + """
drop(ARGV[1])
return 1
"""


@dataclass
class StoredResponse:
    """What a response keeps beside its job."""

    id: str
    tenant: str
    job_id: str
    created_at: int
    request: dict  # the Responses fields echoed in the response object
    input: list[dict] = field(default_factory=list)  # this request's input items, as input_items lists them
    history: list[dict] = field(default_factory=list)  # earlier items of the chain, before ``input``
    background: bool = False

    def to_hash(self) -> dict[str, str]:
        return {"tenant": self.tenant, "job_id": self.job_id, "created_at": str(self.created_at),
                "request": json.dumps(self.request), "input": json.dumps(self.input),
                "history": json.dumps(self.history), "background": str(int(self.background))}

    @classmethod
    def from_hash(cls, response_id: str, h: dict[str, str]) -> StoredResponse:
        return cls(response_id, h["tenant"], h["job_id"], int(h["created_at"]), json.loads(h["request"]),
                   json.loads(h["input"]), json.loads(h["history"]), h.get("background") == "1")


class ResponseStore:
    def __init__(self, r: redis.Redis, names: Names, keys: GatewayKeys, ttl_s: int) -> None:
        self.r, self.names, self.ttl_s = r, names, ttl_s
        self._keys = [names.responses_ledger, names.responses_expiry, keys.storage_usage]
        self._claim = r.register_script(_CLAIM)
        self._release = r.register_script(_RELEASE)

    def claim(self, tenant: Tenant, stored: StoredResponse, store_cap: int) -> None:
        """Take the room of the response (before its job exists) within the tenant's ``max_stored_bytes``;
        429 naming the limit otherwise."""
        nbytes = _size(stored)
        now = time.time()
        verdict = self._claim(keys=self._keys, args=[now, stored.id, tenant.name, nbytes, now + self.ttl_s,
                                                     tenant.max_stored_bytes, store_cap])
        if verdict != "ok":
            raise _quota_error(tenant, verdict[0], int(verdict[1]), nbytes)

    def write(self, stored: StoredResponse) -> None:
        """Store a claimed response (its job id known now), for ``ttl_s``."""
        try:
            pipe = self.r.pipeline(transaction=True)
            pipe.hset(self.names.response(stored.id), mapping=stored.to_hash())
            pipe.expire(self.names.response(stored.id), self.ttl_s)
            pipe.execute()
        except BaseException:
            self.release(stored.id)
            raise

    def load(self, response_id: str, tenant: Tenant, param: str | None = None) -> StoredResponse:
        """The tenant's stored response; 404 (naming ``param``) if there is none, or it is another tenant's."""
        h = self.r.hgetall(self.names.response(response_id)) if _plausible(response_id) else {}
        if not h or h.get("tenant") != tenant.name:
            raise ApiError.not_found("response", response_id, param)
        return StoredResponse.from_hash(response_id, h)

    def delete(self, response_id: str) -> None:
        self.r.delete(self.names.response(response_id))
        self.release(response_id)

    def release(self, response_id: str) -> None:
        self._release(keys=self._keys, args=[response_id])


def _size(stored: StoredResponse) -> int:
    """The bytes the response's hash takes (its job id counted at its length, 32, before it is known)."""
    return sum(len(k) + len(v.encode()) for k, v in stored.to_hash().items()) + 32 - len(stored.job_id)


def _plausible(response_id: str) -> bool:
    return response_id.startswith("resp_") and len(response_id) <= 64


def _quota_error(tenant: Tenant, limit: str, used: int, nbytes: int) -> ApiError:
    if limit == "max_stored_bytes":
        return ApiError(429, f"Storage quota reached: tenant {tenant.name!r} stores {used} bytes of files and "
                             f"responses, at most {tenant.max_stored_bytes} (max_stored_bytes); this response "
                             f"needs {nbytes} more. Delete responses or files, or send store: false.", "store",
                        "storage_quota_exceeded")
    return ApiError(429, f"The file store is full ({used} bytes); this response needs {nbytes} more. Retry "
                         "later, or send store: false.", "store", "file_store_full", 60)
