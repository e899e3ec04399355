"""Files (OpenAI's Files API), kept in Redis: a hash of metadata and a string of content per file.

Every file records its tenant; to any other tenant it does not exist (404).
Files expire after ``file_ttl_s``.

Storage is bounded before a byte is written.  A ledger (``storage_ledger``)
holds each file's size and tenant, with sums per tenant and in all
(``storage_usage``); one script settles lapsed entries, checks the limits and
records the new bytes, all at once, so two gateways cannot both take the last
room.  The limits: the tenant's ``max_stored_bytes`` and ``max_files`` (keys
file), and the whole store's share of Redis's ``maxmemory``
(``PAGEDQ_FILE_STORE_SHARE``), which leaves the rest to the queue: a full file
store refuses files, never jobs.  A write that fails gives its room back; one
whose writer died gives it back when its reservation lapses.

Batch output files are written chunk by chunk (``OutputFile``), each chunk's
bytes claimed first, and are at most ``MAX_OUTPUT_FILE_BYTES``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import redis

from pagedq.pipeline.gateway.config import GatewayKeys
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.keys import Tenant
from pagedq.pipeline.gateway.ledger import DROP
from pagedq.pipeline.gateway.shapes import FileDeleted, FileObject, list_page

log = logging.getLogger(__name__)

PURPOSES = ("batch", "batch_output")  # uploads take "batch"; the gateway writes "batch_output"
RESERVATION_S = 600  # a claim not yet followed by its file lapses after this long (its writer died)
MAX_OUTPUT_FILE_BYTES = 512 << 20  # Redis's largest string (OpenAI's largest file is 512 MB too)
STORE_CAP_CACHE_S = 30.0  # how long Redis's maxmemory is believed without asking again
READ_CHUNK = 4 << 20  # file content is read back this much at a time
WRITE_CHUNK = 4 << 20  # an upload is written into Redis this much at a time

# Shared by the scripts below.  KEYS[1..3]: ledger, expiry, usage.  drop(id) forgets a ledger entry.
_LEDGER = DROP + """
local function drop(id) drop_entry(KEYS[1], KEYS[2], KEYS[3], id, true) end
"""

# ARGV: now, file id, tenant, bytes, entry's end (unix s), tenant's max bytes, tenant's max files,
#       store cap in bytes (0: none), mode ('new': (re)place the file's entry, taking one of the tenant's
#       places; 'grow': add bytes to it, or place it anew if it lapsed).
# Returns 'ok' with the bytes recorded, or {limit, used} when a limit would be passed: then nothing changed
# but the settling of lapsed entries.
_CLAIM = _LEDGER + """
local now = tonumber(ARGV[1])
settle(KEYS[1], KEYS[2], KEYS[3], now, true)
local id, tenant, add = ARGV[2], ARGV[3], tonumber(ARGV[4])
local old = redis.call('HGET', KEYS[1], id)
if old and ARGV[9] ~= 'grow' then drop(id); old = nil end
local have = old and tonumber(string.match(old, '^(%d+)')) or 0
local used = tonumber(redis.call('HGET', KEYS[3], 'bytes:' .. tenant) or '0')
local files = tonumber(redis.call('HGET', KEYS[3], 'files:' .. tenant) or '0')
local total = tonumber(redis.call('HGET', KEYS[3], 'bytes') or '0')
if add > 0 and used + add > tonumber(ARGV[6]) then return {'max_stored_bytes', used} end
if not old and files + 1 > tonumber(ARGV[7]) then return {'max_files', files} end
local cap = tonumber(ARGV[8])
if add > 0 and cap > 0 and total + add > cap then return {'file_store_share', total} end
redis.call('HSET', KEYS[1], id, (have + add) .. ' ' .. tenant)
redis.call('ZADD', KEYS[2], tonumber(ARGV[5]), id)
redis.call('HINCRBY', KEYS[3], 'bytes:' .. tenant, add)
redis.call('HINCRBY', KEYS[3], 'bytes', add)
if not old then redis.call('HINCRBY', KEYS[3], 'files:' .. tenant, 1) end
return 'ok'
"""

# ARGV: file id.  Gives a file's room back.
_RELEASE = _LEDGER + """
drop(ARGV[1])
return 1
"""


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class Refusal:
    """A limit a file (or a chunk of one) would pass: its name, and the error to answer."""

    limit: str
    error: ApiError


class FileStore:
    def __init__(self, r: redis.Redis, raw: redis.Redis, keys: GatewayKeys, ttl_s: int,
                 store_share: float = 0.5) -> None:
        self.r = r  # decoded replies: metadata
        self.raw = raw  # bytes replies: content
        self.keys = keys
        self.ttl_s = ttl_s
        self.store_share = store_share  # of Redis's maxmemory, for all files together
        self._claim = r.register_script(_CLAIM)
        self._release = r.register_script(_RELEASE)
        self._cap: tuple[float, int] = (float("-inf"), 0)
        self._warned = False

    # --- room -----------------------------------------------------------------------------------------
    def store_cap(self) -> int:
        """Bytes all files together may take: ``store_share`` of Redis's maxmemory (0: Redis is unbounded)."""
        checked_at, cap = self._cap
        if time.monotonic() - checked_at > STORE_CAP_CACHE_S:
            try:
                maxmemory = int(self.r.info("memory").get("maxmemory", 0))
            except redis.ResponseError as e:  # INFO refused (an ACL without @dangerous): the tenants' quotas hold
                if not self._warned:
                    log.warning("cannot read Redis's maxmemory (%s); the file store has no overall bound", e)
                    self._warned = True
                maxmemory = 0
            cap = int(maxmemory * self.store_share)
            self._cap = (time.monotonic(), cap)
        return cap

    def claim(self, tenant: Tenant, file_id: str, nbytes: int, grow: bool = False,
              until: float | None = None) -> Refusal | None:
        """Record ``nbytes`` more for the file (a new file: one more of the tenant's places) if every limit
        allows; else change nothing and say which limit refused.  The entry lapses at ``until`` (default: a
        reservation's end) unless ``commit`` gives it the file's expiry."""
        now = time.time()
        cap = self.store_cap()
        verdict = self._claim(
            keys=self._ledger_keys(),
            args=[now, file_id, tenant.name, nbytes, until or now + RESERVATION_S, tenant.max_stored_bytes,
                  tenant.max_files, cap, "grow" if grow else "new"])
        if verdict == "ok":
            return None
        limit, used = verdict[0], int(verdict[1])
        return Refusal(limit, _quota_error(tenant, limit, used, nbytes, cap, self.store_share))

    def release(self, file_id: str, client: redis.Redis | None = None) -> None:
        self._release(keys=self._ledger_keys(), args=[file_id], client=client)

    def usage(self, tenant: Tenant) -> tuple[int, int]:
        """(bytes, files) the tenant stores now, by the ledger (entries lapse when a file is next claimed)."""
        used, files = self.r.hmget(self.keys.storage_usage, f"bytes:{tenant.name}", f"files:{tenant.name}")
        return int(used or 0), int(files or 0)

    def _ledger_keys(self) -> list[str]:
        return [self.keys.storage_ledger, self.keys.storage_expiry, self.keys.storage_usage]

    # --- files ----------------------------------------------------------------------------------------
    def create(self, tenant: Tenant, filename: str, purpose: str, content: bytes, file_id: str | None = None) -> dict:
        """Store a file (all of it or nothing) within the tenant's quota; returns its file object.

        Raises ApiError 413 for a file larger than the tenant may ever store, 429 naming the limit when the
        tenant's (or the whole store's) room is taken; then nothing is stored.  A given ``file_id`` is
        overwritten."""
        file_id = file_id or new_file_id()
        refusal = self.claim(tenant, file_id, len(content))
        if refusal is not None:
            raise refusal.error
        try:
            if len(content) <= WRITE_CHUNK:
                return self.commit(tenant, file_id, filename, purpose, len(content), content=content)
            staging = self._write_in_chunks(file_id, content)
            return self.commit(tenant, file_id, filename, purpose, len(content), staging=staging)
        except BaseException:
            self.release(file_id)
            raise

    def _write_in_chunks(self, file_id: str, content: bytes) -> str:
        """``content`` appended to the file's staging key WRITE_CHUNK at a time: one 64 MiB SET would hold
        Redis (and every tenant's requests) for its whole copy."""
        staging = self.keys.file_staging(file_id)
        self.raw.delete(staging)
        view = memoryview(content)
        for start in range(0, len(content), WRITE_CHUNK):
            pipe = self.raw.pipeline(transaction=False)
            pipe.append(staging, view[start:start + WRITE_CHUNK].tobytes())
            pipe.expire(staging, RESERVATION_S)
            pipe.execute()
        return staging

    def commit(self, tenant: Tenant, file_id: str, filename: str, purpose: str, nbytes: int,
               content: bytes | None = None, staging: str | None = None, ttl_s: int | None = None) -> dict:
        """Make a claimed file visible, from ``content`` or a ``staging`` key, expiring after ``ttl_s``."""
        ttl_s = ttl_s or self.ttl_s
        now = int(time.time())
        meta = {"tenant": tenant.name, "filename": filename, "purpose": purpose, "bytes": nbytes,
                "created_at": now, "expires_at": now + ttl_s}
        pipe = self.raw.pipeline(transaction=True)
        if staging is not None:
            pipe.rename(staging, self.keys.file_content(file_id))
            pipe.expire(self.keys.file_content(file_id), ttl_s)
        else:
            pipe.set(self.keys.file_content(file_id), content or b"", ex=ttl_s)
        pipe.hset(self.keys.file(file_id), mapping=meta)
        pipe.expire(self.keys.file(file_id), ttl_s)
        pipe.zadd(self.keys.files_of(tenant.name), {file_id: time.time()})
        pipe.zadd(self.keys.storage_expiry, {file_id: now + ttl_s})  # the ledger entry lapses with the file
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

    def content_chunks(self, file_id: str, tenant: Tenant) -> tuple[int, Iterator[bytes]]:
        """(size, its bytes in chunks of ``READ_CHUNK``): a large file is never held whole in memory."""
        self._meta(file_id, tenant)
        key = self.keys.file_content(file_id)
        size = self.raw.strlen(key)
        if size == 0 and not self.raw.exists(key):
            raise ApiError.not_found("file", file_id)

        def chunks() -> Iterator[bytes]:
            for start in range(0, size, READ_CHUNK):
                yield self.raw.getrange(key, start, start + READ_CHUNK - 1)
        return size, chunks()

    def delete(self, file_id: str, tenant: Tenant) -> dict:
        self._meta(file_id, tenant)
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(self.keys.file(file_id), self.keys.file_content(file_id))
        pipe.zrem(self.keys.files_of(tenant.name), file_id)
        self.release(file_id, client=pipe)
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


