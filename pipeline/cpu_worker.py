"""``pagedq cpu-worker``: the Celery CPU worker, with the preprocess and postprocess tasks.

- ``preprocess`` (queue ``pagedq.preprocess``): re-validates the request,
  waits (by retrying) until a GPU worker has registered the model, applies the
  chat template, tokenizes, checks the context length against the registered
  model, and puts the job in its model's fair queue (``store/dispatch.py``)
  with a dispatch token on ``pagedq.generate.<model>`` at the broker
  priority of its pagedq priority: a GPU worker with a free seat binds the
  token to the next job in the fleet order.
- the lost-job sweep (``store.lost_jobs``) in a thread: a job whose message
  was lost on its way (a worker killed mid-delivery) is sent again.
- the batch finalizer in a thread: a batch whose last job ended gets its
  output files written (``gateway/batches.py``).
- the deadline watch (``store.deadlines``) in a thread: a waiting job whose
  start deadline (``timeout_s``) passed ends expired, whether or not a GPU worker is up.
- ``postprocess`` (queue ``pagedq.results``), the result consumer:
  detokenizes, applies stop strings, builds the chat / text completion object,
  and publishes result + state in one atomic, once-only step.

Both share ``preprocess.py`` / ``postprocess.py`` with the offline path.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from celery import Celery
from celery.exceptions import Reject, Retry

from pagedq.config import Settings
from pagedq.config.celery_app import make_celery, message_lease_s, send_dispatch_token, send_preprocess
from pagedq.config.messages import (
    Completion,
    GenerateJob,
    JobNotCompleted,
    MalformedMessageError,
    PreprocessJob,
    check_context,
    check_logit_bias,
    parse_message,
)
from pagedq.config.names import (
    POSTPROCESS_TASK,
    PREPROCESS_TASK,
    JobState,
    Names,
)
from pagedq.config.scheduling import DEFAULT_TENANT, SchedulingMeta
from pagedq.config.served import default_model, local_model
from pagedq.pipeline.postprocess import build_response, cache_answer
from pagedq.pipeline.preprocess import render_prompt
from pagedq.pipeline.protocol import ChatCompletionRequest, RequestError, parse_request, to_sampling_params
from pagedq.store.connection import broker_url, redis_client, through_outage
from pagedq.store.deadlines import DeadlineWatch, start_watching
from pagedq.store.dispatch import FairDispatch
from pagedq.store.jobs import JobStore
from pagedq.store.lost_jobs import LostJobSweep
from pagedq.store.model_names import registered_folder
from pagedq.store.registry import ModelInfo, lookup_model
from pagedq.store.result_cache import ResultCache
from pagedq.workers.celery_worker import run_celery_worker, sent_events
from pagedq.workers.engine.block_hash import cache_key, prefix_hashes
from pagedq.workers.metrics import task_metrics
from pagedq.workers.processes import worker_hostname

log = logging.getLogger(__name__)
MODEL_WAIT_RETRY_S = 1.0


class Tokenizers:
    """Each model's tokenizer, loaded once per process.

    From the folder the GPU worker registered when it exists on this host (so a CPU worker never
    converts the packaged model while a GPU worker does), else from the model's own folder here.
    """

    def __init__(self, state_dir, registered_path) -> None:
        self.state_dir = state_dir
        # model name -> the registered folder on this host, else what to resolve here (a served name: PAGEDQ_MODEL)
        self.registered_path = registered_path
        self._cache: dict = {}
        self._lock = threading.Lock()

    def import_library(self) -> None:
        """Import transformers' tokenizer code (seconds), under the lock: two threads importing it at once can
        fail with ImportError."""
        with self._lock:
            from transformers import AutoTokenizer  # noqa: F401

    def get(self, model: str):
        with self._lock:
            if model not in self._cache:
                from transformers import AutoTokenizer

                from pagedq.workers.model.loader import resolve_model

                path = self.registered_path(model)
                if not (path and os.path.isdir(path)):
                    path = resolve_model(path or model, self.state_dir).path
                self._cache[model] = AutoTokenizer.from_pretrained(path)
            return self._cache[model]


def parse_or_reject(cls, payload, task: str, task_id: str):
    try:
        return parse_message(cls, payload)
    except MalformedMessageError as e:
        log.error("%s task %s: dropped a malformed message: %s", task, task_id, e)
        raise Reject(f"malformed message: {e}", requeue=False) from None


class ModelNotServedError(LookupError):
    pass


def prepare(msg: PreprocessJob, r, names: Names, tokenizers: Tokenizers) -> tuple[GenerateJob, ModelInfo]:
    """The GenerateJob for a request, and its model as registered; raises RequestError, or ModelNotServedError
    while no worker has it."""
    req = parse_request(msg.url, msg.body)
    if req.model is None:
        raise RequestError("model: missing (the client fills it in)", "model")
    info = lookup_model(r, names, req.model)
    if info is None:
        raise ModelNotServedError(req.model)
    ids = render_prompt(tokenizers.get(req.model), req)
    params = to_sampling_params(req)
    check_context(ids, params.max_tokens, info.max_model_len, info.vocab_size)
    check_logit_bias(params.logit_bias, info.vocab_size)
    kind = "chat" if isinstance(req, ChatCompletionRequest) else "text"
    meta = replace(_scheduling_meta(msg, r, names), priority=req.priority)
    parsing = req.tool_parsing if isinstance(req, ChatCompletionRequest) else ""
    return GenerateJob(msg.job_id, req.model, kind, ids, params, req.priority, req.stream, meta, parsing), info


MAX_PLACEMENT_BLOCKS = 128  # a prompt's leading blocks named for placement (2,048 tokens at 16 a block)


def prompt_blocks(job: GenerateJob, info: ModelInfo) -> list[str]:
    """The names of the job's prompt's leading blocks as its model's workers name their cache's blocks
    (``workers.engine.block_hash``, the registered block size and weights); [] while that is not known."""
    if info.block_size <= 0:
        return []
    key = cache_key(info.name, info.fingerprint, job.params.cache_salt)
    return [h.hex() for h in prefix_hashes(job.prompt_token_ids, info.block_size, key, MAX_PLACEMENT_BLOCKS)]


def _scheduling_meta(msg: PreprocessJob, r, names: Names) -> SchedulingMeta:
    """The job's ``SchedulingMeta``: its message's, or (a message from a producer older than ``meta``) its record's."""
    if msg.meta.arrival:
        return msg.meta
    tenant, created, expires = r.hmget(names.job(msg.job_id), "tenant", "created_at", "expires_at")
    return SchedulingMeta.from_dict({"tenant": tenant, "deadline": expires, "arrival": created})


