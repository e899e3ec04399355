"""The JSON messages between stages, as dataclasses (checked when they arrive), and the one error type.

    client --PreprocessJob--> preprocess --GenerateJob--> generate --Completion--> postprocess

A message that does not fit its shape raises ``MalformedMessageError``; the
task logs it and drops the message without touching any job.

``RequestError`` is the one error that crosses the wire: a job that ends
failed carries ``RequestError.to_dict()`` (message, param, code) as its
``error``, whichever component refused it.  ``check_context`` is the one
context-length check.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, TypeVar

from pydantic import TypeAdapter, ValidationError

from pagedq.config.sampling_params import SamplingParams
from pagedq.config.scheduling import SchedulingMeta

T = TypeVar("T")


class MalformedMessageError(ValueError):
    pass


class RequestError(ValueError):
    """A request that cannot be served; ``param`` names the field at fault, ``code`` says what kind."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.custom_id: str | None = None  # set for errors about a batch line

    def to_dict(self) -> dict:
        return {"message": str(self), "param": self.param, "code": self.code}

    @classmethod
    def from_dict(cls, error: dict) -> RequestError:
        return cls(error.get("message") or "", error.get("param"), error.get("code") or "invalid_request_error")


def check_context(prompt_ids: list[int], max_tokens: int, max_model_len: int, vocab_size: int) -> None:
    """Raise RequestError unless the prompt's ids are in the vocabulary and prompt + max_tokens fit."""
    if not prompt_ids:
        raise RequestError("prompt: empty", "prompt")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise RequestError(f"prompt: token ids must be in [0, {vocab_size})", "prompt")
    if len(prompt_ids) >= max_model_len:
        raise RequestError(
            f"prompt: This model's maximum context length is {max_model_len} tokens; the prompt alone has "
            f"{len(prompt_ids)}", "prompt", code="context_length_exceeded")
    need = len(prompt_ids) + max_tokens
    if need > max_model_len:
        raise RequestError(
            f"max_tokens: This model's maximum context length is {max_model_len} tokens; the request needs "
            f"{need} ({len(prompt_ids)} in the prompt, {max_tokens} in max_tokens)", "max_tokens",
            code="context_length_exceeded")


def check_logit_bias(logit_bias: dict[int, float], vocab_size: int) -> None:
    """Raise RequestError unless every token id ``logit_bias`` names is in the vocabulary."""
    outside = [t for t in logit_bias if not 0 <= t < vocab_size]
    if outside:
        raise RequestError(f"logit_bias: token ids must be in [0, {vocab_size}); {outside[0]} is not",
                           "logit_bias")


def check_stop_token_ids(stop_token_ids: list[int], vocab_size: int) -> None:
    """Raise RequestError unless every id of ``stop_token_ids`` is in the vocabulary."""
    outside = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if outside:
        raise RequestError(f"stop_token_ids: token ids must be in [0, {vocab_size}); {outside[0]} is not",
                           "stop_token_ids")


class JobNotCompleted(Exception):
    """Raised by a task whose job ended failed, cancelled or expired, so Celery (and Flower) records a FAILURE
    with pagedq's reason.  Tasks declare it in ``throws``: logged as one line, not as a crash."""


def _as_meta(meta: SchedulingMeta | dict) -> SchedulingMeta:
    return SchedulingMeta.from_dict(meta) if isinstance(meta, dict) else meta


@dataclass
class PreprocessJob:
    job_id: str
    url: str  # /v1/chat/completions or /v1/completions
    body: dict
    # Who the job is charged to and how urgent it is; the default keeps messages from older producers parsing.
    meta: SchedulingMeta = field(default_factory=SchedulingMeta)

    def __post_init__(self) -> None:
        self.meta = _as_meta(self.meta)  # built from a stored message's JSON (``PreprocessJob(**json)``)

    def describe(self) -> str:
        """What Flower and task events show as the task's arguments: the job, never its text (prompts are
        private; events reach Flower and every subscriber of the broker's event channel)."""
        b = self.body
        messages = b.get("messages")
        if isinstance(messages, list):
            size = f"{len(messages)} messages"
        else:
            prompt = b.get("prompt", "")
            size = f"{len(prompt)} {'chars' if isinstance(prompt, str) else 'token ids'}"
        return (f"job={self.job_id} model={b.get('model')} tenant={self.meta.tenant} "
                f"priority={b.get('priority')} prompt=({size})")


