"""The GPU worker's side of the queue: the generate task and its helpers.

- ``generate`` (queue ``pagedq.generate.<model>``): admits the job (in_progress,
  one more attempt), hands it to the engine service, waits, then sends the
  Completion to postprocess by task name.  A cancelled job ends here; a job
  aborted by a worker shutdown is rejected with requeue, so another worker
  (or this one, restarted) takes it.
- ``ProgressReporter``: every ``progress_interval_s``, a ``task-progress``
  event (tokens so far) per running task, which Flower shows as the task's
  PROGRESS state, and the same count in the job record.
- ``ControlListener``: cancel / stream requests published by clients.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import redis
from celery import Celery
from celery.exceptions import Reject

from pagedq.config.jobstore import JobStore, error_dict
from pagedq.config.messages import Completion, GenerateJob, MalformedMessageError, parse_message, to_json
from pagedq.config.names import GENERATE_TASK, POSTPROCESS_TASK, JobState, Names, broker_priority
from pagedq.workers.sampling_params import InvalidRequestError, SamplingParams
from pagedq.workers.service import EngineService, Handle

log = logging.getLogger(__name__)


def parse_generate(payload, task_id: str) -> tuple[GenerateJob, SamplingParams]:
    try:
        job = parse_message(GenerateJob, payload)
        return job, SamplingParams(**job.params)
    except (MalformedMessageError, InvalidRequestError, TypeError) as e:
        log.error("generate task %s: dropped a malformed message: %s", task_id, e)
        raise Reject(f"malformed message: {e}", requeue=False) from None


def register_generate(app: Celery, service: EngineService, store: JobStore, names: Names):
    @app.task(name=GENERATE_TASK, bind=True)
    def generate(self, payload):
        job, params = parse_generate(payload, self.request.id)
        verdict = store.admit(job.job_id, worker=self.request.hostname)
        if verdict != "ok":
            store.settle(job.job_id, verdict)
            return {"job_id": job.job_id, "skipped": verdict}
        try:
            handle = service.submit(job, params, self.request.id)
        except InvalidRequestError as e:
            store.finish(job.job_id, JobState.FAILED, error=error_dict(str(e)))
            return {"job_id": job.job_id, "failed": str(e)}
        if store.state(job.job_id) == JobState.CANCELLING:  # cancelled before we were listening for it
            service.cancel(job.job_id)
        handle.done.wait()
        return conclude(self.app, handle, store, names)

    return generate


def conclude(app: Celery, handle: Handle, store: JobStore, names: Names) -> dict:
    job, out = handle.job, handle.output
    if handle.duplicate:
        return {"job_id": job.job_id, "skipped": "already running on this worker"}
    if handle.requeue:
        store.requeue(job.job_id)
        raise Reject("worker shutting down", requeue=True)
    if handle.error or out is None:
        store.finish(job.job_id, JobState.FAILED, error=error_dict(handle.error or "no output", code="server_error"))
        return {"job_id": job.job_id, "failed": handle.error}
    summary = {"job_id": job.job_id, "completion_tokens": len(out.output_token_ids),
               "finish_reason": out.finish_reason}
    if out.finish_reason == "abort":
        store.update(job.job_id, completion_tokens=len(out.output_token_ids), aborted_at_step=handle.finished_step)
        store.finish(job.job_id, JobState.CANCELLED)
        return summary
    store.update(job.job_id, completion_tokens=len(out.output_token_ids))
    completion = Completion(
        request_id=job.job_id, kind=job.kind, model=job.model, output_token_ids=out.output_token_ids,
        num_prompt_tokens=out.num_prompt_tokens, finish_reason=out.finish_reason, stop_reason=out.stop_reason,
        num_cached_tokens=out.num_cached_tokens, logprobs=out.logprobs, stop=handle.params.stop,
        want_logprobs=handle.params.logprobs)
    app.send_task(POSTPROCESS_TASK, args=[to_json(completion)], queue=names.results_queue,
                  priority=broker_priority(job.priority))
    return summary


class ProgressReporter(threading.Thread):
    def __init__(self, app: Celery, service: EngineService, r: redis.Redis, names: Names, hostname: str,
                 interval_s: float) -> None:
        super().__init__(name="progress", daemon=True)
        self.app, self.service, self.r, self.names = app, service, r, names
        self.hostname, self.interval_s = hostname, interval_s
        self.reported: dict[str, int] = {}

    def run(self) -> None:
        with self.app.connection_for_write() as conn:
            # Buffered: one broker message per report carries every task's event (Flower unpacks the list).
            dispatcher = self.app.events.Dispatcher(conn, hostname=self.hostname, enabled=True,
                                                    buffer_group=["task"], buffer_limit=1 << 30)
            while True:
                time.sleep(self.interval_s)
                try:
                    self.report(dispatcher)
                except Exception as e:  # noqa: BLE001 - progress is best effort
                    log.warning("progress report failed: %s", e)

    def report(self, dispatcher) -> None:
        handles = self.service.snapshot()
        pipe = self.r.pipeline(transaction=False)
        for h in handles:
            if h.num_tokens and self.reported.get(h.task_id) != h.num_tokens:
                self.reported[h.task_id] = h.num_tokens
                # Flower shows the custom state (PROGRESS) and, in the task's Result field, the count.
                dispatcher.send("task-progress", uuid=h.task_id, tokens=h.num_tokens,
                                result=f"{h.num_tokens} tokens so far")
                pipe.hset(self.names.job(h.job.job_id), "completion_tokens", h.num_tokens)
        dispatcher.flush()
        pipe.execute()
        live = {h.task_id for h in handles}
        self.reported = {k: v for k, v in self.reported.items() if k in live}


class ControlListener:
    """Requests on ``names.control_channel``: {"op": "cancel" | "stream", "job_id": ...}, or
    {"op": "reload", "model": ...} (reload the weights; the prefix cache is dropped)."""

    def __init__(self, r: redis.Redis, names: Names, service: EngineService) -> None:
        self.service = service
        self.pubsub = r.pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(**{names.control_channel: self.on_message})
        self.thread = None

    def start(self) -> None:
        self.thread = self.pubsub.run_in_thread(sleep_time=1.0, daemon=True,
                                                exception_handler=self._on_error)

    def on_message(self, message: dict) -> None:
        try:
            request = json.loads(message["data"])
            op = request["op"]
            if op == "reload":
                if request["model"] == self.service.engine.model_name:
                    try:
                        self.service.reload()
                    except Exception:  # noqa: BLE001 - a bad folder must not stop the listener
                        log.exception("reloading %s failed; still serving the old weights", request["model"])
                return
            job_id = str(request["job_id"])
        except (ValueError, KeyError, TypeError) as e:
            log.error("ignoring a malformed control message %r: %s", message.get("data"), e)
            return
        if op == "cancel":
            self.service.cancel(job_id)
        elif op == "stream":
            self.service.enable_stream(job_id)
        else:
            log.error("ignoring a control message with unknown op %r", op)

    @staticmethod
    def _on_error(exc, pubsub, thread) -> None:
        log.warning("control listener: %s; retrying", exc)  # redis-py resubscribes on reconnect
        time.sleep(1.0)
