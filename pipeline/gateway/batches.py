"""OpenAI's Batches API on top of pagedq batches (``Client.submit_batch``).

An OpenAI batch is a pagedq batch (the same id) plus a hash of what OpenAI's
batch object needs and pagedq's does not: tenant, input file, endpoint,
metadata, and, once every job has ended, the ids of its output and error
files.  Those files are written the first time the batch is seen done (by
any gateway process; a second writer writes the same lines under the same
ids): the output file holds the lines with status 200, the error file the
others, each in input order.

Status: ``in_progress`` while jobs run (``cancelling`` after a cancel), then
``completed``, ``cancelled`` (partial output), or ``expired`` when jobs were
not started within the completion window.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedq.pipeline.client import Client, JobNotFoundError
from pagedq.pipeline.gateway.config import GatewayConfig, GatewayKeys
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.files import FileStore, page_ids
from pagedq.pipeline.gateway.keys import Tenant
from pagedq.pipeline.gateway.limits import TenantLimits
from pagedq.pipeline.gateway.shapes import BatchObject, RequestCounts, list_page
from pagedq.pipeline.protocol import Text, split_lines

COMPLETION_WINDOW_S = 24 * 3600


class BatchCreate(BaseModel):
    """The body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: Annotated[Text, Field(min_length=1, max_length=200)]
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
    output_expires_after: dict | None = None  # accepted; output files expire like every file (file_ttl_s)


