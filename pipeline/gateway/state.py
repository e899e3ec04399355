"""What every route needs, built once per gateway process: the producer, Redis, the stores, the keys.

Nothing here is per request or per tenant: all of that lives in Redis, so
gateway processes are interchangeable.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import redis
import redis.asyncio as aredis
from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from pagedq.config import Settings
from pagedq.config.names import JobState
from pagedq.pipeline.client import Client, JobNotFoundError, JobStatus
from pagedq.pipeline.gateway.batches import BatchStore
from pagedq.pipeline.gateway.config import GatewayConfig, GatewayKeys
from pagedq.pipeline.gateway.errors import RETRY_AFTER_S, ApiError
from pagedq.pipeline.gateway.files import FileStore
from pagedq.pipeline.gateway.follow import Follower, Tick
from pagedq.pipeline.gateway.keys import ANONYMOUS, KeyRing, Tenant
from pagedq.pipeline.gateway.ledger import StoredBytes
from pagedq.pipeline.gateway.limits import TenantLimits
from pagedq.pipeline.protocol import scoped_cache_salt
from pagedq.store.connection import async_redis_client, redis_client
from pagedq.store.connection import broker_url as find_broker_url
from pagedq.store.registry import ModelLookups, live_workers

LIVENESS_CACHE_S = 2.0  # how long "a worker serves model M" is believed without looking again
READY_CACHE_S = 1.0  # how long the ready workers' counts are believed without looking again
ASYNC_POOL_SIZE = 64  # asyncio Redis connections per gateway process; a call waits for a free one
MAX_CONCURRENT_UPLOADS = 4  # file uploads one gateway process receives at once (each held whole: max_file_bytes)
MAX_TENANT_UPLOADS = 2  # of those, one tenant's: a tenant uploading more is refused (429) before the others are


@dataclass
class Admission:
    """The completion requests one gateway process serves at once, at most ``limit``.

    Counted on the event loop (no lock needed).  A request over the limit is refused before its job is
    created: 503 with ``Retry-After``, so a client's retry never duplicates work."""

    limit: int
    serving: int = 0
    what: str = "completion requests (PAGEDQ_GATEWAY_LIMIT_CONCURRENCY)"

    def enter(self) -> Callable[[], None]:
        """Take a place (``ApiError`` 503 if none is left); returns its release, which is idempotent."""
        if self.serving >= self.limit:
            raise ApiError(503, f"This gateway process is serving its limit of {self.limit} {self.what}; retry "
                                "shortly.", None, "service_unavailable", RETRY_AFTER_S)
        self.serving += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.serving -= 1
        return release


