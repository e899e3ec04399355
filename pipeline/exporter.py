"""Deployment-level Prometheus metrics, exported once for the whole deployment (not per worker).

Everything comes from Redis (``pipeline/status.py`` reads it; nothing here talks to a worker):
backlog per queue and priority from the broker's lists, jobs by state, live workers by role and
model, the oldest queued job's age, result-cache hits and misses.  Queue lengths and backlog counters
are read at every scrape; what needs a SCAN of the keyspace (job records, workers, models) at most
every ``jobs_interval_s`` (its cost grows with the job records kept, see status.py).

Three ways to serve it:

- ``pagedq exporter`` (``run_exporter``): its own HTTP server, ``/metrics``;
- ``metrics_app(r, names)``: an ASGI app to mount in another server, e.g. the gateway's
  ``app.mount("/metrics", metrics_app(gateway.r, gateway.names))``;
- ``deployment_registry(r, names)``: a ``CollectorRegistry`` for anything else
  (``prometheus_client.generate_latest(registry)``).

Run one per deployment: every copy reports the same numbers.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from prometheus_client import CollectorRegistry, make_asgi_app, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pagedq.config.names import Names
from pagedq.pipeline.status import STATES, JobScan, registered_models, scan_jobs, snapshot, worker_rows

log = logging.getLogger(__name__)

JOBS_INTERVAL_S = 10.0


class DeploymentCollector:
    """A prometheus_client collector: one snapshot of the deployment per scrape."""

    def __init__(self, r: redis.Redis, names: Names, jobs_interval_s: float = JOBS_INTERVAL_S,
                 job_limit: int | None = None) -> None:
        self.r, self.names = r, names
        self.jobs_interval_s, self.job_limit = jobs_interval_s, job_limit
        self._scanned: tuple[JobScan, dict, list] | None = None  # (jobs, registered models, workers)
        self._lock = threading.Lock()

    def describe(self):
        return []  # registering must not read Redis

    def _scans(self) -> tuple[JobScan, dict, list]:
        with self._lock:  # one scan at a time, however many scrapes arrive
            if self._scanned is None or time.time() - self._scanned[0].at >= self.jobs_interval_s:
                jobs = scan_jobs(self.r, self.names, self.job_limit)
                self._scanned = (jobs, registered_models(self.r, self.names),
                                 worker_rows(self.r, self.names, time.time()))
            return self._scanned

    def collect(self):
        up = GaugeMetricFamily("pagedq_broker_up", "1 if the exporter could read the broker at this scrape")
        try:
            jobs, registered, workers = self._scans()
            snap = snapshot(self.r, self.names, jobs=jobs, registered=registered, workers=workers)
        except (redis.RedisError, OSError) as e:
            log.warning("deployment metrics: cannot read the broker: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up

        messages = GaugeMetricFamily("pagedq_queue_messages", "Messages waiting on a broker queue, by pagedq "
                                     "priority (0-9, 9 served first); model: a generate queue's model",
                                     labels=["queue", "model", "priority"])
        for q in snap.queues:
            for priority, n in q["by_priority"].items():
                messages.add_metric([q["queue"], q["model"], priority], n)
        yield messages

        backlog = GaugeMetricFamily("pagedq_model_backlog", "Jobs of a model accepted and not yet ended "
                                    "(queued or running; bounded by max_queued_jobs)", labels=["model"])
        for model, info in snap.models.items():
            backlog.add_metric([model], info["backlog"])
        yield backlog

        by_state = GaugeMetricFamily("pagedq_jobs", "Job records in Redis by state (ended jobs are kept "
                                     "result_ttl_s)", labels=["model", "state"])
        for model, counts in snap.jobs.items():
            for state in STATES:
                by_state.add_metric([model, state], counts[state])
        yield by_state

        oldest = GaugeMetricFamily("pagedq_oldest_queued_job_age_seconds", "Age of the model's oldest job in "
                                   "state queued (0: none)", labels=["model"])
        now = time.time()
        for model in snap.jobs:
            created = jobs.oldest_queued_by_model.get(model)
            oldest.add_metric([model], max(0.0, now - created) if created is not None else 0.0)
        yield oldest

        tenant_jobs = GaugeMetricFamily("pagedq_tenant_jobs", "A tenant's jobs waiting (queued) or running "
                                        "(in_progress, cancelling), all models", labels=["tenant", "state"])
        tenant_oldest = GaugeMetricFamily("pagedq_tenant_oldest_waiting_seconds", "Age of the tenant's oldest "
                                          "queued job (0: none)", labels=["tenant"])
        for tenant, row in snap.tenants.items():
            tenant_jobs.add_metric([tenant, "waiting"], row["waiting"])
            tenant_jobs.add_metric([tenant, "running"], row["running"])
            tenant_oldest.add_metric([tenant], row["oldest_waiting_s"] or 0.0)
        yield tenant_jobs
        yield tenant_oldest

        decisions = CounterMetricFamily("pagedq_placement_decisions", "Placed claims by what decided them "
                                        "(by_cache, by_session, by_load, stolen) and claims that took nothing "
                                        "(skipped), with nudges sent (PAGEDQ_PLACEMENT)", labels=["model", "decision"])
        hit_ratio = GaugeMetricFamily("pagedq_fleet_prefix_hit_ratio", "Prompt tokens the model's live GPU workers "
                                      "served from their prefix caches, of all they were given", labels=["model"])
        for model, row in snap.placement.items():
            for decision, n in row.items():
                if decision != "hit_ratio":
                    decisions.add_metric([model, decision], n)
            if row.get("hit_ratio") is not None:
                hit_ratio.add_metric([model], row["hit_ratio"])
        yield decisions
        yield hit_ratio

        fenced = CounterMetricFamily("pagedq_fenced", "Finishes and requeues refused because the worker making "
                                     "them had lost the job to another (its lease restored away)", labels=["op"])
        for op in ("finish", "requeue"):
            fenced.add_metric([op], snap.fenced.get(op, 0))
        yield fenced

        workers = GaugeMetricFamily("pagedq_workers", "Live workers (records not expired) by role and model",
                                    labels=["role", "model"])
        live: dict[tuple[str, str], int] = {}
        for w in snap.workers:
            key = (w["role"], w["model"] or "")
            live[key] = live.get(key, 0) + 1
        for model in snap.models:  # a served model with no live GPU worker reads 0, not absent
            live.setdefault(("gpu", model), 0)
        for (role, model), n in sorted(live.items()):
            workers.add_metric([role, model], n)
        yield workers

        cache = GaugeMetricFamily("pagedq_result_cache_lookups", "Job records whose request was looked up in "
                                  "the result cache, by result (hit: answered from it)",
                                  labels=["model", "result"])
        for model, counts in snap.result_cache.items():
            for result in ("hit", "miss"):
                cache.add_metric([model, result], counts[result])
        yield cache

        scanned = GaugeMetricFamily("pagedq_job_records_scanned", "Job records the last count read")
        scanned.add_metric([], jobs.scanned)
        yield scanned
        took = GaugeMetricFamily("pagedq_job_scan_duration_seconds",
                                 "How long the last count of job records took")
        took.add_metric([], jobs.seconds)
        yield took


def deployment_registry(r: redis.Redis, names: Names,
                        jobs_interval_s: float = JOBS_INTERVAL_S) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(DeploymentCollector(r, names, jobs_interval_s))
    return registry


def metrics_app(r: redis.Redis, names: Names, jobs_interval_s: float = JOBS_INTERVAL_S):
    """An ASGI app serving the deployment metrics (mount it at ``/metrics``)."""
    return make_asgi_app(deployment_registry(r, names, jobs_interval_s))


def run_exporter(r: redis.Redis, names: Names, port: int, address: str = "127.0.0.1",
                 jobs_interval_s: float = JOBS_INTERVAL_S, ready: threading.Event | None = None) -> None:
    """Serve ``/metrics`` on ``address:port`` until interrupted (KeyboardInterrupt)."""
    server, _thread = start_http_server(port, address, deployment_registry(r, names, jobs_interval_s))
    log.info("deployment metrics at http://%s:%d/metrics", address, port)
    if ready is not None:
        ready.set()
    try:
        threading.Event().wait()
    finally:
        server.shutdown()
