"""Control messages on the real redis-server, without a model: one key per deployment, each message acted on once.

The tests with a running GPU worker (a cancel that lands while the listener is
disconnected, a replayed reload) reuse test_result_cache.py's stack.
"""

from __future__ import annotations

import json
import secrets
import time

import pytest

from pagedq.config import Settings
from pagedq.config.names import Names
from pagedq.store import control


@pytest.fixture
def names() -> Names:
    return Names(f"pctl{secrets.token_hex(4)}:", "pctl.")


def host(tmp_path, name: str, **fields) -> Settings:
    """The settings of one host of a deployment: its own state dir, nothing shared but the broker."""
    return Settings(state_dir=tmp_path / name, **fields)


def receiver(redis, names: Names, settings: Settings, worker: str) -> control.ControlReceiver:
    key = control.ControlKey(redis, names, control.configured_secret(settings))
    return control.ControlReceiver(redis, names, key, worker)


def test_every_host_of_a_deployment_signs_with_the_same_key(redis, names, tmp_path):
    a, b = host(tmp_path, "a"), host(tmp_path, "b")
    publisher = control.ControlChannel(redis, names, control.configured_secret(a))
    job_id = secrets.token_hex(8)
    raw = control.sign(publisher.secret, "cancel", job_id=job_id)
    assert receiver(redis, names, b, "gpu-b").accept(raw)["job_id"] == job_id
    assert redis.get(names.control_key).encode() == publisher.secret and len(publisher.secret) >= 32
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists(), "no key file on either host"
    other_deployment = Names(names.key_prefix + "other:", "pctl.")
    assert control.ControlKey(redis, other_deployment, None).get() != publisher.secret


def test_a_key_made_anew_is_adopted_by_listeners(redis, names, tmp_path):
    """The stored key lost (a broker restarted without persistence) and made anew by a new process."""
    listener = receiver(redis, names, host(tmp_path, "a"), "gpu-a")
    old = listener.key.get()
    redis.delete(names.control_key)
    publisher = control.ControlChannel(redis, names, None)
    assert publisher.secret != old
    assert listener.accept(control.sign(publisher.secret, "stream", job_id="j"))["op"] == "stream"
    assert listener.key.get() == publisher.secret
    made_anew = publisher.secret
    redis.set(names.control_key, secrets.token_hex(32))  # and again: a publisher signs with a key read recently
    publisher.key._read_at -= control.ControlKey.REREAD_S
    publisher.publish("cancel", job_id="j")
    assert publisher.secret != made_anew and publisher.secret == redis.get(names.control_key).encode()


def test_a_replay_is_ignored_and_each_worker_acts_once(redis, names, tmp_path):
    settings = host(tmp_path, "a")
    first, second = receiver(redis, names, settings, "gpu-1"), receiver(redis, names, settings, "gpu-2")
    raw = control.sign(first.key.get(), "reload", model=f"m{secrets.token_hex(3)}")
    assert first.accept(raw)["op"] == "reload"
    with pytest.raises(ValueError, match="replayed"):
        first.accept(raw)
    assert second.accept(raw)["op"] == "reload", "every worker acts on a message once"
    with pytest.raises(ValueError, match="replayed"):
        second.accept(raw)
    seen = names.control_seen(json.loads(raw)["nonce"])
    assert redis.smembers(seen) == {"gpu-1", "gpu-2"} and 0 < redis.ttl(seen) <= control.SEEN_TTL_S
    assert control.SEEN_TTL_S > 2 * control.MAX_AGE_S, "remembered past the last moment it is fresh anywhere"


def test_messages_without_a_nonce_or_signed_with_another_key_are_refused(redis, names, tmp_path):
    configured = host(tmp_path, "a", control_secret=secrets.token_hex(32))
    listener = receiver(redis, names, configured, "gpu-1")
    message = {"op": "cancel", "job_id": "j", "ts": time.time()}  # as signed before nonces
    unnonced = json.dumps({**message, "sig": control._signature(listener.key.get(), message)})
    with pytest.raises(ValueError, match="nonce"):
        listener.accept(unnonced)
    stranger = control.sign(control.ControlKey(redis, names, None).get(), "cancel", job_id="j")
    with pytest.raises(control.BadSignature, match="another control key"):
        listener.accept(stranger)
    tampered = json.dumps({**json.loads(control.sign(listener.key.get(), "cancel", job_id="j")), "job_id": "k"})
    with pytest.raises(control.BadSignature, match="bad signature"):
        listener.accept(tampered)
