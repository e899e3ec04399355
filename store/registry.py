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
    info.updated_at = time.time()
    r.hset(names.model(info.name), mapping=asdict(info))


def lookup_model(r: redis.Redis, names: Names, model: str) -> ModelInfo | None:
    raw = r.hgetall(names.model(model))
    if not raw or raw.get("name") != model:
        return None
    return ModelInfo(name=raw["name"], fingerprint=raw["fingerprint"], max_model_len=int(raw["max_model_len"]),
                     vocab_size=int(raw["vocab_size"]), queue=raw["queue"], path=raw.get("path", ""),
                     updated_at=float(raw.get("updated_at", 0)), block_size=int(raw.get("block_size", 0)))


def live_workers(r: redis.Redis, names: Names) -> dict[str, dict[str, str]]:
    """hostname -> the worker's record, for every worker whose record has not expired."""
    keys = list(r.scan_iter(match=names.worker_pattern, count=100))
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
    prefix = names.worker("")
    return {key[len(prefix):]: rec for key, rec in zip(keys, pipe.execute(), strict=True) if rec}


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


# KEYS: the record, then keys that live as long as it. ARGV: TTL (s), then field, value, ... A beat: the fields,
# the Redis time of this beat (``beat_at``, on the broker's clock whatever the host's), the TTL itself
# (``ttl_s``), and the TTL refreshed, the other keys' too (those that exist).
_BEAT = """
local t = redis.call('TIME')
redis.call('HSET', KEYS[1], 'beat_at', string.format('%d.%06d', t[1], t[2]), 'ttl_s', ARGV[1], unpack(ARGV, 2))
for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[1]) end
return 1
"""


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
        self._beat = r.register_script(_BEAT)
        self.beat()

    def beat(self) -> None:
        pairs = [x for k, v in {**self.fields, "updated_at": time.time()}.items() for x in (k, v)]
        self._beat(keys=[self.key, *self.also], args=[self.ttl_s, *pairs])

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
