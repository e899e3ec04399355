"""Control messages to GPU workers (cancel, stream, reload) on one pub/sub channel, signed, each acted on once.

Anyone who can reach the broker can publish (Redis ACLs cannot confine
channels by pattern, see docs/security.md); only a holder of the deployment's
control key can sign.  A message is JSON ``{"op": ..., ..., "ts": <unix time>,
"nonce": <random>, "kid": <key id>, "sig": <hex HMAC-SHA256 of the rest>}``.
A worker acts on a message only if its signature verifies, its ``ts`` is within
``MAX_AGE_S`` of the worker's clock, and the worker has not acted on its nonce
before: it adds itself to the nonce's seen-set (``names.control_seen``, kept
``SEEN_TTL_S``, longer than a message stays fresh), so a replay of the same
bytes changes nothing.  Nonces are also global: the first worker to receive a
message records when (``names.control_first_seen``, on the Redis clock), and
every worker ignores a copy received more than ``DELIVERY_WINDOW_S`` later, so a
message captured and replayed to a worker started since (a new name, an empty
seen-set) changes nothing either.  Everything else is logged and ignored.  ``kid`` (a hash
of the key, not the key) says when a message was signed with another key.

One key per deployment: ``PAGEDQ_CONTROL_SECRET`` where set, else a random key
kept in Redis under the deployment's prefix (``names.control_key``), made once
by the first process that needs it.  That is where every host of the
deployment finds the same key, and only those allowed to read the deployment's
keys can read it: the users that can already write its jobs and results (see
docs/security.md).  Publishers read it again every ``ControlKey.REREAD_S``
and listeners when a signature fails, so all converge on the stored key if it
is ever lost and made anew.

A cancel does not depend on its message alone: ``Client.cancel`` first marks the
job ``cancelling`` in its record, which GPU workers re-check for their running
jobs every ``progress_interval_s`` (``workers/gpu_worker.py``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from pathlib import Path

import redis

from pagedq.config.names import Names
from pagedq.config.settings import Settings

MAX_AGE_S = 300
SEEN_TTL_S = 2 * MAX_AGE_S + 60  # a nonce is remembered past the last moment its message could still be fresh
# Every worker receives a published message at once (pub/sub); a listener stalled this long behind a long engine
# step still takes it.  Later copies are replays.
DELIVERY_WINDOW_S = 60
KEY_FILE = "control.key"
MIN_KEY_BYTES = 32


class BadSignature(ValueError):
    pass


def configured_secret(settings: Settings) -> bytes | None:
    """``PAGEDQ_CONTROL_SECRET``, checked; None when unset (the deployment's key in Redis is used)."""
    if settings.control_secret is None:
        return None
    key = settings.control_secret.get_secret_value().encode()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"control_secret: at least {MIN_KEY_BYTES} characters")
    return key


def control_secret(settings: Settings) -> bytes:
    """``PAGEDQ_CONTROL_SECRET``, else a key kept in this host's state dir.

    For a process without a broker connection only: pagedq's own publishers and listeners use
    ``ControlKey`` (the same key on every host of a deployment)."""
    if (key := configured_secret(settings)) is not None:
        return key
    path = Path(settings.state_dir) / KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f"{KEY_FILE}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_hex(32).encode())
        try:  # link: the key appears whole or not at all; of two processes racing, the first wins for both
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    key = path.read_bytes().strip()
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"control key {path} is shorter than {MIN_KEY_BYTES} bytes: delete it to make a new one")
    return key


def key_id(secret: bytes) -> str:
    """Names a key without revealing it: tells a message signed with another key from a forged one."""
    return hashlib.sha256(b"pagedq control key id\n" + secret).hexdigest()[:16]


def _signature(secret: bytes, fields: dict) -> str:
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()


def sign(secret: bytes, op: str, **fields) -> str:
    message = {"op": op, **fields, "ts": time.time(), "nonce": secrets.token_hex(16), "kid": key_id(secret)}
    return json.dumps({**message, "sig": _signature(secret, message)})


