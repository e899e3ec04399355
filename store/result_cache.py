"""The result cache: a deterministic request answered before is answered from Redis.

A request is deterministic when it is greedy (temperature 0) or carries a
seed: the engine gives the same tokens for it whatever its batch mates.  Its
entry is keyed by

    <prefix>rcache:<model>:v<version>:<sha256(fingerprint, canonical request)>

- ``fingerprint`` is what the serving GPU worker registered for the model: a
  hash of the weights it loaded, so other weights under the same name never
  see old entries.  The request is keyed as sent (messages, not templated
  text): tokenizer and chat template ship in the model's folder with its
  weights, and changing only them needs ``pagedq cache invalidate``;
- ``version`` is a counter per model: ``pagedq cache invalidate --model M``
  increments it and every earlier entry becomes unreachable at once, without
  a scan (they age out by TTL or by the size bound).

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

# KEYS: entry, index (zset key -> insert time), sizes (hash key -> bytes), total (string)
# ARGV: value, ttl, now, max_bytes
_PUT = """
local size = string.len(ARGV[1])
local max = tonumber(ARGV[4])
if size > max or redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
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
_NOT_PART_OF_THE_ANSWER = {"priority", "use_result_cache", "user", "stream", "timeout_s", "model"}


def is_deterministic(body: dict) -> bool:
    """Greedy (as the sampler decides it) or seeded: the same tokens whatever the batch."""
    return body.get("temperature", 1.0) < GREEDY_EPSILON or body.get("seed") is not None


def canonical_request(url: str, body: dict) -> str:
    """The request as JSON with sorted keys, without fields that do not change the answer."""
    kept = {k: v for k, v in body.items() if k not in _NOT_PART_OF_THE_ANSWER}
    return json.dumps({"url": url, "body": kept}, sort_keys=True, separators=(",", ":"))


class ResultCache:
    def __init__(self, client: redis.Redis, names: Names, ttl_s: int, max_bytes: int) -> None:
        self.r = client
        self.names = names
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._put = client.register_script(_PUT)

    def key(self, model: str, fingerprint: str, url: str, body: dict) -> str:
        version = int(self.r.get(self.names.result_cache_version(model)) or 0)
        digest = hashlib.sha256(f"{fingerprint}\n{canonical_request(url, body)}".encode()).hexdigest()
        return self.names.result_cache_entry(model, version, digest)

    def get(self, key: str) -> dict | None:
        raw = self.r.get(key)
        return json.loads(raw) if raw else None

    def put(self, key: str, response: dict) -> bool:
        n = self.names
        return bool(self._put(keys=[key, n.result_cache_index, n.result_cache_sizes, n.result_cache_bytes],
                              args=[json.dumps(response), self.ttl_s, repr(time.time()), self.max_bytes]))

    def invalidate(self, model: str) -> int:
        """Make every entry of ``model`` unreachable; returns the new version."""
        return int(self.r.incr(self.names.result_cache_version(model)))

    def total_bytes(self) -> int:
        return int(self.r.get(self.names.result_cache_bytes) or 0)
