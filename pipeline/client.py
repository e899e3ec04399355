"""The producer: submit requests, follow them, fetch results.

    from pagedq.pipeline import Client
    client = Client()                     # PAGEDQ_BROKER_URL, or the running `pagedq up`
    job = client.submit([{"role": "user", "content": "Hi"}], max_tokens=32, priority=9)
    client.status(job).state              # queued -> in_progress -> completed
    client.result(job, timeout=60)        # the chat.completion object
    for delta in client.stream(job): ...  # text as it is generated

Requests are validated (pydantic, the same models as the batch path) before
anything is written: a bad request raises ``RequestError`` naming the field,
and no queue or key is touched.  Jobs are sent by task name to the preprocess
queue, so producers never import worker code.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, fields
from typing import TypeVar

import redis
from kombu.exceptions import OperationalError

from pagedq.config import Settings, get_settings
from pagedq.config.architectures import refusal
from pagedq.config.celery_app import BufferedSentEvents, make_celery, send_preprocess
from pagedq.config.messages import (
    PreprocessJob,
    check_context,
    check_logit_bias,
    check_stop_token_ids,
    to_json,
)
from pagedq.config.names import TERMINAL_STATES, JobState, Names
from pagedq.config.scheduling import SchedulingMeta
from pagedq.config.served import canonical_name, default_model
from pagedq.pipeline.postprocess import batch_output_line
from pagedq.pipeline.protocol import (
    CHAT_URL,
    COMPLETIONS_URL,
    DEFAULT_MAX_TOKENS,
    AnyRequest,
    ChatCompletionRequest,
    RequestError,
    cache_body,
    parse_batch_line,
    parse_request,
    read_batch_file,
    request_body,
    to_sampling_params,
)
from pagedq.store.connection import BrokerUnavailable, redis_client
from pagedq.store.connection import broker_url as find_broker_url
from pagedq.store.control import ControlChannel, configured_secret
from pagedq.store.jobs import JobStore, now
from pagedq.store.registry import ModelInfo, ModelLookups, lookup_model, served_models
from pagedq.store.result_cache import ResultCache, is_deterministic, request_digest

log = logging.getLogger(__name__)
_TERMINAL = {s.value for s in TERMINAL_STATES}
T = TypeVar("T")
TENANT_PATTERN = re.compile(r"[A-Za-z0-9._@-]{1,128}")  # the gateway keys file's tenant names
SENT_EVENTS_PER_MESSAGE = 200  # a batch's task-sent events go out this many to a broker message
WEIGHT_REFRESH_S = 60.0  # a producer writes its tenant's weight into Redis at most this often


def check_tenant(tenant: str) -> str:
    """``tenant`` if it is a valid tenant name (letters, digits, ``._@-``; 1-128 characters), else RequestError."""
    if not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant):
        raise RequestError(f"tenant: {tenant!r} is not a tenant name (1-128 of A-Z a-z 0-9 . _ @ -)", "tenant")
    return tenant


class JobNotFoundError(KeyError):
    pass


class JobFailedError(RuntimeError):
    """``result`` / ``stream`` of a job that ended failed, cancelled or expired."""

    def __init__(self, status: JobStatus) -> None:
        message = (status.error or {}).get("message") or status.state
        super().__init__(f"job {status.id} {status.state}: {message}")
        self.status = status


@dataclass
class JobStatus:
    id: str
    state: str
    priority: int = 5
    tenant: str = "default"
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
    completion_tokens: int | None = None
    worker: str | None = None
    batch_id: str | None = None
    custom_id: str | None = None
    aborted_at_step: int | None = None
    cached: int = 0  # 1: answered from the result cache, no GPU worker involved

    @classmethod
    def from_record(cls, job_id: str, rec: dict[str, str]) -> JobStatus:
        kwargs: dict = {"id": job_id}
        for f in fields(cls):
            raw = rec.get(f.name)
            if f.name == "id" or raw is None or raw == "None":
                continue
            if f.name == "error":
                kwargs[f.name] = json.loads(raw)
            elif f.type in ("int", "int | None"):
                kwargs[f.name] = int(float(raw))
            elif f.type == "float | None":
                kwargs[f.name] = float(raw)
            else:
                kwargs[f.name] = raw
        return cls(**kwargs)

    @property
    def done(self) -> bool:
        return self.state in _TERMINAL


@dataclass
class BatchStatus:
    id: str
    status: str  # in_progress | completed
    total: int
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    created_at: float | None = None
    completed_at: float | None = None
    request_counts: dict = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.status == "completed"


def _request_body(messages, prompt, fields_: dict) -> tuple[str, dict]:
    if messages is not None and prompt is not None:
        raise RequestError("give either messages (chat) or prompt (text completion), not both", "messages")
    if messages is None and prompt is None:
        raise RequestError("messages: required (or prompt, for a text completion)", "messages")
    if messages is not None:
        return CHAT_URL, {"messages": messages, **fields_}
    return COMPLETIONS_URL, {"prompt": prompt, **fields_}


def _broker_call(method: Callable[..., T]) -> Callable[..., T]:
    """Broker trouble surfaces as BrokerUnavailable (bounded by ``broker_timeout_s``), Redis refusing a write for
    lack of memory as RequestError ``queue_full``; nothing is left half-written either way."""

    @functools.wraps(method)
    def call(self: Client, *args, **kwargs) -> T:
        try:
            return method(self, *args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError, OperationalError) as e:
            raise BrokerUnavailable(f"the broker did not answer: {type(e).__name__}: {e}") from None
        except redis.ResponseError as e:
            if str(e).startswith("OOM"):
                raise RequestError("the broker is out of memory; retry later", code="queue_full") from None
            raise

    return call


class Client:
    """A producer.  Its jobs are charged to ``tenant`` (default ``PAGEDQ_TENANT``), whose weight
    (``PAGEDQ_TENANT_WEIGHTS``, or ``weights``) it writes where the dispatcher reads it (``names.tenant_weights``)."""

    def __init__(self, settings: Settings | None = None, broker_url: str | None = None,
                 tenant: str | None = None) -> None:
        self.settings = settings or get_settings()
        self.tenant = check_tenant(tenant or self.settings.tenant)
        self.weights: dict[str, float] = dict(self.settings.tenant_weights)  # tenant -> weight; missing: 1.0
        self._weights_written: dict[str, float] = {}  # tenant -> monotonic time its weight was last written
        url = broker_url or find_broker_url(self.settings)
        self.r = redis_client(url, self.settings.broker_timeout_s, self.settings)
        self.names = Names.from_settings(self.settings)
        self.control = ControlChannel(self.r, self.names, configured_secret(self.settings))
        self.store = JobStore.from_settings(self.r, self.names, self.settings)
        self.app = make_celery(self.settings, url)
        self.cache = ResultCache(self.r, self.names, self.settings.result_cache_ttl_s,
                                 self.settings.result_cache_max_bytes)
        # A request naming a model folder on this host that no worker serves is refused with its architecture
        # when that one is not served.  The gateway turns it off: a tenant must not learn this host's files.
        self.reads_local_folders = True

    def close(self) -> None:
        self.app.close()
        self.r.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- submitting -----------------------------------------------------------
    @_broker_call
    def submit(self, messages: list[dict] | None = None, *, prompt: str | list[int] | None = None,
               priority: int | None = None, timeout_s: float | None = None, tenant: str | None = None,
               **fields_) -> str:
        """Enqueue a chat (``messages``) or text (``prompt``) request; returns its job id at once.

        ``fields_`` are OpenAI request fields (model, max_tokens, temperature, stop, seed, ...).
        ``priority`` is 0-9, 9 most urgent (default ``settings.default_priority``).  A job not
        started within ``timeout_s`` seconds ends 'expired'.  ``tenant`` (default the client's) is whom
        the job is charged to; its share of a model's backlog is bounded (``PAGEDQ_TENANT_BACKLOG_SHARE``).
        """
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s >= 0):
            raise RequestError("timeout_s: must be a number of seconds >= 0", "timeout_s")
        tenant = check_tenant(tenant or self.tenant)
        if priority is not None:
            fields_["priority"] = priority
        fields_.setdefault("priority", self.settings.default_priority)
        url, body = _request_body(messages, prompt, fields_)
        req = self.validate(url, body)
        job_id = self._new_job_id()
        cache_key, cached = self._cache_lookup(url, req)
        record = self._job_record(req, timeout_s, tenant=tenant, **cache_key)
        msg = self._preprocess_message(job_id, url, req, record)
        self._write_weights([tenant])
        payload = to_json(msg)
        self.store.create([(job_id, record)], self.settings.max_queued_jobs, messages={job_id: json.dumps(payload)},
                          tenant_share=self.settings.tenant_backlog_share)
        if cached is not None:
            self._answer_from_cache(job_id, cached)
        else:
            try:
                self._send(msg, req.priority, payload=payload)
            except BaseException:
                self.store.discard(job_id)  # never sent: no trace of it stays
                raise
            sending = _SendLoop(self.store, [job_id])
            sending.one_sent()
            sending.finish()
        self.store.replicated([job_id])  # PAGEDQ_REDIS_MIN_REPLICAS_ACK: on the replicas before it is returned
        return job_id

    def _cache_lookup(self, url: str, req: AnyRequest) -> tuple[dict, dict | None]:
        """(the job record's cache fields, the cached response or None) for a request.

        A deterministic request (greedy, or seeded) records its digest and the cache's version
        (``cache_request``, ``cache_version``): postprocess files the answer under the fingerprint of
        the weights that produced it.  It is looked up (``cache_key``) once a worker has registered the
        model: the key needs the fingerprint of the weights the model is served with.
        """
        body = cache_body(req)
        if not (self.settings.result_cache and req.use_result_cache and is_deterministic(body)):
            return {}, None
        body.setdefault("max_tokens", DEFAULT_MAX_TOKENS)  # 0 (a prompt scored) is not the default
        fields = {"cache_request": request_digest(url, body), "cache_version": self.cache.version(req.model)}
        info = lookup_model(self.r, self.names, req.model)
        if info is None:
            return fields, None
        key = self.cache.key(req.model, fields["cache_version"], info.fingerprint, fields["cache_request"])
        return {**fields, "cache_key": key}, self.cache.get(key)

    def _answer_from_cache(self, job_id: str, response: dict) -> None:
        """Complete a job with a cached response: its own id, marked ``cached``; no task is sent."""
        prefix = "chatcmpl-" if response.get("object") == "chat.completion" else "cmpl-"
        body = {**response, "id": prefix + job_id, "created": int(time.time()), "cached": True}
        usage = body.get("usage", {})
        self.store.update(job_id, cached=1, started_at=now(), prompt_tokens=usage.get("prompt_tokens", 0),
                          completion_tokens=usage.get("completion_tokens", 0))
        self.store.finish(job_id, JobState.COMPLETED, result=body)

    @_broker_call
    def validate(self, url: str, body: dict) -> AnyRequest:
        """The request, checked against the schema and the served model; raises RequestError."""
        req = parse_request(url, body)
        params = to_sampling_params(req)
        req.model, info = self.check_model(req.model)
        if info is not None:
            max_tokens = req.max_tokens or DEFAULT_MAX_TOKENS
            if max_tokens >= info.max_model_len:
                raise RequestError(f"max_tokens: {max_tokens} leaves no room for a prompt in the model's "
                                   f"{info.max_model_len}-token context", "max_tokens",
                                   code="context_length_exceeded")
            if not isinstance(req, ChatCompletionRequest) and isinstance(req.prompt, list):
                check_context(req.prompt, params.max_tokens, info.max_model_len, info.vocab_size)
            check_logit_bias(params.logit_bias, info.vocab_size)
            check_stop_token_ids(params.stop_token_ids, info.vocab_size)
        return req

    def check_model(self, model: str | None) -> tuple[str, ModelInfo | None]:
        """(the model's own name, its registry record) for a request naming ``model`` (None: the default);
        RequestError naming ``model`` if no worker ever registered it (the default model may be registered
        later: its record is None until then).  Remembered a second: a batch reads each model about once."""
        name = canonical_name(self.settings, model or default_model(self.settings))
        info = self._models.lookup(name)
        if info is None and name != default_model(self.settings):
            refused = refusal(name, name) if self.reads_local_folders else None
            if refused is not None:
                raise RequestError(f"model: {refused}", "model", code="model_not_found")
            raise RequestError(f"model: unknown model {name!r}; served: {self._models.served()}", "model",
                               code="model_not_found")
        return (name if info is None else info.name), info  # an alias is the model's own name from here on

    # --- models and the result cache ---------------------------------------------
    @_broker_call
    def invalidate_cache(self, model: str | None = None) -> int:
        """Make every cached result of ``model`` unreachable at once; returns the cache's new version."""
        model = canonical_name(self.settings, model or default_model(self.settings))
        return self.cache.invalidate(getattr(lookup_model(self.r, self.names, model), "name", model))

    @_broker_call
    def reload(self, model: str | None = None, timeout: float = 120) -> str:
        """Ask the GPU workers serving ``model`` to reload its weights; returns the new fingerprint.

        Their prefix caches are dropped, and the new fingerprint makes earlier cached results unreachable.
        """
        model = canonical_name(self.settings, model or default_model(self.settings))
        before = lookup_model(self.r, self.names, model)
        if before is None:
            raise RequestError(f"model: no worker serves {model!r}", "model", code="model_not_found")
        model = before.name  # an alias names its model
        self.control.publish("reload", model=model)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = lookup_model(self.r, self.names, model)
            if info is not None and info.updated_at > before.updated_at:
                return info.fingerprint
            time.sleep(0.1)
        raise TimeoutError(f"no worker reloaded {model!r} within {timeout} s")

    @_broker_call
    def served_models(self) -> list[str]:
        """Names of the models GPU workers have registered (``names.models_index``: no scan)."""
        return served_models(self.r, self.names)

    @functools.cached_property
    def _models(self) -> ModelLookups:
        """What validation reads of the registry, remembered briefly (``ModelLookups``)."""
        return ModelLookups(self.r, self.names)

    def _new_job_id(self) -> str:
        return uuid.uuid4().hex

    def _job_record(self, req: AnyRequest, timeout_s: float | None, tenant: str | None = None, **extra) -> dict:
        created = now()
        rec = {"state": JobState.QUEUED.value, "priority": req.priority, "model": req.model,
               "kind": "chat" if isinstance(req, ChatCompletionRequest) else "text", "created_at": created,
               "attempts": 0, "stream": int(req.stream), "tenant": tenant or self.tenant, **extra}
        if timeout_s is not None:
            rec["expires_at"] = created + timeout_s
        return rec

    def _preprocess_message(self, job_id: str, url: str, req: AnyRequest, record: dict | None = None) -> PreprocessJob:
        """The job's first message, carrying its ``SchedulingMeta`` as its record states it."""
        rec = record or self._job_record(req, None)
        meta = SchedulingMeta(tenant=rec["tenant"], priority=req.priority, deadline=rec.get("expires_at"),
                              arrival=rec["created_at"], session=req.prompt_cache_key or req.user or None)
        return PreprocessJob(job_id, url, request_body(req), meta)

    def _write_weights(self, tenants: Iterable[str]) -> None:
        """Write the weights this producer knows for ``tenants`` into ``names.tenant_weights`` (at most every
        ``WEIGHT_REFRESH_S`` per tenant; a tenant without a known weight is left as it is: missing = 1.0)."""
        due = {t: self.weights[t] for t in set(tenants) if t in self.weights
               and time.monotonic() - self._weights_written.get(t, -WEIGHT_REFRESH_S) >= WEIGHT_REFRESH_S}
        if due:
            self.r.hset(self.names.tenant_weights, mapping={t: repr(float(w)) for t, w in due.items()})
            self._weights_written.update(dict.fromkeys(due, time.monotonic()))

    def _send(self, msg: PreprocessJob, priority: int, line: int | None = None, event_dispatcher=None,
              payload: dict | None = None) -> None:
        """``line``: a batch line's number (its broker step: ``bulk_step``); ``event_dispatcher``: where its
        task-sent event goes (``send_preprocess``)."""
        send_preprocess(self.app, msg, priority, line=line, event_dispatcher=event_dispatcher, payload=payload)

    @property
    def batch_priority(self) -> int:
        """The priority of a batch line that sets none (``PAGEDQ_BATCH_PRIORITY``, default ``default_priority``)."""
        p = self.settings.batch_priority
        return self.settings.default_priority if p is None else p

    # --- following jobs -------------------------------------------------------
    @_broker_call
    def status(self, job_id: str) -> JobStatus:
        rec = self.store.get(job_id)
        if not rec:
            raise JobNotFoundError(job_id)
        return JobStatus.from_record(job_id, rec)

    @_broker_call
    def wait(self, job_id: str, timeout: float | None = None) -> JobStatus:
        """Block until the job is in a terminal state (pub/sub, with a polling fallback).

        Raises TimeoutError after ``timeout`` seconds (default ``settings.wait_timeout_s``); the job goes on.
        """
        timeout = self.settings.wait_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self.r.pubsub(ignore_subscribe_messages=True) as ps:
            ps.subscribe(self.names.done_channel(job_id))
            while True:
                status = self.status(job_id)
                if status.done:
                    return status
                left = min(1.0, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError(f"job {job_id} still {status.state} after {timeout} s")
                ps.get_message(timeout=left)

    @_broker_call
    def result(self, job_id: str, timeout: float | None = None) -> dict:
        """The completion object; raises JobFailedError if the job failed, was cancelled or expired."""
        status = self.wait(job_id, timeout)
        if status.state != JobState.COMPLETED:
            raise JobFailedError(status)
        result = self.store.result(job_id)
        if result is None:
            raise JobNotFoundError(f"{job_id}: result expired")
        return result

    @_broker_call
    def cancel(self, job_id: str) -> JobStatus:
        """Cancel a queued job at once, or a running one between two engine steps."""
        previous = self.store.request_cancel(job_id)
        if previous == "missing":
            raise JobNotFoundError(job_id)
        if previous == JobState.QUEUED:
            self.store.finish(job_id, JobState.CANCELLED)
        elif previous in (JobState.IN_PROGRESS, JobState.CANCELLING):
            self.control.publish("cancel", job_id=job_id)
        return self.status(job_id)

    def stream(self, job_id: str, timeout: float | None = None) -> Iterator[str]:
        """Yield the job's text as it is generated; the pieces join to the final text."""
        key = self.names.stream(job_id)
        if not self.r.exists(self.names.job(job_id)):
            raise JobNotFoundError(job_id)
        self.store.request_stream(job_id)
        self.control.publish("stream", job_id=job_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        sent, last = "", "0-0"
        while not self.status(job_id).done:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still running after {timeout} s")
            entries = self.r.xread({key: last}, count=256, block=1000) or []
            ended = False
            for _, items in entries:
                for entry_id, item in items:
                    last = entry_id
                    if item.get("type") == "delta":
                        sent += item["text"]
                        yield item["text"]
                    ended = ended or item.get("type") == "end"
            if ended:
                break
        text = _text_of(self.result(job_id, timeout=5))
        if text.startswith(sent) and len(text) > len(sent):
            yield text[len(sent):]  # whatever was generated before streaming began

    # --- batches --------------------------------------------------------------
    @_broker_call
    def submit_batch(self, lines: Iterable[str | dict], priority: int | None = None,
                     timeout_s: float | None = None, *, tenant: str | None = None) -> str:
        """Enqueue an OpenAI Batch (JSONL lines or dicts); returns the batch id.

        A bad line does not stop the batch: it becomes a failed job whose output line carries
        the error, as in ``run-batch --offline``.  ``priority`` overrides every line's; otherwise a line
        without one runs at ``settings.batch_priority`` (default: ``default_priority``).  Every job is
        charged to ``tenant`` (default the client's).
        """
        tenant = check_tenant(tenant or self.tenant)
        items = [self._parse_line(line, priority) for line in _batch_lines(lines)]
        batch_id = f"batch_{uuid.uuid4().hex}"
        bkey, jobs_key = self.names.batch(batch_id), self.names.batch_jobs(batch_id)
        job_ids = [self._new_job_id() for _ in items]
        lookups = [self._cache_lookup(url, req) if err is None else ({}, None) for _, req, url, err in items]
        records, msgs = [], {}
        for job_id, (custom_id, req, url, err), (cache_key, _) in zip(job_ids, items, lookups, strict=True):
            extra = {"batch_id": batch_id, "batch_key": bkey, "custom_id": custom_id or ""}
            if err is not None:
                records.append((job_id, {"state": JobState.QUEUED.value, "created_at": now(), "attempts": 0,
                                         "tenant": tenant, **extra}))
            else:
                records.append((job_id, self._job_record(req, timeout_s, tenant=tenant, **extra, **cache_key)))
                msgs[job_id] = self._preprocess_message(job_id, url, req, records[-1][1])
        batch = {"state": "in_progress", "total": len(items), "created_at": now(), "jobs_key": jobs_key,
                 "done_channel": self.names.batch_done_channel(batch_id)}
        self._write_weights([tenant])
        payloads = {j: to_json(m) for j, m in msgs.items()}  # made once: stored beside the record, and sent
        self.store.create(records, self.settings.max_queued_jobs, batch=(bkey, batch, job_ids),
                          messages={j: json.dumps(p) for j, p in payloads.items()},
                          tenant_share=self.settings.tenant_backlog_share)
        loop = _SendLoop(self.store, job_ids)
        with self.app.connection_for_write() as conn:
            # The lines' task-sent events (Flower's) go out SENT_EVENTS_PER_MESSAGE to a broker message.
            events = self.app.events.Dispatcher(conn, enabled=True, buffer_group=["task"],
                                                buffer_limit=SENT_EVENTS_PER_MESSAGE)
            sent = BufferedSentEvents(events)
            try:
                sends = zip(job_ids, items, lookups, strict=True)
                for line, (job_id, (_, req, _url, err), (_, cached)) in enumerate(sends):
                    if err is not None:
                        self.store.finish(job_id, JobState.FAILED, error=err.to_dict())
                    elif cached is not None:
                        self._answer_from_cache(job_id, cached)
                    else:
                        self._send(msgs[job_id], req.priority, line=line, event_dispatcher=sent,
                                   payload=payloads[job_id])
                    loop.one_sent()
            except BaseException as e:  # every job written ends: those not sent fail with the reason
                error = RequestError(f"could not enqueue the job: {type(e).__name__}: {e}", code="server_error")
                for job_id in job_ids[loop.sent:]:
                    self.store.finish(job_id, JobState.FAILED, error=error.to_dict())
                loop.finish()
                raise
            finally:
                try:
                    events.flush()
                except Exception as e:  # noqa: BLE001 - events are for watching; the jobs are sent
                    log.warning("could not send the batch's task-sent events: %s", e)
        loop.finish()
        if not items:
            self.r.hset(bkey, mapping={"state": "completed", "completed_at": now()})
        self.store.replicated(job_ids)
        return batch_id

    def _parse_line(self, line: str | dict, priority: int | None):
        text = line if isinstance(line, str) else json.dumps(line)
        custom_id = None
        try:
            custom_id, req, url = parse_batch_line(text)
            body = req.model_dump(exclude_none=True)
            if priority is not None:
                body["priority"] = priority
            elif "priority" not in req.model_fields_set:
                body["priority"] = self.batch_priority
            return custom_id, self.validate(url, body), url, None
        except RequestError as e:
            return e.custom_id or custom_id, None, None, e

    @_broker_call
    def batch_status(self, batch_id: str) -> BatchStatus:
        rec = self.r.hgetall(self.names.batch(batch_id))
        if not rec:
            raise JobNotFoundError(batch_id)
        counts = {k: int(rec.get(k, 0)) for k in ("completed", "failed", "cancelled", "expired")}
        total = int(rec["total"])
        return BatchStatus(batch_id, rec["state"], total, **counts,
                           created_at=float(rec["created_at"]),
                           completed_at=float(rec["completed_at"]) if "completed_at" in rec else None,
                           request_counts={"total": total, "completed": counts["completed"],
                                           "failed": total - counts["completed"] - _pending(rec, total)})

    @_broker_call
    def wait_batch(self, batch_id: str, timeout: float | None = None) -> BatchStatus:
        """Block until every job of the batch is final (pub/sub, with a polling fallback)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.r.pubsub(ignore_subscribe_messages=True) as ps:
            ps.subscribe(self.names.batch_done_channel(batch_id))
            while not (status := self.batch_status(batch_id)).done:
                left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                if left <= 0:
                    raise TimeoutError(f"batch {batch_id} not done after {timeout} s")
                ps.get_message(timeout=left)
        return status

    @_broker_call
    def cancel_batch(self, batch_id: str, chunk: int = 500) -> BatchStatus:
        """Cancel every job of the batch still waiting or running: the waiting ones end ``cancelled`` at once,
        the running ones within a worker's re-check interval.  ``chunk`` jobs a round trip, with a pause
        between chunks so that a 50,000-job batch's walk leaves the broker and this process to others."""
        self.batch_status(batch_id)  # JobNotFoundError for an unknown batch
        key = self.names.batch_jobs(batch_id)
        for start in range(0, int(self.r.llen(key)), chunk):
            self.store.cancel_many(self.r.lrange(key, start, start + chunk - 1))
            time.sleep(0.001)
        return self.batch_status(batch_id)

    @_broker_call
    def batch_results(self, batch_id: str, timeout: float | None = None) -> list[dict]:
        """OpenAI Batch output lines, in input order (waits for the batch to finish)."""
        self.wait_batch(batch_id, timeout)
        job_ids = self.r.lrange(self.names.batch_jobs(batch_id), 0, -1)
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hgetall(self.names.job(job_id))
            pipe.get(self.names.result(job_id))
        replies = pipe.execute()
        return [_output_line(JobStatus.from_record(job_id, rec), raw)
                for job_id, rec, raw in zip(job_ids, replies[::2], replies[1::2], strict=True)]


class _SendLoop:
    """What the lost-job sweep (``store.lost_jobs``) needs to know of a send loop over freshly created jobs.

    A job is written pending (the sweep leaves it alone for ``send_grace_s``); once its message is sent it is
    confirmed (the sweep looks for it from then on), in chunks.  While the loop runs, the grace of the jobs not
    yet sent is extended every third of it, so however long a batch takes to send, none of its jobs is sent
    again before its own send; a producer killed mid-loop leaves its unsent jobs to the sweep once the grace
    has passed.  Confirming is best effort: an unconfirmed job is looked for once its grace has passed.
    """

    CONFIRM_EVERY = 500

    def __init__(self, store: JobStore, job_ids: list[str]) -> None:
        self.store, self.job_ids = store, job_ids
        self.sent = self.confirmed = 0
        self.extended_at = time.monotonic()

    def one_sent(self) -> None:
        """The next job's message is sent (or the job ended without one)."""
        self.sent += 1
        if self.sent - self.confirmed >= self.CONFIRM_EVERY:
            self.store.mark_sent(self.job_ids[self.confirmed:self.sent])
            self.confirmed = self.sent
        if time.monotonic() - self.extended_at > self.store.send_grace_s / 3 and self.sent < len(self.job_ids):
            self.store.keep_pending(self.job_ids[self.sent:])
            self.extended_at = time.monotonic()

    def finish(self) -> None:
        """Confirm the jobs sent so far."""
        try:
            self.store.mark_sent(self.job_ids[self.confirmed:self.sent])
        except redis.RedisError:
            pass  # looked for once their grace has passed
        self.confirmed = self.sent


def _batch_lines(lines) -> Iterator[str | dict]:
    """A batch's non-blank lines, from a path, an open file, or an iterable of lines or dicts."""
    if isinstance(lines, (str, os.PathLike)):
        if isinstance(lines, str) and ("\n" in lines or not os.path.isfile(lines)):
            raise TypeError("submit_batch takes a path to a JSONL file, an open file, or an iterable of lines "
                            f"or dicts; {lines[:40]!r} is not an existing file")
        lines = read_batch_file(lines)
    for line in lines:
        if isinstance(line, bytes):
            line = line.decode("utf-8", "surrogateescape")
        if not isinstance(line, str) or line.strip():
            yield line


def _pending(rec: dict, total: int) -> int:
    return total - int(rec.get("done", 0))


def _text_of(result: dict) -> str:
    choice = result["choices"][0]
    return (choice["message"]["content"] or "") if "message" in choice else choice["text"]


def _output_line(status: JobStatus, raw_result: str | None) -> dict:
    custom_id = status.custom_id or None
    if status.state == JobState.COMPLETED and raw_result:
        return batch_output_line(custom_id, json.loads(raw_result))
    err = status.error or {"message": f"request {status.state}", "param": None, "code": status.state}
    return batch_output_line(custom_id, error=RequestError(err["message"], err.get("param"),
                                                           code=err.get("code") or "invalid_request_error"))