def verify(secret: bytes, raw: str | bytes) -> dict:
    """The message if it is signed with ``secret``, fresh and has a nonce; raises ValueError saying why not
    (``BadSignature`` for a signature that does not verify)."""
    message = json.loads(raw)
    if not isinstance(message, dict) or not isinstance(message.get("sig"), str):
        raise ValueError("unsigned")
    sig = message.pop("sig")
    if not hmac.compare_digest(sig, _signature(secret, message)):
        if message.get("kid") not in (None, key_id(secret)):
            raise BadSignature(f"signed with another control key (key id {str(message['kid'])[:16]}, this "
                               f"process's {key_id(secret)}): every process of a deployment needs the same "
                               "PAGEDQ_CONTROL_SECRET, or none")
        raise BadSignature("bad signature")
    if not isinstance(message.get("ts"), (int, float)) or abs(time.time() - message["ts"]) > MAX_AGE_S:
        raise ValueError("stale or missing timestamp")
    if not isinstance(message.get("nonce"), str) or not message["nonce"]:
        raise ValueError("no nonce (sent by an older pagedq?)")
    return message


# KEYS: the deployment's key. ARGV: a fresh random key, stored if none is.
_GET_OR_MAKE = """
local key = redis.call('GET', KEYS[1])
if not key then
  key = ARGV[1]
  redis.call('SET', KEYS[1], key)
end
return key
"""


class ControlKey:
    """The deployment's control key: the configured secret, else the one kept in Redis (made if missing)."""

    REREAD_S = 10.0  # a publisher signs with a key read at most this long ago

    def __init__(self, client: redis.Redis, names: Names, configured: bytes | None) -> None:
        self.configured = configured
        self.name = names.control_key
        self._get_or_make = client.register_script(_GET_OR_MAKE)
        self._stored: bytes | None = None
        self._read_at = 0.0

    def get(self, refresh: bool = False) -> bytes:
        """The key; ``refresh`` reads the stored one again (made anew if the broker lost it)."""
        if self.configured is not None:
            return self.configured
        if self._stored is None or refresh:
            key = self._get_or_make(keys=[self.name], args=[secrets.token_hex(32)])
            self._stored = key.encode() if isinstance(key, str) else key
            self._read_at = time.monotonic()
        return self._stored

    def recent(self) -> bytes:
        """The key, read again if the last read is older than ``REREAD_S``."""
        return self.get(refresh=time.monotonic() - self._read_at > self.REREAD_S)


# KEYS: the nonce's seen-set, its first-seen time. ARGV: this worker, DELIVERY_WINDOW_S, SEEN_TTL_S.
# Returns 1 (act on it), 0 (this worker already did) or -1 (received past the window: a replay).
_ACCEPT = """
local now = tonumber(redis.call('TIME')[1])
redis.call('SET', KEYS[2], now, 'NX', 'EX', ARGV[3])
if now - tonumber(redis.call('GET', KEYS[2])) > tonumber(ARGV[2]) then return -1 end
local added = redis.call('SADD', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return added
"""


class ControlReceiver:
    """Accepts each genuine control message once per worker (see the module's docstring)."""

    def __init__(self, client: redis.Redis, names: Names, key: ControlKey, worker: str) -> None:
        self.r, self.names, self.key, self.worker = client, names, key, worker
        self._accept = client.register_script(_ACCEPT)

    def accept(self, raw: str | bytes) -> dict:
        """The message, to act on; raises ValueError saying why not (forged, stale, replayed...)."""
        try:
            message = verify(self.key.get(), raw)
        except BadSignature:
            if self.key.configured is not None:
                raise
            message = verify(self.key.get(refresh=True), raw)  # the stored key may have been made anew
        nonce = message["nonce"]
        keys = [self.names.control_seen(nonce), self.names.control_first_seen(nonce)]
        verdict = int(self._accept(keys=keys, args=[self.worker, DELIVERY_WINDOW_S, SEEN_TTL_S]))
        if verdict == 0:
            raise ValueError("replayed (this worker already acted on its nonce)")
        if verdict < 0:
            raise ValueError(f"replayed (first received by a worker more than {DELIVERY_WINDOW_S} s ago)")
        return message


class ControlChannel:
    def __init__(self, client: redis.Redis, names: Names, secret: bytes | None) -> None:
        """``secret``: ``configured_secret(settings)``; None signs with the deployment's key in Redis."""
        self.r = client
        self.channel = names.control_channel
        self.key = ControlKey(client, names, secret)

    @property
    def secret(self) -> bytes:
        return self.key.get()

    def publish(self, op: str, **fields) -> int:
        """Send a signed control message; returns how many listeners heard it."""
        return int(self.r.publish(self.channel, sign(self.key.recent(), op, **fields)))