class Gateway:
    def __init__(self, settings: Settings, broker_url: str | None = None, config: GatewayConfig | None = None,
                 keyring: KeyRing | None = None) -> None:
        self.config = config or GatewayConfig.from_env()
        self.keyring = keyring
        self.url = broker_url or find_broker_url(settings)
        self.client = Client(settings, self.url)
        self.client.reads_local_folders = False  # tenants name models, not this host's folders
        if keyring is not None:  # the keys file's weights are what this gateway writes for its tenants
            self.client.weights.update({t.name: t.weight for t in keyring.tenants()})
        self.settings, self.names, self.r = self.client.settings, self.client.names, self.client.r
        self.keys = GatewayKeys(self.settings.key_prefix)
        # Bytes replies, for file contents; the same server, password and TLS as the Client's connection.
        self.raw = redis_client(self.url, self._socket_timeout_s, self.settings, decode_responses=False)
        self.limits = TenantLimits(self.r, self.keys, self.names.job(""))
        self.files = FileStore(self.r, self.raw, self.keys, self.config.file_ttl_s, self.settings.file_store_share)
        self.stored = StoredBytes(self.r, self.names, self.keys)  # files, responses and results, per tenant
        self.batches = BatchStore(self.client, self.files, self.limits, self.keys, self.config)
        self.admission = Admission(self.settings.gateway_limit_concurrency)
        self.uploads = Admission(MAX_CONCURRENT_UPLOADS, what="file uploads at once")  # bounds their memory
        self._tenant_uploads: dict[str, int] = {}  # tenant -> its uploads this process receives now
        self._aredis: aredis.Redis | None = None
        self._follower: Follower | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._live: dict[str, tuple[float, bool]] = {}
        self._ready: tuple[float, dict[str, int]] = (-READY_CACHE_S, {})
        self._models = ModelLookups(self.r, self.names)

    def enter_upload(self, tenant: Tenant) -> Callable[[], None]:
        """Take an upload's place (on the event loop): 429 naming ``file`` when the tenant already sends
        ``MAX_TENANT_UPLOADS`` to this process (so one tenant cannot take every place), 503 when the process
        receives ``MAX_CONCURRENT_UPLOADS``.  Returns the place's release, which is idempotent."""
        mine = self._tenant_uploads.get(tenant.name, 0)
        if mine >= MAX_TENANT_UPLOADS:
            raise ApiError(429, f"file: this gateway process is receiving {mine} uploads of tenant "
                                f"{tenant.name!r} already, at most {MAX_TENANT_UPLOADS} at once; retry when one "
                                "has ended.", "file", "rate_limit_exceeded", RETRY_AFTER_S)
        release_place = self.uploads.enter()
        self._tenant_uploads[tenant.name] = mine + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                release_place()
                left = self._tenant_uploads[tenant.name] - 1
                if left:
                    self._tenant_uploads[tenant.name] = left
                else:
                    del self._tenant_uploads[tenant.name]
        return release

    def close(self) -> None:
        self.client.close()
        self.raw.close()

    @property
    def _socket_timeout_s(self) -> float:
        return self.settings.broker_timeout_s + 2  # above the 1 s blocking reads of follow.py

    def aredis(self) -> aredis.Redis:
        """The asyncio Redis client of the running event loop: a blocking pool of ``ASYNC_POOL_SIZE``
        connections, so a burst of calls waits for a free connection (up to ``broker_timeout_s``) rather than
        failing."""
        self._bind_loop()
        return self._aredis

    def follower(self) -> Follower:
        """What every waiting request of this event loop follows its job with (see ``follow``)."""
        self._bind_loop()
        return self._follower

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._aredis = async_redis_client(self.url, self._socket_timeout_s, self.settings.broker_timeout_s,
                                              ASYNC_POOL_SIZE, self.settings)
            self._follower = Follower(self._aredis, self.names)
            self._loop = loop

    async def aclose(self) -> None:
        """Stop following and close the asyncio connections (on the loop that made them)."""
        if self._loop is asyncio.get_running_loop():
            await self._follower.close()
            await self._aredis.aclose()
            self._loop = None

    # --- who is asking ----------------------------------------------------------------------------------
    def tenant_for(self, authorization: str | None) -> Tenant:
        if self.keyring is None:
            return ANONYMOUS
        tenant = self.keyring.tenant_for(authorization)
        if tenant is None:
            raise ApiError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.", None,
                           "invalid_api_key")
        return tenant

    # --- jobs -------------------------------------------------------------------------------------------
    def owned_job(self, job_id: str, tenant: Tenant) -> tuple[JobStatus, dict[str, str]]:
        """The job's status and record; 404 unless it is the tenant's."""
        rec = self.client.store.get(job_id)
        if not rec or rec.get("tenant") != tenant.name:
            raise ApiError.not_found("job", job_id)
        return JobStatus.from_record(job_id, rec), rec

    def submit(self, tenant: Tenant, kwargs: dict) -> str:
        """``Client.submit(**kwargs)`` within the tenant's limits (its storage quota among them: 429 while it
        stores ``max_stored_bytes``); the job is written with its tenant, and runs in its cache scope
        (``scoped_cache_salt``: no other tenant's cached answers or prompt blocks)."""
        kwargs = {**kwargs, "cache_salt": scoped_cache_salt(tenant.cache_scope, kwargs.get("cache_salt"))}
        self.stored.check_room(tenant)
        reservation = self.limits.reserve(tenant, 1)
        try:
            job_id = self.client.submit(**kwargs, tenant=tenant.name)
        except BaseException:
            self.limits.release(tenant, reservation)
            raise
        self.limits.commit(tenant, reservation, [job_id])
        return job_id

    def request_stream(self, job_id: str) -> None:
        """Ask the job's GPU worker to publish text deltas (for a job submitted without ``stream``)."""
        self.client.store.request_stream(job_id)
        self.client.control.publish("stream", job_id=job_id)

    def cancel_quietly(self, job_id: str) -> None:
        try:
            self.client.cancel(job_id)
        except (JobNotFoundError, redis.RedisError):
            pass

    def expire_if_due(self, job_id: str, rec: dict[str, str]) -> None:
        """End a job that is still queued past its deadline (``timeout_s``), as a GPU worker would on taking it.

        Once the deadline has passed no worker admits the job, so ending it here cannot race a start."""
        expires = rec.get("expires_at")
        if rec.get("state") == JobState.QUEUED and expires and float(expires) < time.time():
            self.client.store.expire_if_due(job_id)  # decided in one script: never a job that has started

    def expiry_tick(self, job_id: str) -> Tick:
        """A follow tick that ends the job if it is still queued past its deadline (off the event loop, and
        only for a queued job with a deadline: a thousand followers tick every second)."""
        async def tick(rec: dict[str, str]) -> None:
            if rec.get("state") == JobState.QUEUED and rec.get("expires_at"):
                await run_in_threadpool(self.expire_if_due, job_id, rec)
        return tick

    # --- workers ----------------------------------------------------------------------------------------
    def ready_workers(self) -> dict[str, int]:
        """Ready GPU workers per model, from their heartbeat records (read from the workers' index, no scan; at
        most every READY_CACHE_S: ``/ready`` is unauthenticated and polled)."""
        at, counts = self._ready
        if time.monotonic() - at >= READY_CACHE_S:
            counts = {}
            for rec in live_workers(self.r, self.names).values():
                if rec.get("role") == "gpu" and rec.get("ready") == "1" and rec.get("model"):
                    counts[rec["model"]] = counts.get(rec["model"], 0) + 1
            self._ready = (time.monotonic(), counts)
        return dict(counts)

    def served_models(self) -> list[str]:
        """The registered models (``/v1/models``), remembered a second (``ModelLookups``)."""
        return self._models.served()

    def serves(self, model: str) -> bool:
        """Whether a ready GPU worker serves ``model`` (looked up at most every LIVENESS_CACHE_S)."""
        checked_at, live = self._live.get(model, (0.0, False))
        if time.monotonic() - checked_at > LIVENESS_CACHE_S:
            live = model in self.ready_workers()
            self._live[model] = (time.monotonic(), live)
        return live


def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def current_tenant(request: Request) -> Tenant:
    """The request's tenant (401 without a valid key), its request counted against the tenant's rate."""
    gw = gateway(request)
    tenant = gw.tenant_for(request.headers.get("authorization"))
    gw.limits.count_request(tenant)
    return tenant


TenantDep = Annotated[Tenant, Depends(current_tenant)]
