"""A Redis lock held under an owner token: only its holder extends or releases it.

Used by every background job that must run in one process at a time (the
lost-job sweep, the deadline watch, a batch's finalizer).  Invariant: a lock
held by another token is never extended, overwritten or deleted; one that
lapsed is free to whoever holds it next.
"""

from __future__ import annotations

import uuid

import redis

# KEYS: lock. ARGV: token, ms.  Take the lock if free, or extend it if this token holds it.
_HOLD = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: lock. ARGV: token.  Compare-and-delete.
_RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


class OwnedLock:
    def __init__(self, r: redis.Redis, key: str, owner: str = "") -> None:
        self.r, self.key = r, key
        self.token = f"{owner}:{uuid.uuid4().hex}"  # unique per holder, even for two with one hostname
        self._hold = r.register_script(_HOLD)
        self._release = r.register_script(_RELEASE)

    def take(self, ms: int) -> bool:
        """Take the lock for ``ms`` only if nobody holds it (this holder included)."""
        return bool(self.r.set(self.key, self.token, nx=True, px=ms))

    def hold(self, ms: int) -> bool:
        """Take the lock if free, or extend it to ``ms`` if this holder has it; False if another holds it."""
        return bool(self._hold(keys=[self.key], args=[self.token, ms]))

    def release(self) -> bool:
        """Give the lock back, if this holder still has it."""
        return bool(self._release(keys=[self.key], args=[self.token]))
