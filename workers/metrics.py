"""Worker-side Prometheus metrics (``prometheus-client``), one registry and one HTTP endpoint per worker.

``PAGEDQ_METRICS_PORT`` unset or 0: nothing is served and ``EngineMetrics``'s hooks do nothing (the GPU
worker then does exactly what it did without metrics, plus the three fields of ``record_fields``).
Otherwise each worker process serves ``/metrics`` on the first free port from ``metrics_port`` up
(``MAX_PORT_TRIES`` of them, so workers sharing a host each get their own) and writes the port into its
Redis record (``metrics_port``), where ``pagedq status`` shows it.  One registry per process, no
multiprocess directory: a worker is one process (a replica's other stage processes compute, the worker
counts).

The GPU worker's ``EngineService`` calls ``PrometheusEngineMetrics``:

- ``added`` (task thread, the job handed to the engine; its submit time came in ``admitted``);
- ``step`` (stepping thread, after every engine step): engine counters as deltas of the scheduler's
  ``SchedulerStats``, the gauges, and per output first token / finish.  O(outputs of the step) plus
  O(requests not yet scheduled), no Redis, no lock shared with the engine;
- ``released`` (the job leaves the service): its final state as this worker ends it.

Latencies are measured from the job's ``created_at`` (wall clock of the producer that submitted it), so
they include the time on the broker and in preprocess; a job without one is measured from the moment
this worker admitted it.  Every metric is labelled ``model`` and ``worker``.  Names follow vLLM's where
vLLM has one (``vllm:x`` -> ``pagedq_x``); see docs/metrics.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

from pagedq.config.scheduling import DEFAULT_TENANT

log = logging.getLogger(__name__)

MAX_PORT_TRIES = 100

# Seconds-to-minutes LLM work; a job left on the queue for hours lands in +Inf.
QUEUE_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0,
                      600.0, 1200.0, 1800.0, 3600.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
                300.0, 600.0, 1800.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0,
               1200.0, 1800.0, 3600.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4000, 8000, 16000, 32000, 65536, 131072)
TASK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

FINISH_REASONS = ("stop", "length", "abort", "error")
FINAL_STATES = ("completed", "failed", "cancelled", "expired")
# admit verdicts other than "ok" that end the job here (JobStore.settle), and the state each ends in
_SETTLED = {"cancelling": "cancelled", "expired": "expired", "poison": "failed"}


def serve(registry: CollectorRegistry, port: int, address: str = "127.0.0.1") -> int:
    """Serve ``registry`` at ``http://address:<port>/metrics``, on the first free port from ``port`` up.

    Returns the port."""
    last: OSError | None = None
    for candidate in range(port, min(port + MAX_PORT_TRIES, 65536)):
        try:
            start_http_server(candidate, address, registry)
        except OSError as e:  # taken (another worker on this host): the next one
            last = e
            continue
        return candidate
    raise OSError(f"metrics: no free port in {port}..{port + MAX_PORT_TRIES - 1} on {address}: {last}")


def process_registry() -> CollectorRegistry:
    """A registry with the process's own metrics (CPU, memory, file descriptors, Python version)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


class TokenRate:
    """Generated tokens per second over the last ``window_s``, from a running total (O(1) per update)."""

    def __init__(self, window_s: float = 60.0, spacing_s: float = 1.0) -> None:
        self.window_s, self.spacing_s = window_s, spacing_s
        self.samples: deque[tuple[float, int]] = deque()  # (monotonic time, total), >= spacing_s apart
        self._lock = threading.Lock()  # the stepping thread, and a reload on the control thread

    def update(self, t: float, total: int) -> float:
        with self._lock:
            return self._update(t, total)

    def _update(self, t: float, total: int) -> float:
        s = self.samples
        if s and total < s[-1][1]:  # the counters were reset
            s.clear()
        if not s or t - s[-1][0] >= self.spacing_s:
            s.append((t, total))
        while len(s) > 1 and t - s[1][0] >= self.window_s:  # s[0]: the newest sample at least a window old
            s.popleft()
        t0, n0 = s[0]
        return (total - n0) / (t - t0) if t > t0 else 0.0


@dataclass(slots=True)
class _Request:
    submitted_at: float  # the job's created_at (wall clock), else when this worker admitted it
    added_at: float
    scheduled_at: float | None = None
    first_token_at: float | None = None
    tenant: str = DEFAULT_TENANT


