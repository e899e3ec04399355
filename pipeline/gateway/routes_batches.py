"""OpenAI's Files and Batches APIs: ``/v1/files`` and ``/v1/batches`` (see ``files.py``, ``batches.py``)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from pagedq.pipeline.gateway.batches import BatchCreate
from pagedq.pipeline.gateway.bodies import read_body, read_json, validate_model
from pagedq.pipeline.gateway.errors import ApiError
from pagedq.pipeline.gateway.files import READ_CHUNK
from pagedq.pipeline.gateway.forms import FormError, parse_form
from pagedq.pipeline.gateway.keys import Tenant
from pagedq.pipeline.gateway.openapi import errors, form_body, json_body
from pagedq.pipeline.gateway.shapes import BatchList, BatchObject, FileDeleted, FileList, FileObject
from pagedq.pipeline.gateway.state import Gateway, TenantDep, gateway

router = APIRouter()

FORM_OVERHEAD = 64 << 10  # room for the multipart framing and the purpose field around the file itself

_READ = errors(401, 404, 429, 503)
_LIST = errors(400, 401, 429, 503)


# --- files -----------------------------------------------------------------------------------------------
@router.post("/v1/files", openapi_extra=form_body("FileUpload"),
             responses={200: {"model": FileObject, "description": "the stored file"}, **errors()})
async def upload_file(request: Request, tenant: TenantDep) -> JSONResponse:
    gw = gateway(request)
    release = gw.enter_upload(tenant)  # a bounded number at once: each upload is held whole while read
    try:
        return await _upload(gw, request, tenant)
    finally:
        release()


async def _upload(gw: Gateway, request: Request, tenant: Tenant) -> JSONResponse:
    limit = gw.config.max_file_bytes
    body = await read_body(request, limit + FORM_OVERHEAD)
    try:  # off the event loop: splitting 64 MiB is copies of 64 MiB
        form = await run_in_threadpool(parse_form, body, request.headers.get("content-type", ""))
    except FormError as e:
        raise ApiError(400, f"body: {e}", None, "invalid_request_error") from None
    if "file" not in form or form["file"].filename is None:
        raise ApiError(400, "file: required (a multipart part with a filename)", "file", "invalid_request_error")
    purpose = form["purpose"].content.decode("utf-8", "replace") if "purpose" in form else None
    if purpose != "batch":
        raise ApiError(400, f"purpose: must be 'batch', not {purpose!r}", "purpose", "invalid_request_error")
    content = form["file"].content
    if len(content) > limit:
        raise ApiError(413, f"file: {len(content)} bytes, larger than this gateway's max_file_bytes of {limit} "
                            "(pagedq serve --max-file-bytes)", "file", "request_too_large")
    filename = form["file"].filename.encode("utf-8", "replace").decode()[:255] or "upload.jsonl"
    return JSONResponse(await run_in_threadpool(gw.files.create, tenant, filename, purpose, content))


@router.get("/v1/files", response_model=FileList, responses=_LIST)
def list_files(request: Request, tenant: TenantDep,
               after: Annotated[str | None, Query(max_length=200)] = None,
               limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
               order: Literal["asc", "desc"] = "desc",
               purpose: Annotated[str | None, Query(max_length=64)] = None) -> dict:
    return gateway(request).files.list(tenant, after, limit, purpose, newest_first=order == "desc")


@router.get("/v1/files/{file_id}", response_model=FileObject, responses=_READ)
def get_file(file_id: str, request: Request, tenant: TenantDep) -> dict:
    return gateway(request).files.get(file_id, tenant)


@router.get("/v1/files/{file_id}/content", responses={
    200: {"description": "the file's bytes", "content": {"application/octet-stream": {"schema": {
        "type": "string", "format": "binary"}}}}, **_READ})
def get_file_content(file_id: str, request: Request, tenant: TenantDep) -> Response:
    size, chunks = gateway(request).files.content_chunks(file_id, tenant)
    if size <= READ_CHUNK:
        return Response(b"".join(chunks), media_type="application/octet-stream")
    return StreamingResponse(chunks, media_type="application/octet-stream", headers={"Content-Length": str(size)})


@router.delete("/v1/files/{file_id}", response_model=FileDeleted, responses=_READ)
def delete_file(file_id: str, request: Request, tenant: TenantDep) -> dict:
    return gateway(request).files.delete(file_id, tenant)


# --- batches ---------------------------------------------------------------------------------------------
@router.post("/v1/batches", openapi_extra=json_body("BatchCreate"),
             responses={200: {"model": BatchObject, "description": "the batch, in progress"}, **errors()})
async def create_batch(request: Request, tenant: TenantDep) -> JSONResponse:
    gw = gateway(request)
    req = validate_model(BatchCreate, await read_json(request, gw.config.max_request_bytes))
    return JSONResponse(await run_in_threadpool(gw.batches.create, tenant, req))


@router.get("/v1/batches", response_model=BatchList, responses=_LIST)
def list_batches(request: Request, tenant: TenantDep,
                 after: Annotated[str | None, Query(max_length=200)] = None,
                 limit: Annotated[int, Query(ge=1, le=100)] = 20) -> dict:
    return gateway(request).batches.list(tenant, after, limit)


@router.get("/v1/batches/{batch_id}", response_model=BatchObject, responses=_READ)
def get_batch(batch_id: str, request: Request, tenant: TenantDep) -> dict:
    return gateway(request).batches.get(batch_id, tenant)


@router.post("/v1/batches/{batch_id}/cancel", response_model=BatchObject, responses=_READ)
def cancel_batch(batch_id: str, request: Request, tenant: TenantDep) -> dict:
    return gateway(request).batches.cancel(batch_id, tenant)