class OutputFile:
    """A batch output file written in chunks, each chunk's bytes claimed before it is appended.

    Invariant: the ledger always holds at least the bytes appended so far.  Once a chunk is refused (the
    tenant's quota, the store's share, ``MAX_OUTPUT_FILE_BYTES``), no later line is written: the file holds
    a prefix of its lines and ``refused`` says why and from which line on.  A writer starts from nothing: the
    half file and the counted bytes of one that died before it are dropped, never counted twice.
    """

    def __init__(self, files: FileStore, tenant: Tenant, file_id: str, filename: str, ttl_s: int) -> None:
        self.files, self.tenant, self.file_id, self.filename, self.ttl_s = files, tenant, file_id, filename, ttl_s
        self.staging = files.keys.file_staging(file_id)
        self.bytes = 0
        self.lines = 0
        self.refused: tuple[int, ApiError] | None = None  # (first batch line not written, why)
        self._last_refusal = ApiError(413, "file: refused", "file", "request_too_large")
        files.r.delete(self.staging)  # a crashed writer's half file
        refusal = files.claim(tenant, file_id, 0)  # its place, held since the batch began, with no bytes yet
        if refusal is not None:
            self.refused = (1, refusal.error)

    def add(self, lines: list[tuple[int, bytes]]) -> None:
        """Append (batch line number, line ending in a newline) pairs, in order."""
        if self.refused or not lines:
            return
        if not self._append(b"".join(line for _, line in lines)):
            for number, line in lines:  # fill the room that is left, line by line
                if not self._append(line):
                    self.refused = (number, self._last_refusal)
                    return

    def _append(self, chunk: bytes) -> bool:
        if self.bytes + len(chunk) > MAX_OUTPUT_FILE_BYTES:
            self._last_refusal = ApiError(413, f"file: an output file holds at most {MAX_OUTPUT_FILE_BYTES} "
                                               "bytes", "file", "request_too_large")
            return False
        refusal = self.files.claim(self.tenant, self.file_id, len(chunk), grow=True)
        if refusal is not None:
            self._last_refusal = refusal.error
            return False
        pipe = self.files.raw.pipeline(transaction=True)
        pipe.append(self.staging, chunk)
        pipe.expire(self.staging, RESERVATION_S)
        pipe.execute()
        self.bytes += len(chunk)
        self.lines += chunk.count(b"\n")
        return True

    def commit(self) -> str | None:
        """The file's id once visible, or None (and its room given back) when it holds no line."""
        if self.bytes == 0:
            self.files.release(self.file_id)
            return None
        self.files.commit(self.tenant, self.file_id, self.filename, "batch_output", self.bytes,
                          staging=self.staging, ttl_s=self.ttl_s)
        return self.file_id


