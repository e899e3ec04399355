"""Sentinel broker URLs (``store/connection.py``): parsing in Celery's form, and a client that follows a failover,
against real redis-servers (a master, a replica, a sentinel; passwords on all three, the sentinel's its own)."""

from __future__ import annotations

import secrets

import pytest
import redis
from queue_helpers import wait_until
from redis_nodes import Node, pings

from pagedq.config import Settings
from pagedq.config.sentinel import SENTINEL_PORT
from pagedq.store.connection import (
    SentinelAddress,
    mask_url,
    parse_sentinel_url,
    redis_client,
    sentinel_kwargs,
)


def test_a_sentinel_url_names_every_sentinel_and_the_data_nodes_credentials():
    pw = secrets.token_urlsafe(12)
    url = f"sentinel://:{pw}@127.0.0.1:26380/2;sentinel://:{pw}@10.0.0.7/2; sentinel://:{pw}@[::1]:26390/2"
    assert parse_sentinel_url(url) == SentinelAddress(
        (("127.0.0.1", 26380), ("10.0.0.7", SENTINEL_PORT), ("::1", 26390)), None, pw, 2)
    assert parse_sentinel_url(f"sentinel://ops:{pw}@h1") == SentinelAddress((("h1", SENTINEL_PORT),), "ops", pw, 0)
    assert parse_sentinel_url(f"redis://:{pw}@127.0.0.1:6379/0") is None
    assert pw not in mask_url(url) and mask_url(url).count("***") == 3
    settings = Settings(redis_sentinel_password="sentinels-own")
    assert sentinel_kwargs(settings, parse_sentinel_url(url))["password"] == "sentinels-own"
    assert sentinel_kwargs(None, parse_sentinel_url(url))["password"] == pw
    assert sentinel_kwargs(None, parse_sentinel_url(url))["retry"] is None, "the next sentinel is the retry"


@pytest.mark.parametrize("url, what", [
    ("sentinel://:a@h1:26379/0;sentinel://:b@h2:26379/0", "different"),
    ("sentinel://:a@h1:26379/0;sentinel://:a@h2:26379/1", "different"),
    ("sentinel://:a@h1:26379/0;redis://:a@h2:6379/0", "sentinel:// URLs only"),
    ("sentinel://:a@:26379/0", "no host"),
    ("sentinel://:a@h1:26379/x", "not a number"),
])
def test_a_bad_sentinel_url_is_refused_naming_what_is_wrong(url, what):
    with pytest.raises(ValueError, match=what) as e:
        parse_sentinel_url(url)
    assert "PAGEDQ_BROKER_URL" in str(e.value) and ":a@" not in str(e.value)


@pytest.fixture
def topology(tmp_path):
    data_pw, sentinel_pw = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    master = Node(tmp_path / "m", "master", [f"requirepass {data_pw}", f"masterauth {data_pw}"])
    wait_until(lambda: pings(master.port, data_pw), 15, what="the master up")
    replica = Node(tmp_path / "r", "replica", [f"requirepass {data_pw}", f"masterauth {data_pw}",
                                               f"replicaof 127.0.0.1 {master.port}"])
    sentinel = Node(tmp_path / "s", "sentinel", [
        f"requirepass {sentinel_pw}", f"sentinel monitor pagedq 127.0.0.1 {master.port} 1",
        f"sentinel auth-pass pagedq {data_pw}", "sentinel down-after-milliseconds pagedq 1000",
        "sentinel failover-timeout pagedq 5000"], sentinel=True)
    nodes = [master, replica, sentinel]
    try:
        wait_until(lambda: pings(sentinel.port, sentinel_pw), 15, what="the sentinel up")
        # A failover needs a replica the sentinel knows (it learns them from the master's INFO, every 10 s).
        wait_until(lambda: _sentinel_knows_a_replica(sentinel.port, sentinel_pw), 30, interval=0.2,
                   what="the sentinel to know the synced replica")
        yield master, replica, sentinel, data_pw, sentinel_pw
    finally:
        for node in nodes:
            node.kill()


def _sentinel_knows_a_replica(port: int, password: str) -> bool:
    try:
        replicas = redis.Redis(port=port, password=password, socket_timeout=1,
                               decode_responses=True).sentinel_slaves("pagedq")
    except redis.RedisError:
        return False
    return any(r.get("is_slave") and not r.get("is_disconnected") and not r.get("is_sdown") and
               r.get("master-link-status") == "ok" for r in replicas)


def test_a_client_on_a_sentinel_url_writes_to_the_master_and_follows_a_failover(topology):
    master, replica, sentinel, data_pw, sentinel_pw = topology
    settings = Settings(redis_sentinel_password=sentinel_pw)
    url = f"sentinel://:{data_pw}@127.0.0.1:{sentinel.port}/0"
    r = redis_client(url, timeout_s=5, settings=settings)
    key, value = f"k-{secrets.token_hex(4)}", secrets.token_hex(8)
    r.set(key, value)
    assert redis.Redis(port=master.port, password=data_pw, decode_responses=True).get(key) == value
    wait_until(lambda: r.wait(1, 1000) >= 1, 30, what="the replica to acknowledge the write")
    master.kill()  # kill -9

    def written_after_failover() -> bool:
        try:
            r.set(f"{key}-after", value)
            return True
        except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
            return False  # the failover is under way: the sentinels have not named a new master yet

    wait_until(written_after_failover, 60, interval=0.2, what="a write after the failover")
    new = redis.Redis(port=replica.port, password=data_pw, decode_responses=True)
    assert new.info("replication")["role"] == "master"
    assert new.get(key) == value and new.get(f"{key}-after") == value
    assert r.get(key) == value


