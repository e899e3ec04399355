"""Files (OpenAI's Files API), kept in Redis: a hash of metadata and a string of content per file.

Every file records its tenant; to any other tenant it does not exist (404).
Files expire after ``file_ttl_s``.
"""

from __future__ import annotations

import time
import uuid

import redis

from pagedq.pipeline.gateway.config import GatewayKeys
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.keys import Tenant
from pagedq.pipeline.gateway.shapes import FileDeleted, FileObject, list_page

PURPOSES = ("batch", "batch_output")  # uploads take "batch"; the gateway writes "batch_output"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


class FileStore:
    def __init__(self, r: redis.Redis, raw: redis.Redis, keys: GatewayKeys, ttl_s: int) -> None:
        self.r = r  # decoded replies: metadata
        self.raw = raw  # bytes replies: content
        self.keys = keys
        self.ttl_s = ttl_s

    def create(self, tenant: Tenant, filename: str, purpose: str, content: bytes, file_id: str | None = None) -> dict:
        """Store a file (all of it or nothing); returns its file object.  A given ``file_id`` is overwritten."""
        file_id = file_id or new_file_id()
        now = int(time.time())
        meta = {"tenant": tenant.name, "filename": filename, "purpose": purpose, "bytes": len(content),
                "created_at": now, "expires_at": now + self.ttl_s}
        pipe = self.raw.pipeline(transaction=True)
        pipe.set(self.keys.file_content(file_id), content, ex=self.ttl_s)
        pipe.hset(self.keys.file(file_id), mapping=meta)
        pipe.expire(self.keys.file(file_id), self.ttl_s)
        pipe.zadd(self.keys.files_of(tenant.name), {file_id: time.time()})
        pipe.execute()
        return _file_object(file_id, meta)

    def _meta(self, file_id: str, tenant: Tenant) -> dict[str, str]:
        meta = self.r.hgetall(self.keys.file(file_id))
        if not meta or meta.get("tenant") != tenant.name:
            raise ApiError.not_found("file", file_id)
        return meta

    def get(self, file_id: str, tenant: Tenant) -> dict:
        return _file_object(file_id, self._meta(file_id, tenant))

    def content(self, file_id: str, tenant: Tenant) -> bytes:
        self._meta(file_id, tenant)
        content = self.raw.get(self.keys.file_content(file_id))
        if content is None:
            raise ApiError.not_found("file", file_id)
        return content

    def delete(self, file_id: str, tenant: Tenant) -> dict:
        self._meta(file_id, tenant)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.keys.file(file_id), self.keys.file_content(file_id))
        pipe.zrem(self.keys.files_of(tenant.name), file_id)
        pipe.execute()
        return FileDeleted(id=file_id, deleted=True).model_dump()

    def list(self, tenant: Tenant, after: str | None, limit: int, purpose: str | None = None,
             newest_first: bool = True) -> dict:
        index = self.keys.files_of(tenant.name)
        items: list[dict] = []
        for file_id in page_ids(self.r, index, after, None if purpose else limit, newest_first):
            meta = self.r.hgetall(self.keys.file(file_id))
            if not meta:
                self.r.zrem(index, file_id)  # expired
            elif purpose is None or meta.get("purpose") == purpose:
                items.append(_file_object(file_id, meta))
        return list_page(items[:limit], len(items) > limit)


def _file_object(file_id: str, meta: dict) -> dict:
    return FileObject(id=file_id, bytes=int(meta["bytes"]), created_at=int(meta["created_at"]),
                      expires_at=int(meta["expires_at"]), filename=meta["filename"],
                      purpose=meta["purpose"]).model_dump()


def page_ids(r: redis.Redis, index: str, after: str | None, limit: int | None,
             newest_first: bool = True) -> list[str]:
    """Ids of a sorted-set index (by creation time) after the id ``after``: ``limit`` + 1 of them (all if
    None), so the caller can tell whether there are more."""
    start = 0
    if after is not None:
        rank = r.zrevrank(index, after) if newest_first else r.zrank(index, after)
        if rank is None:
            raise ApiError(400, f"after: no object with id {after!r} to list after", "after",
                           "invalid_request_error")
        start = rank + 1
    stop = -1 if limit is None else start + limit
    return r.zrevrange(index, start, stop) if newest_first else r.zrange(index, start, stop)
