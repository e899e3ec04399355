"""What the GPU workers serve, and which workers are alive, as recorded in Redis.

A GPU worker registers its model (``names.model``) when it has loaded it;
preprocess checks requests against that record (context length, vocabulary).
Every worker keeps a short-lived hash (``names.worker``) with its role, pid,
readiness and, for GPU workers, engine stats after every step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import redis

from pagedq.config.names import Names


@dataclass
class ModelInfo:
    name: str
    fingerprint: str
    max_model_len: int
    vocab_size: int
    queue: str
    path: str = ""  # the worker's local Hugging Face folder (tokenizer); CPU workers on its host reuse it
    updated_at: float = 0.0
    block_size: int = 0  # the KV cache's tokens per block (0: not known), for the prompt's block names


def register_model(r: redis.Redis, names: Names, info: ModelInfo) -> None:
    """Record the model, and its name in ``names.models_index`` (what ``served_models`` reads)."""
    info.updated_at = time.time()
    pipe = r.pipeline(transaction=True)
    pipe.hset(names.model(info.name), mapping=asdict(info))
    pipe.sadd(names.models_index, info.name)
    pipe.execute()


def served_models(r: redis.Redis, names: Names) -> list[str]:
    """Names of the models GPU workers have registered, from ``names.models_index`` (one SMEMBERS and one
    pipelined read of their records, whatever the keyspace holds): a name whose record is gone is left out."""
    members = sorted(r.smembers(names.models_index))
    pipe = r.pipeline(transaction=False)
    for name in members:
        pipe.hget(names.model(name), "name")
    return [name for name, stored in zip(members, pipe.execute(), strict=True) if stored == name]


def lookup_model(r: redis.Redis, names: Names, model: str) -> ModelInfo | None:
    raw = r.hgetall(names.model(model))
    if raw.get("alias_of") and raw.get("name") == model:  # another served name of a model (store/model_names.py)
        model = raw["alias_of"]
        raw = r.hgetall(names.model(model))
    if not raw or raw.get("name") != model or raw.get("alias_of"):
        return None
    return ModelInfo(name=raw["name"], fingerprint=raw["fingerprint"], max_model_len=int(raw["max_model_len"]),
                     vocab_size=int(raw["vocab_size"]), queue=raw["queue"], path=raw.get("path", ""),
                     updated_at=float(raw.get("updated_at", 0)), block_size=int(raw.get("block_size", 0)))


def live_workers(r: redis.Redis, names: Names) -> dict[str, dict[str, str]]:
    """hostname -> the worker's record, for every worker whose record has not expired: the hostnames are those
    its heartbeat keeps in ``names.workers_index`` (no scan of the keyspace)."""
    hosts = r.zrange(names.workers_index, 0, -1)
    pipe = r.pipeline(transaction=False)
    for host in hosts:
        pipe.hgetall(names.worker(host))
    return {host: rec for host, rec in zip(hosts, pipe.execute(), strict=True) if rec}


def gpu_workers_serving(r: redis.Redis, names: Names, model: str) -> set[str]:
    """Hostnames of the live GPU workers serving ``model`` (ready or still loading)."""
    return {host for host, rec in live_workers(r, names).items()
            if rec.get("role") == "gpu" and rec.get("model") == model}


def renewed_records(r: redis.Redis, names: Names, hostnames: list[str], within_s: float,
                    poll_s: float = 0.25) -> set[str]:
    """The workers among ``hostnames`` whose record is renewed within ``within_s`` seconds from now (its TTL
    goes back up, or a field changes): only a running worker writes its record, so these are alive.  A record
    that stays as it was, or expires, outlived its worker (killed -9: the record lasts until its TTL).
    Judged by changes in Redis alone, so no clock of any host matters."""
    keys = {h: names.worker(h) for h in hostnames}

    def read() -> dict[str, tuple[dict, int]]:
        pipe = r.pipeline(transaction=False)
        for key in keys.values():
            pipe.hgetall(key)
            pipe.pttl(key)
        out = pipe.execute()
        return {h: (out[2 * i], out[2 * i + 1]) for i, h in enumerate(keys)}

    renewed: set[str] = set()
    last = read()
    deadline = time.monotonic() + within_s
    while len(renewed) < len(keys) and time.monotonic() < deadline:
        time.sleep(poll_s)
        now = read()
        renewed |= {h for h, (rec, ttl) in now.items() if rec and (rec != last[h][0] or ttl > last[h][1])}
        last = now
    return renewed


# KEYS: the record, the workers' index, then keys that live as long as the record. ARGV: TTL (s), the record's
# member in the index ("": none), then field, value, ... A beat: the fields, the Redis time of this beat
# (``beat_at``, on the broker's clock whatever the host's), the TTL itself (``ttl_s``), and the TTL refreshed,
# the other keys' too (those that exist); in the index, the member's expiry, and members a TTL past theirs dropped.
_BEAT = """
local t = redis.call('TIME')
local ttl = tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'beat_at', string.format('%d.%06d', t[1], t[2]), 'ttl_s', ARGV[1], unpack(ARGV, 3))
redis.call('EXPIRE', KEYS[1], ttl)
if ARGV[2] ~= '' then
  redis.call('ZADD', KEYS[2], tonumber(t[1]) + ttl, ARGV[2])
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', tonumber(t[1]) - ttl)
end
for i = 3, #KEYS do redis.call('EXPIRE', KEYS[i], ttl) end
return 1
"""


def worker_index_of(record_key: str) -> tuple[str, str]:
    """(the workers' index, the hostname) for a worker's record key (``names.worker``: a Celery hostname, which
    holds no colon); ("", "") for another key."""
    prefix, sep, hostname = record_key.rpartition("worker:")
    return (f"{prefix}workers", hostname) if sep and hostname and ":" not in hostname else ("", "")


class Heartbeat(threading.Thread):
    """Keeps a worker's record alive (its TTL refreshed every ``ttl_s / 3``) while the process runs.

    Every beat is one script: the record never exists without its TTL, carries ``ttl_s`` (so a reader can tell
    a fresh record from one about to expire: ``store.jobs`` ``admit``) and ``beat_at``, the Redis time of the
    last beat.  ``updated_at`` stays the host's time, for display.
    """

    def __init__(self, r: redis.Redis, key: str, fields: dict, ttl_s: int = 15, also: Sequence[str] = ()) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.r, self.key, self.ttl_s = r, key, ttl_s
        # keys written by other threads that must live exactly as long as the record (a GPU worker's prefix-cache
        # set: its stepping thread refreshes it each step, but a step may outlast the TTL)
        self.also = list(also)
        self.fields = dict(fields)  # written by every beat: a record that expired (a beat missed) comes back whole
        # A worker's record is listed in ``names.workers_index`` (``live_workers`` reads it: no scan)
        self.index, self.member = worker_index_of(key)
        self._beat = r.register_script(_BEAT)
        self.beat()

    def beat(self) -> None:
        pairs = [x for k, v in {**self.fields, "updated_at": time.time()}.items() for x in (k, v)]
        self._beat(keys=[self.key, self.index or self.key, *self.also], args=[self.ttl_s, self.member, *pairs])

    def update(self, **fields) -> None:
        """Change fields of the record (e.g. ``ready``), now and in every later beat."""
        self.fields.update(fields)
        self.beat()

    def run(self) -> None:
        while True:
            time.sleep(self.ttl_s / 3)
            try:
                self.beat()
            except redis.RedisError:
                pass  # the broker is away; the record expires, and comes back with it


class ModelLookups:
    """``lookup_model`` and ``served_models`` remembered for ``ttl_s``: a producer validating a batch of 50,000
    lines naming one model (known or not) reads its record about once a second, not once a line."""

    def __init__(self, r: redis.Redis, names: Names, ttl_s: float = 1.0) -> None:
        self.r, self.names, self.ttl_s = r, names, ttl_s
        self._infos: dict[str, tuple[float, ModelInfo | None]] = {}
        self._served: tuple[float, list[str]] = (-ttl_s, [])

    def lookup(self, model: str) -> ModelInfo | None:
        at, info = self._infos.get(model, (-self.ttl_s, None))
        if time.monotonic() - at >= self.ttl_s:
            if len(self._infos) > 1024:  # names come from requests: keep the memo small
                self._infos.clear()
            info = lookup_model(self.r, self.names, model)
            self._infos[model] = (time.monotonic(), info)
        return info

    def served(self) -> list[str]:
        at, models = self._served
        if time.monotonic() - at >= self.ttl_s:
            models = served_models(self.r, self.names)
            self._served = (time.monotonic(), models)
        return list(models)
