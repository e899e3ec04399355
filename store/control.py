"""Control messages to GPU workers (cancel, stream, reload) on one pub/sub channel, signed.

Anyone who can reach the broker can publish; only a holder of the deployment's
control secret can sign.  A message is JSON ``{"op": ..., ..., "ts": <unix
time>, "sig": <hex HMAC-SHA256 of the rest>}``; workers act only on messages
whose signature verifies and whose ``ts`` is within ``MAX_AGE_S`` of their
clock (a recorded message cannot be replayed later), and log every other one.

The secret is ``PAGEDQ_CONTROL_SECRET``, else a random one generated once in
the state dir (``control.key``, mode 0600): every pagedq process of one host
shares it; a deployment across hosts sets the variable on each.
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
KEY_FILE = "control.key"
MIN_KEY_BYTES = 32


def control_secret(settings: Settings) -> bytes:
    if settings.control_secret is not None:
        key = settings.control_secret.get_secret_value().encode()
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"control_secret: at least {MIN_KEY_BYTES} characters")
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


def _signature(secret: bytes, fields: dict) -> str:
    body = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()


def sign(secret: bytes, op: str, **fields) -> str:
    message = {"op": op, **fields, "ts": time.time()}
    return json.dumps({**message, "sig": _signature(secret, message)})


def verify(secret: bytes, raw: str | bytes) -> dict:
    """The message if it is signed with ``secret`` and fresh; raises ValueError saying why not."""
    message = json.loads(raw)
    if not isinstance(message, dict) or not isinstance(message.get("sig"), str):
        raise ValueError("unsigned")
    sig = message.pop("sig")
    if not hmac.compare_digest(sig, _signature(secret, message)):
        raise ValueError("bad signature")
    if not isinstance(message.get("ts"), (int, float)) or abs(time.time() - message["ts"]) > MAX_AGE_S:
        raise ValueError("stale or missing timestamp")
    return message


class ControlChannel:
    def __init__(self, client: redis.Redis, names: Names, secret: bytes) -> None:
        self.r = client
        self.channel = names.control_channel
        self.secret = secret

    def publish(self, op: str, **fields) -> int:
        """Send a signed control message; returns how many listeners heard it."""
        return int(self.r.publish(self.channel, sign(self.secret, op, **fields)))