@dataclass
class GenerateJob:
    job_id: str
    model: str
    kind: str  # "chat" | "text"
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    stream: bool = False
    meta: SchedulingMeta = field(default_factory=SchedulingMeta)  # ``meta.priority`` equals ``priority``
    tool_parsing: str = ""  # how the answer becomes tool calls (``pipeline/tools.py``); "": it does not

    def __post_init__(self) -> None:
        self.meta = _as_meta(self.meta)

    def describe(self) -> str:
        return (f"job={self.job_id} model={self.model} tenant={self.meta.tenant} priority={self.priority} "
                f"prompt_tokens={len(self.prompt_token_ids)} max_tokens={self.params.max_tokens}")


@dataclass
class ChoiceOutput:
    """Another answer of a request with ``n`` > 1 (choices 1, 2, ...; choice 0 is the Completion's own)."""

    text: str
    output_token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict] = field(default_factory=list)

    @classmethod
    def of(cls, out: Any) -> ChoiceOutput:
        """From an engine's finished output with its text (``workers.llm.Generation``)."""
        return cls(out.text, out.output_token_ids, out.finish_reason, out.stop_reason, out.logprobs)


@dataclass
class PromptScores:
    """The prompt's side of an answer that echoes it (``echo``) or scores it (vLLM's ``prompt_logprobs``)."""

    token_ids: list[int]
    echo: bool = False
    # Per prompt token, the first None (nothing precedes it): {"token": [id, lp, rank], "top": [[id, lp], ...]}.
    logprobs: list[dict | None] | None = None
    num_top: int | None = None  # the request's ``prompt_logprobs``: the answer carries vLLM's field

    @classmethod
    def of(cls, params: SamplingParams, prompt_token_ids: list[int],
           logprobs: list[dict | None] | None) -> PromptScores | None:
        """What the answer needs of its prompt (None: nothing, the usual case)."""
        if not params.echo and params.prompt_logprobs is None:
            return None
        return cls(list(prompt_token_ids), params.echo, logprobs, params.prompt_logprobs)


@dataclass
class Completion:
    """Everything the result consumer needs; travels as JSON on the results queue."""

    request_id: str
    kind: str  # "chat" | "text"
    model: str
    text: str  # detokenized once, by the GPU worker; cut at the stop string
    output_token_ids: list[int]
    num_prompt_tokens: int
    finish_reason: str | None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)  # per token: {"token": [id, lp], "top": [[id, lp], ...]}
    want_logprobs: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # The weights that produced every token (the worker's model fingerprint); "" when unknown (a Completion
    # from an older worker) or when the weights were reloaded while the job ran: such answers are not cached.
    fingerprint: str = ""
    tool_parsing: str = ""  # the GenerateJob's
    others: list[ChoiceOutput] = field(default_factory=list)  # choices 1.. of a request with n > 1
    prompt: PromptScores | None = None  # with ``echo`` or ``prompt_logprobs``
    # The epoch the GPU worker took the job at (``store.jobs.Admitted``): postprocess ends the job only while it
    # is still that take's.  0: unfenced (a Completion from an older worker).
    epoch: int = 0

    def describe(self) -> str:
        return (f"job={self.request_id} model={self.model} completion_tokens={len(self.output_token_ids)} "
                f"finish_reason={self.finish_reason} text=({len(self.text)} chars)")


_adapters: dict[type, TypeAdapter] = {}


def adapter_for(cls: type[T]) -> TypeAdapter:
    """The validator of a message class, built once per process (building one generates its whole schema:
    milliseconds, which every message paid when this was a ``setdefault(cls, TypeAdapter(cls))``)."""
    adapter = _adapters.get(cls)
    if adapter is None:
        adapter = _adapters[cls] = TypeAdapter(cls)
    return adapter


def parse_message(cls: type[T], payload: Any) -> T:
    adapter = adapter_for(cls)
    try:
        return adapter.validate_json(json.dumps(payload), strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "message"
        raise MalformedMessageError(f"{cls.__name__}: {where}: {err['msg']}") from None


_field_names: dict[type, tuple[str, ...]] = {}


def to_json(message: Any) -> Any:
    """The message as plain dicts, lists and scalars: ``dataclasses.asdict`` without its deep copies (a batch
    sends thousands of messages; asdict's copying was a quarter of a 5,000-line batch's enqueue)."""
    cls = type(message)
    if cls in (str, int, float, bool) or message is None:
        return message
    if is_dataclass(message):
        names = _field_names.get(cls)
        if names is None:
            names = _field_names[cls] = tuple(f.name for f in fields(message))
        return {name: to_json(getattr(message, name)) for name in names}
    if isinstance(message, (list, tuple)):
        return [to_json(x) for x in message]
    if isinstance(message, dict):
        return {k: to_json(v) for k, v in message.items()}
    return message
