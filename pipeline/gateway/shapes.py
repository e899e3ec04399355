"""OpenAI's JSON shapes: models (documented in the OpenAPI schema) and the builders the routes use.

Builders return plain dicts made through these models, so what the gateway
sends is what its schema says.  Completion objects themselves are built by the
CPU worker (``pipeline/postprocess.py``) and passed through unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import BaseModel

from pagedq.pipeline.client import JobStatus


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedq"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


class JobObject(BaseModel):
    """A job of the queue, as ``Client.status`` sees it, with its result once completed."""

    id: str
    object: Literal["job"] = "job"
    state: str
    priority: int
    tenant: str = "default"  # whose job it is: the API key's tenant
    kind: str | None = None
    model: str | None = None
    created_at: float | None = None
    started_at: float | None = None
    completed_at: float | None = None
    failed_at: float | None = None
    cancelled_at: float | None = None
    expired_at: float | None = None
    attempts: int = 0
    error: dict | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None  # tokens so far while in progress
    batch_id: str | None = None
    custom_id: str | None = None
    cached: bool = False
    result: dict | None = None


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    status_details: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


BatchState = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                     "cancelled"]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: dict | None = None
    input_file_id: str
    completion_window: str
    status: BatchState
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    metadata: dict[str, str] | None = None


class ListPage(BaseModel):
    """A cursor page (``after`` = the last id of the previous page), newest first."""

    object: Literal["list"] = "list"
    data: list[Any]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileList(ListPage):
    data: list[FileObject]


class BatchList(ListPage):
    data: list[BatchObject]


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    redis: str
    workers: dict[str, int] | None = None  # ready GPU workers per model (/ready)


def job_object(status: JobStatus, result: dict | None = None) -> dict:
    fields = {k: v for k, v in asdict(status).items() if k in JobObject.model_fields}
    fields["custom_id"] = fields.get("custom_id") or None
    fields["cached"] = bool(status.cached)
    return JobObject(**fields, result=result).model_dump()


def list_page(items: list[dict], has_more: bool) -> dict:
    return ListPage(data=items, first_id=items[0]["id"] if items else None,
                    last_id=items[-1]["id"] if items else None, has_more=has_more).model_dump()


# --- streaming -------------------------------------------------------------------------------------------
def sse(data: dict | str) -> bytes:
    """One Server-Sent Event carrying ``data`` (a dict is sent as JSON)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


SSE_DONE = sse("[DONE]")


@dataclass
class ChunkShape:
    """The chunks of one streamed chat or text completion, in OpenAI's format."""

    kind: str  # "chat" | "text"
    id: str
    model: str
    created: int
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's continuous_usage_stats: every chunk carries ``running_usage``
    running_usage: dict | None = None  # the usage so far, set by the route before each chunk

    def _chunk(self, choices: list[dict]) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            out["usage"] = self.running_usage if self.continuous_usage else None
        return out

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict:
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.kind == "chat":
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        return choice

    def opening(self) -> dict | None:
        """The chat stream's first chunk (the assistant's role); text streams have none."""
        return self._chunk([self._choice("", None, role=True)]) if self.kind == "chat" else None

    def delta(self, text: str) -> dict:
        return self._chunk([self._choice(text, None)])

    def tool_calls(self, content: str | None, calls: list[dict]) -> dict:
        """A chat chunk carrying whole tool calls (and the text before them, if any)."""
        delta: dict = {"content": content} if content else {}
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return self._chunk([{"index": 0, "logprobs": None, "finish_reason": None, "delta": delta}])

    def finish(self, finish_reason: str | None, stop_reason: Any = None) -> dict:
        chunk = self._chunk([self._choice(None if self.kind == "chat" else "", finish_reason)])
        chunk["choices"][0]["stop_reason"] = stop_reason
        return chunk

    def usage(self, usage: dict) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = usage
        return chunk