class EngineMetrics:
    """What a GPU worker publishes about its engine when metrics are off: the fields of its Redis record that
    ``pagedq status`` shows.  Every hook is a no-op."""

    enabled = False
    port: int | None = None

    def __init__(self) -> None:
        self.rate = TokenRate()

    def record_fields(self, engine) -> dict:
        """Fields for the worker's Redis record: running / waiting requests, tokens/s over the last minute."""
        running = len(engine.scheduler.running)
        fields = {"running": running, "waiting": engine.num_requests - running,
                  "tokens_per_s": round(self.rate.update(time.monotonic(), engine.stats.generated_tokens), 2)}
        if self.port:
            fields["metrics_port"] = self.port
        return fields

    def admitted(self, job_id: str, created_at: str | None, attempts: str | None) -> None:
        """Task thread, the job admitted (before it reaches the engine): its record's created_at, attempts."""

    def added(self, job_id: str, tenant: str = DEFAULT_TENANT) -> None:
        """Task thread: the job (``tenant``'s) was handed to the engine."""

    def step(self, engine, outputs) -> None:
        """Stepping thread, after every step, with the step's RequestOutputs (finish reasons final)."""

    def released(self, handle) -> None:
        """Stepping thread: the job left the service (``Handle``: its output, error, requeue flag)."""

    def settled(self, verdict: str) -> None:
        """Task thread: admit said ``verdict`` (not "ok"): the job ends without running (or had ended)."""

    def ended(self, job_id: str, state: str) -> None:
        """Task thread: the job ended in ``state`` before the engine had it (the engine refused it)."""