def register_cpu_tasks(app: Celery, settings: Settings, r, store: JobStore, names: Names,
                       tokenizers: Tokenizers) -> None:
    max_model_waits = int(settings.model_wait_s / MODEL_WAIT_RETRY_S)
    cache = ResultCache(r, names, settings.result_cache_ttl_s, settings.result_cache_max_bytes)
    fair = FairDispatch(r, names)

    @app.task(name=PREPROCESS_TASK, bind=True, max_retries=None, throws=(JobNotCompleted,))
    def preprocess(self, payload):
        msg = parse_or_reject(PreprocessJob, payload, "preprocess", self.request.id)
        verdict = store.admit(msg.job_id)
        if verdict != "ok":
            store.settle(msg.job_id, verdict)
            raise JobNotCompleted(f"job {msg.job_id} {store.state(msg.job_id)} before preprocessing")
        try:
            job, info = prepare(msg, r, names, tokenizers)
        except ModelNotServedError as e:
            if self.request.retries < max_model_waits:
                raise self.retry(countdown=MODEL_WAIT_RETRY_S) from None
            error = RequestError(f"model: no worker serves {e.args[0]!r}", "model", "model_not_found")
            store.finish(msg.job_id, JobState.FAILED, error=error.to_dict())
            raise JobNotCompleted(f"job {msg.job_id} failed: {error.code}: {error}") from None
        except RequestError as e:
            store.finish(msg.job_id, JobState.FAILED, error=e.to_dict())
            raise JobNotCompleted(f"job {msg.job_id} failed: {e.code}: {e}") from None
        except Retry:
            raise
        except Exception as e:  # noqa: BLE001 - every accepted job ends: this one, with the reason
            log.exception("preprocess of job %s failed", msg.job_id)
            error = RequestError(f"preprocess failed: {type(e).__name__}: {e}", code="server_error")
            store.finish(msg.job_id, JobState.FAILED, error=error.to_dict())
            raise JobNotCompleted(f"job {msg.job_id} failed: {error.code}: {error}") from None
        store.update(msg.job_id, prompt_tokens=len(job.prompt_token_ids), preprocessed_at=time.time())
        # The job waits in its model's fair queue; a token runs the next one in line.  Pushed before the token,
        # and before this message is acknowledged: never a token too few.
        fair.push(job, prompt_blocks(job, info))
        send_dispatch_token(self.app, job.model, job.priority, event_dispatcher=sent_events(),
                            tenant=job.meta.tenant or DEFAULT_TENANT)
        return {"job_id": msg.job_id, "prompt_tokens": len(job.prompt_token_ids)}

    @app.task(name=POSTPROCESS_TASK, bind=True, throws=(JobNotCompleted,))
    def postprocess(self, payload):
        c = parse_or_reject(Completion, payload, "postprocess", self.request.id)
        try:
            body = build_response(c, tokenizers.get(c.model))
        except Exception as e:  # noqa: BLE001 - every accepted job ends: this one, with the reason
            log.exception("postprocess of job %s failed", c.request_id)
            error = RequestError(f"postprocess failed: {type(e).__name__}: {e}", code="server_error")
            store.finish(c.request_id, JobState.FAILED, error=error.to_dict(), fence=c.epoch or None)
            raise JobNotCompleted(f"job {c.request_id} failed: {error.code}: {error}") from None
        published = through_outage(lambda: store.finish(c.request_id, JobState.COMPLETED, result=body,
                                                        fence=c.epoch or None), f"job {c.request_id}")
        if not published:
            log.info("job %s: already final or unknown; result not published again", c.request_id)
        else:
            cache_answer(cache, c, body)
        return {"job_id": c.request_id, "published": published,
                "finish_reason": body["choices"][0]["finish_reason"]}