def prepare_line(line: str, endpoint: str, max_priority: int, default_priority: int) -> str:
    """A batch input line as its tenant may run it.

    A line for another endpoint than the batch's is made to fail, naming ``url``; a ``priority`` above the
    tenant's highest is lowered to it (a line without one gets the default, capped).  Lines that are not
    JSON objects are left as they are: the request schema reports them.
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

    # --- creating -------------------------------------------------------------------------------------
    def create(self, tenant: Tenant, req: BatchCreate) -> dict:
        lines = self._input_lines(tenant, req.input_file_id)
        default = self.client.settings.default_priority
        lines = [prepare_line(line, req.endpoint, tenant.max_priority, default) for line in lines]
        reservation = self.limits.reserve(tenant, len(lines))
        try:
            batch_id = self.client.submit_batch(lines, timeout_s=COMPLETION_WINDOW_S)
        except BaseException:
            self.limits.release(tenant, reservation)
            raise
        job_ids = self.r.lrange(self.names.batch_jobs(batch_id), 0, -1)
        now = int(time.time())
        meta = {"tenant": tenant.name, "input_file_id": req.input_file_id, "endpoint": req.endpoint,
                "completion_window": req.completion_window, "metadata": json.dumps(req.metadata),
                "created_at": now}
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hset(self.names.job(job_id), "tenant", tenant.name)
        pipe.hset(self.keys.batch(batch_id), mapping=meta)
        pipe.expire(self.keys.batch(batch_id), self.config.file_ttl_s)
        pipe.zadd(self.keys.batches_of(tenant.name), {batch_id: time.time()})
        pipe.execute()
        self.limits.commit(tenant, reservation, job_ids)
        return self.get(batch_id, tenant)

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
        return lines

    # --- following ------------------------------------------------------------------------------------
    def _meta(self, batch_id: str, tenant: Tenant) -> dict[str, str]:
        meta = self.r.hgetall(self.keys.batch(batch_id))
        if not meta or meta.get("tenant") != tenant.name:
            raise ApiError.not_found("batch", batch_id)
        return meta

    def get(self, batch_id: str, tenant: Tenant) -> dict:
        return self._object(batch_id, self._meta(batch_id, tenant), tenant)

    def _object(self, batch_id: str, meta: dict[str, str], tenant: Tenant) -> dict:
        if "status" not in meta:  # not final yet: ask the queue
            try:
                st = self.client.batch_status(batch_id)
            except JobNotFoundError:  # the queue's record expired before anyone looked
                meta = {**meta, "status": "expired", "ended_at": meta["created_at"], "total": "0",
                        "completed": "0", "failed": "0"}
            else:
                if st.done:
                    meta = self._finalize(batch_id, meta, tenant, st.expired, st.completed_at)
                else:
                    meta = {**meta, "status": "cancelling" if "cancelling_at" in meta else "in_progress",
                            **st.request_counts}
        return _batch_object(batch_id, meta)

    def _finalize(self, batch_id: str, meta: dict[str, str], tenant: Tenant, expired: int,
                  completed_at: float | None) -> dict[str, str]:
        """Write the output and error files of a batch whose jobs have all ended; returns the final meta."""
        lines = self.client.batch_results(batch_id, timeout=10)
        good = [ln for ln in lines if (ln.get("response") or {}).get("status_code") == 200]
        bad = [ln for ln in lines if (ln.get("response") or {}).get("status_code") != 200]
        status = "cancelled" if "cancelling_at" in meta else "expired" if expired else "completed"
        final = {"status": status, "ended_at": int(completed_at or time.time()), "total": len(lines),
                 "completed": len(good), "failed": len(bad)}
        suffix = batch_id.removeprefix("batch_")
        for kind, chosen in (("output", good), ("error", bad)):
            if chosen:
                file_id = f"file-{kind}-{suffix}"
                content = "".join(json.dumps(ln) + "\n" for ln in chosen).encode()
                self.files.create(tenant, f"{batch_id}_{kind}.jsonl", "batch_output", content, file_id)
                final[f"{kind}_file_id"] = file_id
        self.r.hset(self.keys.batch(batch_id), mapping=final)
        return {**meta, **{k: str(v) for k, v in final.items()}}

    # --- cancelling and listing -----------------------------------------------------------------------
    def cancel(self, batch_id: str, tenant: Tenant) -> dict:
        """Cancel every job of the batch still waiting or running; the batch ends ``cancelled``."""
        meta = self._meta(batch_id, tenant)
        if "status" not in meta and not self.client.batch_status(batch_id).done:
            self.r.hsetnx(self.keys.batch(batch_id), "cancelling_at", int(time.time()))
            for job_id in self.r.lrange(self.names.batch_jobs(batch_id), 0, -1):
                try:
                    self.client.cancel(job_id)
                except JobNotFoundError:
                    pass
        return self.get(batch_id, tenant)

    def list(self, tenant: Tenant, after: str | None, limit: int) -> dict:
        index = self.keys.batches_of(tenant.name)
        items = []
        for batch_id in page_ids(self.r, index, after, limit):
            meta = self.r.hgetall(self.keys.batch(batch_id))
            if meta:
                items.append(self._object(batch_id, meta, tenant))
            else:
                self.r.zrem(index, batch_id)  # expired
        return list_page(items[:limit], len(items) > limit)


def _batch_object(batch_id: str, meta: dict[str, str]) -> dict:
    created = int(meta["created_at"])
    status = meta["status"]
    ended = int(meta["ended_at"]) if "ended_at" in meta else None
    when = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}
    times = {when[status]: ended} if status in when else {}
    cancelling = int(meta["cancelling_at"]) if "cancelling_at" in meta else None
    return BatchObject(
        id=batch_id, endpoint=meta["endpoint"], input_file_id=meta["input_file_id"],
        completion_window=meta["completion_window"], status=status, created_at=created, in_progress_at=created,
        expires_at=created + COMPLETION_WINDOW_S, cancelling_at=cancelling, **times,
        output_file_id=meta.get("output_file_id"), error_file_id=meta.get("error_file_id"),
        request_counts=RequestCounts(total=int(meta["total"]), completed=int(meta["completed"]),
                                     failed=int(meta["failed"])),
        metadata=json.loads(meta.get("metadata") or "null"),
    ).model_dump()
