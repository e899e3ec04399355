"""The result cache: a deterministic request answered before is answered from Redis.

A request is deterministic when it is greedy (temperature 0) or carries a
seed: the engine gives the same tokens for it whatever its batch mates.  Its
entry is keyed by

    <prefix>rcache:<model>:v<version>:<sha256(fingerprint, sha256(canonical request))>

(``key``, the one function that computes it, for the lookup at submit and the
insert at postprocess alike.)

- ``fingerprint`` is a hash of the weights that produced the answer.  The
  lookup uses the one the model's GPU workers registered; the insert uses the
  one the producing worker put in its Completion, and files the answer only
  while the registry still names that fingerprint (checked inside the insert
  script): during a rolling reload an answer from the old weights is never
  filed where requests for the new ones look.  The request is keyed as sent
  (messages, not templated text): tokenizer and chat template ship in the
  model's folder with its weights, and changing only them needs
  ``pagedq cache invalidate``;
- ``version`` is a counter per model: ``pagedq cache invalidate --model M``
  increments it and every earlier entry becomes unreachable at once, without
  a scan (they age out by TTL or by the size bound).  The producer records the
  version and the request's digest in the job record at submit (``cache_version``,
  ``cache_request``), whether or not a worker has registered the model yet, so
  postprocess can key the answer; an invalidation while the job ran files it
  under the old version, where nobody looks.

Entries have a TTL and the cache has a total size bound, kept by the insert
script itself: it records each entry's size and evicts the oldest entries
until the total fits.  The cache never relies on Redis' own eviction, which
must stay ``noeviction`` so queue data is never dropped.
"""

from __future__ import annotations

import hashlib
import json
import time

import redis

from pagedq.config.names import Names
from pagedq.config.sampling_params import GREEDY_EPSILON

# KEYS: entry, index (zset key -> insert time), sizes (hash key -> bytes), total (string)[, model's registry hash]
# ARGV: value, ttl, now, max_bytes[, the fingerprint that produced the value]
_PUT = """
local size = string.len(ARGV[1])
local max = tonumber(ARGV[4])
if size > max or redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if KEYS[5] and redis.call('HGET', KEYS[5], 'fingerprint') ~= ARGV[5] then return 0 end  -- other weights now
local function drop(key)
  local s = redis.call('HGET', KEYS[3], key)
  if s then redis.call('DECRBY', KEYS[4], s) end
  redis.call('HDEL', KEYS[3], key)
  redis.call('ZREM', KEYS[2], key)
  redis.call('DEL', key)
end
for _, key in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', tonumber(ARGV[3]) - tonumber(ARGV[2]))) do
  drop(key)  -- past its TTL: already gone or about to be
end
while tonumber(redis.call('GET', KEYS[4]) or '0') + size > max do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest then break end
  drop(oldest)
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], KEYS[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
redis.call('INCRBY', KEYS[4], size)
return 1
"""

# Fields that change how a job is handled, not what the model answers.
_NOT_PART_OF_THE_ANSWER = {"priority", "use_result_cache", "user", "stream", "timeout_s", "model",
                           "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}


def is_deterministic(body: dict) -> bool:
    """Greedy (as the sampler decides it) or seeded: the same tokens whatever the batch."""
    return body.get("temperature", 1.0) < GREEDY_EPSILON or body.get("seed") is not None


def canonical_request(url: str, body: dict) -> str:
    """The request as JSON with sorted keys, without fields that do not change the answer."""
    kept = {k: v for k, v in body.items() if k not in _NOT_PART_OF_THE_ANSWER}
    return json.dumps({"url": url, "body": kept}, sort_keys=True, separators=(",", ":"))


def request_digest(url: str, body: dict) -> str:
    """What the job record keeps of a cacheable request (``cache_request``): sha256 of its canonical form."""
    return hashlib.sha256(canonical_request(url, body).encode()).hexdigest()


class ResultCache:
    def __init__(self, client: redis.Redis, names: Names, ttl_s: int, max_bytes: int) -> None:
        self.r = client
        self.names = names
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._put = client.register_script(_PUT)

    def version(self, model: str) -> int:
        return int(self.r.get(self.names.result_cache_version(model)) or 0)

    def key(self, model: str, version: int, fingerprint: str, request: str) -> str:
        """The entry for ``request`` (a ``request_digest``) answered by weights ``fingerprint``."""
        digest = hashlib.sha256(f"{fingerprint}\n{request}".encode()).hexdigest()
        return self.names.result_cache_entry(model, version, digest)

    def get(self, key: str) -> dict | None:
        raw = self.r.get(key)
        return json.loads(raw) if raw else None

    def put(self, key: str, response: dict, model: str | None = None, fingerprint: str | None = None) -> bool:
        """Insert unless present or too big; with ``model``, only while its registry names ``fingerprint``."""
        n = self.names
        keys = [key, n.result_cache_index, n.result_cache_sizes, n.result_cache_bytes]
        args = [json.dumps(response), self.ttl_s, repr(time.time()), self.max_bytes]
        if model is not None:
            keys.append(n.model(model))
            args.append(fingerprint or "")
        return bool(self._put(keys=keys, args=args))

    def put_answer(self, model: str, version: int, fingerprint: str, request: str, response: dict) -> bool:
        """File an answer produced by weights ``fingerprint``, if they are the ones ``model`` serves now."""
        if not fingerprint:  # an old worker's Completion, or weights changed while it ran: unknown provenance
            return False
        return self.put(self.key(model, version, fingerprint, request), response, model, fingerprint)

    def invalidate(self, model: str) -> int:
        """Make every entry of ``model`` unreachable; returns the new version."""
        return int(self.r.incr(self.names.result_cache_version(model)))

    def total_bytes(self) -> int:
        return int(self.r.get(self.names.result_cache_bytes) or 0)