class PrometheusEngineMetrics(EngineMetrics):
    enabled = True

    def __init__(self, model: str, worker: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__()
        self.registry = registry if registry is not None else CollectorRegistry()
        r, labels, lv = self.registry, ["model", "worker"], {"model": model, "worker": worker}

        def counter(name, doc, extra=()):
            return Counter(name, doc, [*labels, *extra], registry=r)

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(**lv)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**lv)

        self.prompt_tokens = counter("pagedq_prompt_tokens", "Prompt tokens of requests that got their first "
                                     "token (prefix-cached ones included)").labels(**lv)
        self.generation_tokens = counter("pagedq_generation_tokens", "Tokens the engine "
                                         "generated").labels(**lv)
        self.preemptions = counter("pagedq_num_preemptions", "Sequences preempted (their KV blocks freed, "
                                   "recomputed later)").labels(**lv)
        self.prefix_queries = counter("pagedq_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache").labels(**lv)
        self.prefix_hits = counter("pagedq_prefix_cache_hits", "Prompt tokens served from the prefix "
                                   "cache").labels(**lv)
        self.redeliveries = counter("pagedq_request_redeliveries", "Jobs admitted here that an earlier "
                                    "worker had started and not handed back (it died or lost a "
                                    "process)").labels(**lv)
        success = counter("pagedq_request_success", "Requests that left the engine, by finish reason",
                          ["finished_reason"])
        self.success = {reason: success.labels(**lv, finished_reason=reason) for reason in FINISH_REASONS}
        final = counter("pagedq_request_final_state", "Jobs this worker ended, by the state it ended them in "
                        "(completed: handed to postprocess)", ["state"])
        self.final = {state: final.labels(**lv, state=state) for state in FINAL_STATES}
        self.running = gauge("pagedq_num_requests_running", "Requests in the engine's running batch")
        self.waiting = gauge("pagedq_num_requests_waiting", "Requests in the engine waiting to be scheduled")
        self.kv_usage = gauge("pagedq_kv_cache_usage_ratio", "Share of KV-cache blocks held by requests, 0-1")
        self.kv_free = gauge("pagedq_kv_cache_free_blocks", "KV-cache blocks free (empty or holding only "
                             "evictable prefix-cache entries)")
        self.kv_total = gauge("pagedq_kv_cache_blocks", "KV-cache blocks in the pool")
        self.queue_time = histogram("pagedq_request_queue_time_seconds", "Job submit to first scheduled in "
                                    "the engine", QUEUE_TIME_BUCKETS)
        self.ttft = histogram("pagedq_time_to_first_token_seconds", "Job submit to its first generated token",
                              TTFT_BUCKETS)
        self.tpot = histogram("pagedq_request_time_per_output_token_seconds", "Per completed request: first "
                              "to last token over the tokens after the first", TPOT_BUCKETS)
        self.e2e = histogram("pagedq_e2e_request_latency_seconds", "Per completed request: job submit to its "
                             "last token", E2E_BUCKETS)
        self.prompt_len = histogram("pagedq_request_prompt_tokens", "Per completed request: prompt tokens",
                                    TOKEN_BUCKETS)
        self.generation_len = histogram("pagedq_request_generation_tokens", "Per completed request: "
                                        "generated tokens", TOKEN_BUCKETS)
        # Per tenant (tenants come from the keys file and settings: a bounded set of label values).
        tenant_tokens = counter("pagedq_tenant_tokens", "Tokens served to a tenant: prompt (computed or "
                                "prefix-cached, once its first token came) and generation", ["tenant", "kind"])
        self.tenant_tokens = lambda tenant, kind: tenant_tokens.labels(**lv, tenant=tenant, kind=kind)
        tenant_queue_time = Histogram("pagedq_tenant_queue_time_seconds", "Job submit to first scheduled in "
                                      "the engine, per tenant", [*labels, "tenant"], buckets=QUEUE_TIME_BUCKETS,
                                      registry=r)
        self.tenant_queue_time = lambda tenant: tenant_queue_time.labels(**lv, tenant=tenant)
        tenant_waiting = Gauge("pagedq_tenant_requests_waiting", "Requests in the engine waiting to be "
                               "scheduled, per tenant", [*labels, "tenant"], registry=r)
        self.tenant_waiting = lambda tenant: tenant_waiting.labels(**lv, tenant=tenant)
        self._waiting_tenants: set[str] = set()  # tenants whose waiting gauge was set (reset to 0 when none)
        self._submitted: dict[str, tuple[float | None, float]] = {}  # job id -> (created_at, admitted at)
        self._requests: dict[str, _Request] = {}
        self._arrivals: deque[str] = deque()  # added by task threads, taken by the stepping thread
        self._unscheduled: set[str] = set()  # stepping thread only
        self._stats: tuple[int, ...] | None = None  # last seen (generated, preemptions, queries, hits)
        self._last_step_end = 0.0
        self._lock = threading.Lock()

    # --- task threads -------------------------------------------------------------------------------------
    def admitted(self, job_id: str, created_at: str | None, attempts: str | None) -> None:
        now = time.time()
        if int(attempts or 0) > 1:
            self.redeliveries.inc()
        try:
            submitted = float(created_at) if created_at else None
        except ValueError:
            submitted = None
        with self._lock:
            if len(self._submitted) > 4096:  # admitted, never added (duplicates, shutdown): forget old ones
                self._submitted = {k: v for k, v in self._submitted.items() if now - v[1] < 600}
            self._submitted[job_id] = (submitted, now)

    def added(self, job_id: str, tenant: str = DEFAULT_TENANT) -> None:
        now = time.time()
        with self._lock:
            created_at, _ = self._submitted.pop(job_id, (None, now))
        self._requests[job_id] = _Request(created_at if created_at is not None else now, now, tenant=tenant)
        self._arrivals.append(job_id)

    def settled(self, verdict: str) -> None:
        state = _SETTLED.get(verdict)
        if state is not None:
            self.final[state].inc()

    def ended(self, job_id: str, state: str) -> None:
        self._requests.pop(job_id, None)
        self.final[state].inc()

    # --- the stepping thread ------------------------------------------------------------------------------
    def step(self, engine, outputs) -> None:
        now = time.time()
        st, bm = engine.stats, engine.block_manager
        seen = (st.generated_tokens, st.preemptions, st.prefix_queries, st.prefix_hits)
        last = self._stats
        if last is None or any(a < b for a, b in zip(seen, last, strict=True)):  # none yet, or reset
            last = (0, 0, 0, 0)
        counters = (self.generation_tokens, self.preemptions, self.prefix_queries, self.prefix_hits)
        for counter, a, b in zip(counters, seen, last, strict=True):
            if a > b:
                counter.inc(a - b)
        self._stats = seen
        running = len(engine.scheduler.running)
        self.running.set(running)
        self.waiting.set(engine.num_requests - running)
        self.kv_usage.set(bm.num_used_blocks / bm.num_blocks if bm.num_blocks else 0.0)
        self.kv_free.set(bm.num_free_blocks)
        self.kv_total.set(bm.num_blocks)
        self._count_waiting_tenants(engine)

        while self._arrivals:
            self._unscheduled.add(self._arrivals.popleft())
        if self._unscheduled:  # requests that were waiting: scheduled now if the engine runs them
            requests = engine.requests
            for job_id in list(self._unscheduled):
                rec = self._requests.get(job_id)
                if rec is None:
                    self._unscheduled.discard(job_id)
                elif (seq := requests.get(job_id)) is not None and seq.status.value == "running":
                    self._scheduled(job_id, rec)
        for out in outputs:
            rec = self._requests.get(out.request_id)
            if rec is None:
                continue
            if out.new_token_ids and rec.first_token_at is None:
                if rec.scheduled_at is None:  # scheduled and done with its prompt within this one step
                    self._scheduled(out.request_id, rec)
                rec.first_token_at = now
                self.ttft.observe(max(0.0, now - rec.submitted_at))  # 0 if the producer's clock is ahead
                self.prompt_tokens.inc(out.num_prompt_tokens)
                self.tenant_tokens(rec.tenant, "prompt").inc(out.num_prompt_tokens)
            if out.new_token_ids:
                self.tenant_tokens(rec.tenant, "generation").inc(len(out.new_token_ids))
            if out.finished:
                reason = out.finish_reason or "stop"
                (self.success.get(reason) or self.success["stop"]).inc()
                if reason in ("stop", "length"):
                    n = len(out.output_token_ids)
                    self.e2e.observe(max(0.0, now - rec.submitted_at))
                    self.prompt_len.observe(out.num_prompt_tokens)
                    self.generation_len.observe(n)
                    if n > 1 and rec.first_token_at is not None:
                        self.tpot.observe((now - rec.first_token_at) / (n - 1))
        self._last_step_end = now

    def _scheduled(self, job_id: str, rec: _Request) -> None:
        # The step that scheduled it began when the one before it ended, or when the request arrived.
        rec.scheduled_at = max(self._last_step_end, rec.added_at)
        self.queue_time.observe(max(0.0, rec.scheduled_at - rec.submitted_at))
        self.tenant_queue_time(rec.tenant).observe(max(0.0, rec.scheduled_at - rec.submitted_at))
        self._unscheduled.discard(job_id)

    def _count_waiting_tenants(self, engine) -> None:
        waiting: dict[str, int] = {}
        for seq in engine.requests.values():
            if seq.status.value == "waiting":
                tenant = getattr(seq, "tenant", DEFAULT_TENANT)
                waiting[tenant] = waiting.get(tenant, 0) + 1
        for tenant in self._waiting_tenants | set(waiting):
            self.tenant_waiting(tenant).set(waiting.get(tenant, 0))
        self._waiting_tenants |= set(waiting)

    def released(self, handle) -> None:
        self._requests.pop(handle.job.job_id, None)
        if handle.requeue:  # handed back to the queue: not ended
            return
        out = handle.output
        if handle.error or out is None or out.finish_reason == "error":
            self.final["failed"].inc()
        elif out.finish_reason == "abort":
            self.final["cancelled"].inc()
        else:
            self.final["completed"].inc()


