"""OpenAI's Batches API on top of pagedq batches (``Client.submit_batch``).

An OpenAI batch is a pagedq batch (the same id) plus a hash of what OpenAI's
batch object needs and pagedq's does not: tenant, input file, endpoint,
metadata, the ids and quotas of its output files and, once finalized, its
status, counts and output files.

A batch is finalized when its last job ends, not when it is read: ``finish``
(store/jobs.py) queues it in ``names.batches_to_finalize`` and keeps its jobs'
records and results until then; a ``BatchFinalizer`` (a thread of every CPU
worker; a gateway reading a batch that is done but not finalized does the same)
writes the output file (the lines with status 200) and the error file (the
others), each in input order, in chunks within the tenant's quota, then gives
the records their TTL.  One process at a time finalizes a batch (a lock it
renews); a finalizer that dies leaves the batch queued for the next.  A job
whose record is gone anyway (a batch from before finalizers) gets an error
line, and a batch with nothing left reads ``expired`` with its total: never a 500.

The two output files take their places in the tenant's ``max_files`` when the
batch is created (429 then if there is no room); their bytes count against
``max_stored_bytes`` as they are written, and lines beyond the room are left
out, named in the batch's ``errors``.

Status: ``in_progress`` while jobs run (``cancelling`` after a cancel), then
``finalizing`` while its files are written, then ``completed``, ``cancelled``
(partial output), or ``expired`` when jobs were not started within the
completion window.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import redis
from pydantic import BaseModel, ConfigDict, Field

from pagedq.config import Settings
from pagedq.config.names import Names
from pagedq.pipeline.client import Client, JobNotFoundError, JobStatus
from pagedq.pipeline.client import _output_line as output_line
from pagedq.pipeline.gateway.config import GatewayConfig, GatewayKeys
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.files import FileStore, OutputFile, page_ids
from pagedq.pipeline.gateway.keys import DEFAULT_MAX_FILES, DEFAULT_MAX_STORED_BYTES, Tenant
from pagedq.pipeline.gateway.limits import TenantLimits
from pagedq.pipeline.gateway.shapes import BatchObject, RequestCounts, list_page
from pagedq.pipeline.postprocess import batch_output_line
from pagedq.pipeline.protocol import RequestError, Text, scoped_cache_salt, split_lines
from pagedq.store.locks import OwnedLock

log = logging.getLogger(__name__)

COMPLETION_WINDOW_S = 24 * 3600
OUTPUT_RESERVATION_S = 7 * 24 * 3600  # the places of a batch's output files are held this long at most
FINALIZE_INTERVAL_S = 1.0  # how often a finalizer looks for batches that ended
FINALIZE_LOCK_S = 60  # a finalizer that stops renewing its lock this long is taken as dead
FINALIZE_CHUNK = 500  # job records read, and output lines written, at once
ORPHAN_GRACE_S = 60  # a batch ended without a gateway hash may still be getting one for this long


class BatchCreate(BaseModel):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: Annotated[Text, Field(min_length=1, max_length=200)]
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    output_expires_after: dict | None = None  # accepted; output files expire like every file (file_ttl_s)


def prepare_line(line: str, endpoint: str, max_priority: int, default_priority: int, cache_scope: str = "") -> str:
    """A batch input line as its tenant may run it.

    A line for another endpoint than the batch's is made to fail, naming ``url``; a ``priority`` above the
    tenant's highest is lowered to it (a line without one gets the default, capped); with ``cache_scope``, its
    ``cache_salt`` is the tenant's (``scoped_cache_salt``).  Lines that are not JSON objects are left as they
    are: the request schema reports them.
    """
    try:
        item = json.loads(line)
    except (ValueError, RecursionError):
        return line
    if not isinstance(item, dict):
        return line
    changed = False
    if isinstance(item.get("url"), str) and item["url"] != endpoint:
        item["url"] = f"{item['url']} (this batch's endpoint is {endpoint})"
        changed = True
    body = item.get("body")
    if isinstance(body, dict) and max_priority < 9:
        if body.get("priority") is None and default_priority > max_priority:
            body["priority"], changed = max_priority, True
        elif _number(body.get("priority")) > max_priority:  # "8" too: the schema reads it as 8
            body["priority"], changed = max_priority, True
    if isinstance(body, dict) and cache_scope:
        body["cache_salt"], changed = scoped_cache_salt(cache_scope, body.get("cache_salt")), True
    return json.dumps(item) if changed else line


def _number(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return float("-inf")


class BatchStore:
    def __init__(self, client: Client, files: FileStore, limits: TenantLimits, keys: GatewayKeys,
                 config: GatewayConfig) -> None:
        self.client = client
        self.r = client.r
        self.names = client.names
        self.files = files
        self.limits = limits
        self.keys = keys
        self.config = config
        self.finalizer = BatchFinalizer(self.r, self.names, keys, files, client.settings.result_ttl_s,
                                        config.file_ttl_s)
        # Batch cancels walk their jobs here, one batch at a time, off the request threads.
        self._cancels = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-cancel")

    # --- creating -------------------------------------------------------------------------------------
    def create(self, tenant: Tenant, req: BatchCreate) -> dict:
        lines = self._input_lines(tenant, req.input_file_id)
        default = self.client.batch_priority
        lines = [prepare_line(line, req.endpoint, tenant.max_priority, default, tenant.cache_scope) for line in lines]
        self._check_models(req.input_file_id, lines)
        outputs = self._reserve_outputs(tenant)
        try:
            batch_id, reservation = self._submit(tenant, lines)
        except BaseException:
            for file_id in outputs.values():
                self.files.release(file_id)
            raise
        job_ids = self.r.lrange(self.names.batch_jobs(batch_id), 0, -1)
        now = int(time.time())
        meta = {"tenant": tenant.name, "input_file_id": req.input_file_id, "endpoint": req.endpoint,
                "completion_window": req.completion_window, "metadata": json.dumps(req.metadata),
                "created_at": now, "total": len(job_ids), **outputs, "quota_bytes": tenant.max_stored_bytes,
                "quota_files": tenant.max_files, "file_ttl_s": self.config.file_ttl_s}
        pipe = self.r.pipeline(transaction=True)  # the jobs were written with their tenant (submit_batch)
        pipe.hset(self.keys.batch(batch_id), mapping=meta)
        pipe.expire(self.keys.batch(batch_id), self.config.file_ttl_s)
        pipe.zadd(self.keys.batches_of(tenant.name), {batch_id: time.time()})
        pipe.execute()
        self.limits.commit(tenant, reservation, job_ids)
        return self.get(batch_id, tenant)

    def _submit(self, tenant: Tenant, lines: list[str]) -> tuple[str, str | None]:
        """(batch id, the tenant's reservation of room for its jobs) once the lines are sent."""
        reservation = self.limits.reserve(tenant, len(lines))
        try:
            return self.client.submit_batch(lines, timeout_s=COMPLETION_WINDOW_S, tenant=tenant.name), reservation
        except BaseException:
            self.limits.release(tenant, reservation)
            raise

    def _check_models(self, file_id: str, lines: list[str]) -> None:
        """400 naming ``input_file_id`` and the first line that names a model no worker serves, before anything
        is written (as OpenAI fails a batch whose model does not exist): a batch of 50,000 such lines is one
        refusal, not 50,000 failed jobs.  Each distinct model is looked up once."""
        first_line: dict[object, int] = {}
        for number, line in enumerate(lines, 1):
            try:
                body = json.loads(line).get("body")
            except (ValueError, RecursionError, AttributeError):
                continue  # not a JSON object: the request schema names what is wrong with the line
            model = body.get("model") if isinstance(body, dict) else None
            if isinstance(model, str | None):
                first_line.setdefault(model, number)
        for model, number in first_line.items():
            try:
                self.client.check_model(model)
            except RequestError as e:
                raise ApiError(400, f"input_file_id: line {number} of file {file_id!r}: {e}", "input_file_id",
                               e.code or "invalid_request_error") from None

    def _reserve_outputs(self, tenant: Tenant) -> dict[str, str]:
        """Take the places of the batch's output and error files in the tenant's ``max_files`` (429 if none)."""
        suffix = uuid.uuid4().hex[:24]
        outputs = {"output_file": f"file-output-{suffix}", "error_file": f"file-error-{suffix}"}
        until = time.time() + OUTPUT_RESERVATION_S
        for kind, file_id in outputs.items():
            refusal = self.files.claim(tenant, file_id, 0, until=until)
            if refusal is not None:
                if kind == "error_file":
                    self.files.release(outputs["output_file"])
                why = refusal.error
                raise ApiError(why.status, f"{why} (a batch keeps room for its output and error files)",
                               "input_file_id", why.code, why.retry_after)
        return outputs

    def _input_lines(self, tenant: Tenant, file_id: str) -> list[str]:
        try:
            file = self.files.get(file_id, tenant)
            content = self.files.content(file_id, tenant)
        except ApiError as e:
            e.param = "input_file_id"
            raise
        if file["purpose"] != "batch":
            raise ApiError(400, f"input_file_id: file {file_id!r} has purpose {file['purpose']!r}, not 'batch'",
                           "input_file_id", "invalid_request_error")
        # Bytes that are not UTF-8 survive as lone surrogates, so the schema refuses just their line.
        lines = split_lines(content)
        if not lines:
            raise ApiError(400, f"input_file_id: file {file_id!r} holds no requests", "input_file_id",
                           "invalid_request_error")
        if len(lines) > self.config.max_batch_lines:
            raise ApiError(400, f"input_file_id: file {file_id!r} holds {len(lines)} requests, at most "
                                f"{self.config.max_batch_lines} are allowed", "input_file_id",
                           "invalid_request_error")
        limit = self.config.max_request_bytes  # a line is a request: held to what a request body may be
        for number, line in enumerate(lines, 1):
            if len(line) > limit // 4 and (size := len(line.encode("utf-8", "surrogateescape"))) > limit:
                raise ApiError(400, f"input_file_id: line {number} of file {file_id!r} is {size:,} bytes, over the "
                                    f"{limit:,}-byte limit of a request", "input_file_id", "invalid_request_error")
        return lines

    # --- following ------------------------------------------------------------------------------------
    def _meta(self, batch_id: str, tenant: Tenant) -> dict[str, str]:
        meta = self.r.hgetall(self.keys.batch(batch_id))
        if not meta or meta.get("tenant") != tenant.name:
            raise ApiError.not_found("batch", batch_id)
        return meta

    def get(self, batch_id: str, tenant: Tenant) -> dict:
        return self._object(batch_id, self._meta(batch_id, tenant))

    def _object(self, batch_id: str, meta: dict[str, str]) -> dict:
        if "status" not in meta:  # not finalized yet: ask the queue
            meta = self._current(batch_id, meta)
        return _batch_object(batch_id, meta)

    def _current(self, batch_id: str, meta: dict[str, str]) -> dict[str, str]:
        """The meta of a batch not finalized yet: running, or finalized now (here, unless another process is
        at it), or ``finalizing``."""
        try:
            st = self.client.batch_status(batch_id)
        except JobNotFoundError:  # the queue's hash is gone: finalize with what is left
            st = None
        if st is not None and not st.done:
            return {**meta, "status": "cancelling" if "cancelling_at" in meta else "in_progress",
                    **st.request_counts}
        final = self.finalizer.finalize(batch_id)
        if final is not None and "status" in final:
            return final
        counts = st.request_counts if st is not None else {"total": meta.get("total", 0), "completed": 0,
                                                             "failed": 0}
        return {**meta, "status": "finalizing", "finalizing_at": int(st.completed_at or time.time()) if st
                else int(time.time()), **counts}

    # --- cancelling and listing -----------------------------------------------------------------------
    def cancel(self, batch_id: str, tenant: Tenant) -> dict:
        """Cancel every job of the batch still waiting or running; the batch ends ``cancelled``.

        Answered at once (``cancelling``): the first cancel of a batch hands the walk over its jobs (50,000 of
        them: seconds) to this process's one cancelling thread, and later ones (a storm of them) walk nothing."""
        meta = self._meta(batch_id, tenant)
        try:
            running = "status" not in meta and not self.client.batch_status(batch_id).done
        except JobNotFoundError:
            running = False
        if running and self.r.hsetnx(self.keys.batch(batch_id), "cancelling_at", int(time.time())):
            self._cancels.submit(self._cancel_jobs, batch_id)
        return self.get(batch_id, tenant)

    def _cancel_jobs(self, batch_id: str) -> None:
        try:
            self.client.cancel_batch(batch_id, FINALIZE_CHUNK)
        except JobNotFoundError:
            pass
        except Exception:  # noqa: BLE001 - a thread of its own: say why, the batch's jobs end anyway
            log.exception("cancelling the jobs of batch %s failed", batch_id)

    def list(self, tenant: Tenant, after: str | None, limit: int) -> dict:
        index = self.keys.batches_of(tenant.name)
        items = []
        for batch_id in page_ids(self.r, index, after, limit):
            meta = self.r.hgetall(self.keys.batch(batch_id))
            if meta:
                items.append(self._object(batch_id, meta))
            else:
                self.r.zrem(index, batch_id)  # expired
        return list_page(items[:limit], len(items) > limit)


class BatchFinalizer:
    """Writes the output files of batches whose jobs have all ended, and then lets their records expire.

    Safe to run in any number of processes: a batch is finalized under its lock, and stays queued in
    ``names.batches_to_finalize`` until a finalizer has finished with it.
    """

    def __init__(self, r: redis.Redis, names: Names, keys: GatewayKeys, files: FileStore, result_ttl_s: int,
                 file_ttl_s: int) -> None:
        self.r, self.names, self.keys, self.files = r, names, keys, files
        self.result_ttl_s = result_ttl_s
        self.file_ttl_s = file_ttl_s  # for batches created before their hash recorded theirs

    @classmethod
    def from_settings(cls, settings: Settings, r: redis.Redis) -> BatchFinalizer:
        """A finalizer outside the gateway (a CPU worker): ``r`` with decoded replies; it reads no content."""
        keys = GatewayKeys(settings.key_prefix)
        files = FileStore(r, r, keys, GatewayConfig().file_ttl_s, settings.file_store_share)
        return cls(r, Names.from_settings(settings), keys, files, settings.result_ttl_s, files.ttl_s)

    def run_once(self) -> int:
        """Finalize the batches queued now; returns how many were finalized."""
        finalized = 0
        for batch_id, ended_at in self.r.zrange(self.names.batches_to_finalize, 0, 99, withscores=True):
            # A batch can end before the gateway wrote its hash (every line failed at once): wait for it.
            if (batch_id and time.time() - ended_at < ORPHAN_GRACE_S
                    and not self.r.exists(self.keys.batch(batch_id))):
                continue
            if self.finalize(batch_id) is not None:
                finalized += 1
        return finalized

    def run_forever(self, interval_s: float = FINALIZE_INTERVAL_S, stop: threading.Event | None = None) -> None:
        stop = stop or threading.Event()
        while not stop.wait(interval_s):
            try:
                self.run_once()
            except Exception as e:  # noqa: BLE001 - the broker may be away; the next interval tries again
                log.warning("batch finalizer failed: %s: %s", type(e).__name__, e)

    def finalize(self, batch_id: str) -> dict[str, str] | None:
        """Write the batch's output files (if the gateway made it and nobody has yet), give its jobs' keys
        their TTL and take it off the queue.  Returns the gateway batch's meta ({} for a batch of the
        Python client's), or None while another process is finalizing it."""
        lock = OwnedLock(self.r, self.keys.finalize_lock(batch_id))
        if not lock.take(FINALIZE_LOCK_S * 1000):
            return None
        try:
            meta = self.r.hgetall(self.keys.batch(batch_id))
            if meta and "status" not in meta:
                final = self._write(batch_id, meta, lambda: lock.hold(FINALIZE_LOCK_S * 1000))
                pipe = self.r.pipeline(transaction=True)
                pipe.hset(self.keys.batch(batch_id), mapping=final)
                pipe.expire(self.keys.batch(batch_id), int(meta.get("file_ttl_s", self.file_ttl_s)))  # as its files
                pipe.execute()
                meta = {**meta, **{k: str(v) for k, v in final.items()}}
            self._expire_records(batch_id)
            self.r.zrem(self.names.batches_to_finalize, batch_id)
            return meta
        finally:
            lock.release()

    def _write(self, batch_id: str, meta: dict[str, str], renew: Callable[[], object]) -> dict:
        queue = self.r.hgetall(self.names.batch(batch_id))
        tenant = Tenant(meta["tenant"], max_stored_bytes=int(meta.get("quota_bytes", DEFAULT_MAX_STORED_BYTES)),
                        max_files=int(meta.get("quota_files", DEFAULT_MAX_FILES)))
        ttl_s = int(meta.get("file_ttl_s", self.file_ttl_s))
        suffix = batch_id.removeprefix("batch_")
        # Error lines first in each chunk: they are few and small, and say what went wrong.
        outputs = {kind: OutputFile(self.files, tenant, meta.get(f"{kind}_file", f"file-{kind}-{suffix}"),
                                    f"{batch_id}_{kind}.jsonl", ttl_s) for kind in ("error", "output")}
        jobs_key = self.names.batch_jobs(batch_id)
        total = self.r.llen(jobs_key)
        completed = 0
        for start in range(0, total, FINALIZE_CHUNK):
            chosen: dict[str, list[tuple[int, bytes]]] = {"output": [], "error": []}
            for number, line in enumerate(self._lines(self.r.lrange(jobs_key, start, start + FINALIZE_CHUNK - 1)),
                                          start + 1):
                good = (line.get("response") or {}).get("status_code") == 200
                completed += good
                chosen["output" if good else "error"].append((number, (json.dumps(line) + "\n").encode()))
            for kind, out in outputs.items():
                out.add(chosen[kind])
            renew()
        status = "cancelled" if "cancelling_at" in meta else "expired" if int(queue.get("expired", 0)) else "completed"
        final: dict = {"status": status, "ended_at": int(float(queue.get("completed_at") or time.time())),
                       "total": total, "completed": completed, "failed": total - completed}
        errors = []
        if not queue and not total:  # the queue's records were gone before any finalizer came
            final.update(status="expired", total=int(meta.get("total", 0)), failed=0)
            errors.append({"code": "expired", "message": "the batch's records expired before its output was "
                                                         "written", "param": None, "line": None})
        for kind, out in outputs.items():
            if (file_id := out.commit()) is not None:
                final[f"{kind}_file_id"] = file_id
            if out.refused is not None:
                number, why = out.refused
                errors.append({"code": why.code, "message": f"{kind} file: holds the lines before line {number}. "
                                                            f"{why}", "param": None, "line": number})
        if errors:
            final["errors"] = json.dumps({"object": "list", "data": errors})
        return final

    def _lines(self, job_ids: list[str]) -> list[dict]:
        """The batch output lines of these jobs; a job whose record is gone gets an error line."""
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.names.job(job_id))
            pipe.get(self.names.result(job_id))
        replies = pipe.execute()
        return [output_line(JobStatus.from_record(job_id, rec), raw) if rec else
                batch_output_line(None, error=RequestError("the job's record expired before the batch's output "
                                                           "was written", code="expired"))
                for job_id, rec, raw in zip(job_ids, replies[::2], replies[1::2], strict=True)]

    def _expire_records(self, batch_id: str) -> None:
        """The batch's hash, job list, job records and results expire ``result_ttl_s`` from now."""
        jobs_key, ttl = self.names.batch_jobs(batch_id), self.result_ttl_s
        for start in range(0, self.r.llen(jobs_key), FINALIZE_CHUNK):
            pipe = self.r.pipeline(transaction=False)
            for job_id in self.r.lrange(jobs_key, start, start + FINALIZE_CHUNK - 1):
                pipe.expire(self.names.job(job_id), ttl)
                pipe.expire(self.names.result(job_id), ttl)
            pipe.execute()
        pipe = self.r.pipeline(transaction=False)
        pipe.expire(self.names.batch(batch_id), ttl)
        pipe.expire(jobs_key, ttl)
        pipe.execute()


def _batch_object(batch_id: str, meta: dict[str, str]) -> dict:
    created = int(meta["created_at"])
    status = meta["status"]
    ended = int(meta["ended_at"]) if "ended_at" in meta else None
    when = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}
    times = {when[status]: ended} if status in when else {}
    cancelling = int(meta["cancelling_at"]) if "cancelling_at" in meta else None
    finalizing = int(meta["finalizing_at"]) if "finalizing_at" in meta else None
    return BatchObject(
        id=batch_id, endpoint=meta["endpoint"], input_file_id=meta["input_file_id"],
        completion_window=meta["completion_window"], status=status, created_at=created, in_progress_at=created,
        expires_at=created + COMPLETION_WINDOW_S, cancelling_at=cancelling, finalizing_at=finalizing, **times,
        errors=json.loads(meta["errors"]) if "errors" in meta else None,
        output_file_id=meta.get("output_file_id"), error_file_id=meta.get("error_file_id"),
        request_counts=RequestCounts(total=int(meta["total"]), completed=int(meta["completed"]),
                                     failed=int(meta["failed"])),
        metadata=json.loads(meta.get("metadata") or "null"),
    ).model_dump()