def test_a_bad_sentinel_url_fails_the_settings_naming_the_broker_url():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="broker_url"):
        Settings(broker_url="sentinel://:a@h1:26379/0;sentinel://:b@h2:26379/0")


def test_the_hardened_transport_runs_over_sentinel_and_follows_a_failover(topology):
    """kombu with Celery's own options for a sentinel:// URL: the channel is the hardened one (leases), messages
    go through the master the sentinel names, and after kill -9 of that master a new connection reaches the
    promoted replica, where a message sent before the failover (acknowledged by the replica) still waits."""
    from kombu import Connection

    from pagedq.config.celery_app import celery_config, use_hardened_transport
    from pagedq.store.transport import LeaseQoS, SentinelChannel

    master, replica, sentinel, data_pw, sentinel_pw = topology
    settings = Settings(redis_sentinel_password=sentinel_pw, key_prefix="snt:")
    url = f"sentinel://:{data_pw}@127.0.0.1:{sentinel.port}/0"
    use_hardened_transport()
    options = celery_config(settings, url)["broker_transport_options"]
    assert options["master_name"] == "pagedq" and options["sentinel_kwargs"]["password"] == sentinel_pw
    sent = [secrets.token_hex(6) for _ in range(3)]
    with Connection(url, transport_options=options) as conn:
        queue = conn.SimpleQueue("snt-q")
        assert isinstance(queue.channel, SentinelChannel) and queue.channel.QoS is LeaseQoS
        for body in sent:
            queue.put({"n": body})
        got = queue.get(timeout=5)
        assert got.payload == {"n": sent[0]}
        got.ack()
        direct = redis.Redis(port=master.port, password=data_pw)
        assert sum(direct.llen(k) for k in direct.keys("snt:snt-q*")) == 2, "the messages are on the master"
        assert direct.wait(1, 5000) >= 1
        queue.close()
    master.kill()
    wait_until(lambda: _role(replica.port, data_pw) == "master", 60, interval=0.2, what="the replica promoted")
    with Connection(url, transport_options=options) as conn:
        queue = conn.SimpleQueue("snt-q")
        bodies = []
        for _ in range(2):
            msg = queue.get(timeout=10)
            bodies.append(msg.payload["n"])
            msg.ack()
        assert bodies == sent[1:]
        queue.close()


def _role(port: int, password: str) -> str | None:
    try:
        return redis.Redis(port=port, password=password, socket_timeout=1).info("replication")["role"]
    except redis.RedisError:
        return None


def test_the_gateways_clients_follow_a_failover(topology):
    """The gateway's three clients on a sentinel:// URL (the Client's, the bytes one for file contents, the asyncio
    one its waiting requests use) write to the master the sentinel names, and after kill -9 of it, to the
    promoted replica, with no new Gateway."""
    import asyncio

    from pagedq.pipeline.gateway.state import Gateway

    master, replica, sentinel, data_pw, sentinel_pw = topology
    url = f"sentinel://:{data_pw}@127.0.0.1:{sentinel.port}/0"
    gateway = Gateway(Settings(broker_url=url, redis_sentinel_password=sentinel_pw, broker_timeout_s=2), url)
    loop = asyncio.new_event_loop()
    key, content = f"gw-{secrets.token_hex(4)}", secrets.token_bytes(32)

    async def async_roundtrip(suffix: str) -> str | None:
        r = gateway.aredis()
        await r.set(f"{key}-async{suffix}", suffix)
        return await r.get(f"{key}-async{suffix}")

    def all_three(suffix: str) -> bool:
        try:
            gateway.r.set(f"{key}-sync{suffix}", suffix)
            gateway.raw.set(f"{key}-raw{suffix}", content)
            return (loop.run_until_complete(async_roundtrip(suffix)) == suffix
                    and gateway.raw.get(f"{key}-raw{suffix}") == content)
        except (redis.ConnectionError, redis.TimeoutError, redis.ReadOnlyError):
            return False  # the failover is under way

    try:
        assert all_three("-before")
        direct = redis.Redis(port=master.port, password=data_pw)
        assert direct.get(f"{key}-raw-before") == content and direct.get(f"{key}-async-before") == b"-before"
        assert direct.wait(1, 5000) >= 1
        master.kill()  # kill -9
        wait_until(lambda: all_three("-after"), 60, interval=0.2, what="all three clients writing after the failover")
        new = redis.Redis(port=replica.port, password=data_pw)
        assert new.info("replication")["role"] == "master"
        assert [new.get(f"{key}-{c}-after") for c in ("sync", "async")] == [b"-after", b"-after"]
        assert new.get(f"{key}-raw-after") == content and new.get(f"{key}-raw-before") == content
    finally:
        loop.run_until_complete(gateway.aclose())
        loop.close()
        gateway.close()