def start_warming(tokenizers: Tokenizers, model: str, is_served: Callable[[str], bool],
                  wait_s: float = 600) -> threading.Thread:
    """Load the default model's tokenizer in the background, as soon as a GPU worker serves it.

    Otherwise the first request pays for it (importing transformers alone takes seconds); work is taken
    meanwhile, and a request that comes first loads it itself (the cache's lock makes it load once).
    """
    def warm() -> None:
        tokenizers.import_library()  # the slow part, whichever model comes
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                served = is_served(model)
            except Exception:  # noqa: BLE001 - the broker may be away for now
                served = False
            if served:
                try:
                    tokenizers.get(model)
                except Exception as e:  # noqa: BLE001 - other models may still be served
                    log.warning("could not load the tokenizer of %s: %s", model, e)
                return
            time.sleep(1)

    thread = threading.Thread(target=warm, name="tokenizer-warmup", daemon=True)
    thread.start()
    return thread


def start_sweeping(sweep: LostJobSweep) -> threading.Thread:
    """Sweep for jobs whose message was lost, every interval, for as long as this process runs."""
    def loop() -> None:
        stop = threading.Event()
        while not stop.wait(sweep.interval_s):
            try:
                sweep.sweep()
            except Exception as e:  # noqa: BLE001 - the broker may be away; the next interval tries again
                log.warning("lost-job sweep failed: %s: %s", type(e).__name__, e)

    thread = threading.Thread(target=loop, name="lost-job-sweep", daemon=True)
    thread.start()
    return thread


