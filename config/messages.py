"""The JSON messages between stages, as dataclasses (checked when they arrive).

    client --PreprocessJob--> preprocess --GenerateJob--> generate --Completion--> postprocess

A message that does not fit its shape raises ``MalformedMessageError``; the
task logs it and drops the message without touching any job.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

T = TypeVar("T")


class MalformedMessageError(ValueError):
    pass


@dataclass
class PreprocessJob:
    job_id: str
    url: str  # /v1/chat/completions or /v1/completions
    body: dict


@dataclass
class GenerateJob:
    job_id: str
    model: str
    kind: str  # "chat" | "text"
    prompt_token_ids: list[int]
    params: dict  # SamplingParams fields
    priority: int
    stream: bool = False


@dataclass
class Completion:
    """Everything the result consumer needs; travels as JSON on the results queue."""

    request_id: str
    kind: str  # "chat" | "text"
    model: str
    output_token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: str | None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)  # per token: {"token": [id, lp], "top": [[id, lp], ...]}
    stop: list[str] = field(default_factory=list)
    want_logprobs: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))


_adapters: dict[type, TypeAdapter] = {}


def parse_message(cls: type[T], payload: Any) -> T:
    adapter = _adapters.setdefault(cls, TypeAdapter(cls))
    try:
        return adapter.validate_json(json.dumps(payload), strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "message"
        raise MalformedMessageError(f"{cls.__name__}: {where}: {err['msg']}") from None


def to_json(message: Any) -> dict:
    return asdict(message)