def engine_metrics(settings, model: str, worker: str) -> EngineMetrics:
    """A GPU worker's metrics: served on ``settings.metrics_port`` (or the next free port), or off (0)."""
    if not settings.metrics_port:
        return EngineMetrics()
    registry = process_registry()
    metrics = PrometheusEngineMetrics(model, worker, registry)
    metrics.port = serve(registry, settings.metrics_port, settings.metrics_address)
    log.info("metrics at http://%s:%d/metrics", settings.metrics_address, metrics.port)
    return metrics


class TaskMetrics:
    """A CPU worker's metrics: its Celery tasks, by outcome, and how long each ran (Celery's signals)."""

    def __init__(self, worker: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.worker = worker
        self.port: int | None = None
        self.tasks = Counter("pagedq_tasks", "Celery tasks this worker ran, by task and final Celery state",
                             ["worker", "task", "state"], registry=self.registry)
        self.duration = Histogram("pagedq_task_duration_seconds", "How long each task ran on this worker",
                                  ["worker", "task"], buckets=TASK_BUCKETS, registry=self.registry)
        self._started: dict[str, float] = {}

    def connect(self) -> TaskMetrics:
        from celery import signals

        signals.task_prerun.connect(self._prerun, weak=False)
        signals.task_postrun.connect(self._postrun, weak=False)
        return self

    def _prerun(self, task_id=None, **_) -> None:
        self._started[task_id] = time.monotonic()

    def _postrun(self, task_id=None, task=None, state=None, **_) -> None:
        name = getattr(task, "name", "unknown")
        started = self._started.pop(task_id, None)
        if started is not None:
            self.duration.labels(self.worker, name).observe(time.monotonic() - started)
        self.tasks.labels(self.worker, name, (state or "unknown").lower()).inc()

    def record_fields(self) -> dict:
        return {"metrics_port": self.port} if self.port else {}


def task_metrics(settings, worker: str) -> TaskMetrics:
    """A CPU worker's task metrics, served on ``settings.metrics_port`` (or the next free port); off at 0."""
    metrics = TaskMetrics(worker, process_registry())
    if settings.metrics_port:
        metrics.connect()
        metrics.port = serve(metrics.registry, settings.metrics_port, settings.metrics_address)
        log.info("metrics at http://%s:%d/metrics", settings.metrics_address, metrics.port)
    return metrics