def _quota_error(tenant: Tenant, limit: str, used: int, nbytes: int, cap: int, share: float) -> ApiError:
    who = f"tenant {tenant.name!r}"
    if limit == "max_stored_bytes":
        if nbytes > tenant.max_stored_bytes:
            return ApiError(413, f"file: {nbytes} bytes, more than {who} may store at all: max_stored_bytes "
                                 f"is {tenant.max_stored_bytes}", "file", "request_too_large")
        return ApiError(429, f"Storage quota reached: {who} stores {used} bytes of files, at most "
                             f"{tenant.max_stored_bytes} (max_stored_bytes); this file needs {nbytes} more. "
                             "Delete files or wait for them to expire.", "file", "storage_quota_exceeded")
    if limit == "max_files":
        return ApiError(429, f"Storage quota reached: {who} stores {used} files, at most {tenant.max_files} "
                             "(max_files). Delete files or wait for them to expire.", "file",
                        "storage_quota_exceeded")
    if nbytes > cap:
        return ApiError(413, f"file: {nbytes} bytes, more than the file store holds at all: {cap} bytes "
                             f"(PAGEDQ_FILE_STORE_SHARE={share} of Redis's maxmemory)", "file", "request_too_large")
    return ApiError(429, f"The file store is full: files take {used} bytes of Redis, at most {cap} "
                         f"(PAGEDQ_FILE_STORE_SHARE={share} of its maxmemory); this file needs {nbytes} more. "
                         "Retry later.", "file", "file_store_full", 60)


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
