"""From an HTTP body to ``Client.submit``'s arguments, for chat, text and job requests.

The body is checked by the one request schema (``Client.validate``); the
gateway itself only reads ``timeout_s`` and ``stream_options``, maps OpenAI's
newer ``max_completion_tokens`` onto ``max_tokens``, and applies the tenant's
priority limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedq.pipeline.gateway.keys import Tenant
from pagedq.pipeline.protocol import CHAT_URL, AnyRequest, RequestError

STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")  # the second is vLLM's, honoured with the first


@dataclass
class Submission:
    url: str  # CHAT_URL or COMPLETIONS_URL
    body: dict  # the fields of the one schema
    timeout_s: float | None = None
    include_usage: bool = False  # stream_options.include_usage
    has_stream_options: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats (vLLM's): usage on every chunk

    @property
    def kind(self) -> str:
        return "chat" if self.url == CHAT_URL else "text"

    def submit_kwargs(self) -> dict:
        """The arguments of ``Client.submit`` for this request."""
        body = dict(self.body)
        if self.url == CHAT_URL:
            return {"messages": body.pop("messages", None), "timeout_s": self.timeout_s, **body}
        return {"prompt": body.pop("prompt", None), "timeout_s": self.timeout_s, **body}


def split_body(url: str, body: dict, tenant: Tenant, default_priority: int) -> Submission:
    """The schema's fields and the gateway's own; a missing priority becomes the default, capped for the tenant."""
    body = dict(body)
    timeout_s = body.pop("timeout_s", None)
    options = body.pop("stream_options", None)
    if timeout_s is not None and (type(timeout_s) not in (int, float) or not math.isfinite(timeout_s)
                                  or timeout_s < 0):
        raise RequestError("timeout_s: must be a finite number of seconds >= 0", "timeout_s")
    if url == CHAT_URL and "max_completion_tokens" in body:
        value = body.pop("max_completion_tokens")
        if body.get("max_tokens") is None:
            body["max_tokens"] = value
    if options is not None and (not isinstance(options, dict) or set(options) - set(STREAM_OPTIONS)
                                or any(type(options.get(k, False)) is not bool for k in STREAM_OPTIONS)):
        raise RequestError("stream_options: must be an object with at most include_usage and "
                           "continuous_usage_stats (booleans)", "stream_options")
    if body.get("priority") is None:
        body["priority"] = min(default_priority, tenant.max_priority)
    usage = bool((options or {}).get("include_usage"))
    return Submission(url, body, timeout_s, usage, options is not None,
                      usage and bool(options.get("continuous_usage_stats")))


def check_allowed(sub: Submission, req: AnyRequest, tenant: Tenant) -> None:
    """What the schema cannot know: the tenant's highest priority, stream_options without stream."""
    if req.priority > tenant.max_priority:
        raise RequestError(f"priority: at most {tenant.max_priority} for this API key", "priority")
    if sub.has_stream_options and not req.stream:
        raise RequestError("stream_options: only allowed when stream is true", "stream_options")