def start_finalizing(settings: Settings, r) -> threading.Thread:
    """Write the output files of each batch soon after its last job ends (``gateway/batches.py``)."""
    def loop() -> None:
        from pagedq.pipeline.gateway.batches import BatchFinalizer  # the gateway's code: off the start path

        BatchFinalizer.from_settings(settings, r).run_forever()

    thread = threading.Thread(target=loop, name="batch-finalizer", daemon=True)
    thread.start()
    return thread


def yield_cores(nice: int) -> None:
    """Lower this process's scheduling priority by ``nice``.  On a CPU, an engine step is thousands of OpenMP
    regions, each as slow as its slowest thread: a preprocessing burst at the same priority that takes one
    of its cores for a time slice stalls every region (a 0.6-s step took 9 s beside a 2,000-line batch's
    preprocessing).  At a lower priority the burst runs in what the engine leaves, and still runs when
    it leaves nothing (nice weighs, it does not starve).

    On Linux with autogroups (``/proc/sys/kernel/sched_autogroup_enabled``, the default on desktops and many
    servers) the scheduler first shares the CPU equally between sessions, and a process's nice only weighs
    inside its own session: ``pagedq up`` starts each process in its own session, so a plain ``nice`` did
    nothing against the engine (measured: the niced CPU worker took 0.84 of a core beside the engine's 1.0
    while it preprocessed a 2,000-line batch).  So a CPU worker that leads its own session lowers its
    session's weight too (``/proc/self/autogroup``); one started inside a shared session (a terminal) does
    not, as that would lower every process of the session."""
    if nice <= 0 or not hasattr(os, "nice"):
        return
    os.nice(nice)
    if os.getsid(0) == os.getpid():
        try:
            Path("/proc/self/autogroup").write_text(str(nice))
        except OSError:
            pass  # no autogroups (a container's cgroup, another OS): the plain nice is what weighs


def run_cpu_worker(settings: Settings, hostname: str | None = None, loglevel: str = "INFO") -> None:
    yield_cores(settings.cpu_worker_nice)
    url = broker_url(settings)
    r = redis_client(url, settings=settings)
    names = Names.from_settings(settings)
    hostname = hostname or worker_hostname("cpu")
    app = make_celery(settings, url)
    tokenizers = Tokenizers(settings.state_dir, lambda model: registered_folder(r, names, model)
                            or local_model(settings, model))
    start_warming(tokenizers, default_model(settings), lambda model: lookup_model(r, names, model) is not None)
    store = JobStore.from_settings(r, names, settings)
    register_cpu_tasks(app, settings, r, store, names, tokenizers)
    sweep = LostJobSweep(store, lambda msg, priority: send_preprocess(app, msg, priority),
                         interval_s=message_lease_s(settings), owner=hostname, max_resends=settings.max_attempts,
                         send_token=lambda model, priority: send_dispatch_token(app, model, priority))
    start_sweeping(sweep)
    start_watching(DeadlineWatch(store, owner=hostname))  # waiting jobs past their start deadline end expired
    start_finalizing(settings, r)
    metrics = task_metrics(settings, hostname)  # off unless PAGEDQ_METRICS_PORT
    # Results first: at equal priority, finishing a job beats starting another.
    run_celery_worker(app, r, names.worker(hostname), {"role": "cpu", **metrics.record_fields()},
                      queues=[names.results_queue, names.preprocess_queue],
                      concurrency=settings.cpu_worker_concurrency, hostname=hostname, loglevel=loglevel,
                      ttl_s=settings.worker_ttl_s)
