"""The deployment as Redis knows it: workers, queues per priority, jobs by state.  Reads Redis only.

``pagedq status`` (no job id) prints it as one screen (``--watch`` redraws it, ``--json`` is for
scripts); the deployment exporter (``pipeline/exporter.py``) turns the same snapshot into Prometheus
gauges.  It works from any host that can reach the broker: nothing here talks to a worker.

Where each part comes from:

- workers: their records (``names.worker``, 15 s TTL, refreshed after every engine step): role, model,
  pid, running / waiting requests, KV blocks, tokens/s over the last minute, metrics port;
- queues: kombu keeps one Redis list per priority step of a queue (``names.broker_lists``); its
  priority 0 is served first, so list ``n`` holds pagedq priority ``9 - n``.  Listed: preprocess,
  results, and the generate queue of every registered model (or model with job records);
- models: the backlog counter (``names.backlog``: jobs accepted and not ended);
- tenants: from the same scan, each tenant's jobs waiting (queued) and running (in_progress or
  cancelling), with its weight (``names.tenant_weights``, missing = 1);
- jobs: one SCAN over the job records (``names.job``), state / model / priority / created_at /
  result-cache fields of each.  Records of ended jobs live ``result_ttl_s`` (24 h by default), so
  the counts of ended states cover that window; the cost grows with the number of records (up to
  ``job_limit`` are read; beyond it the counts say so).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import redis

from pagedq.config import Settings
from pagedq.config.names import PRIORITY_STEPS, JobState, Names, broker_priority
from pagedq.config.scheduling import DEFAULT_TENANT
from pagedq.store.connection import BrokerUnavailable, broker_url, mask_url, redis_client
from pagedq.store.registry import live_workers

STATES = [s.value for s in JobState]
PRIORITIES = list(range(9, -1, -1))  # most urgent first
JOB_FIELDS = ("state", "model", "priority", "created_at", "cached", "cache_key", "tenant")
RUNNING_STATES = (JobState.IN_PROGRESS.value, JobState.CANCELLING.value)
SCAN_BATCH = 1000
STATUS_JOB_LIMIT = 100_000


@dataclass
class JobScan:
    """Job records by model and state, read with one SCAN (see the module's docstring)."""

    at: float = 0.0
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # model ("" if none) -> state -> records
    cache: dict[str, dict[str, int]] = field(default_factory=dict)  # model -> {"hit": n, "miss": n}
    oldest_queued: dict | None = None  # {"job_id", "model", "priority", "created_at"}
    oldest_queued_by_model: dict[str, float] = field(default_factory=dict)  # model -> created_at
    tenants: dict[str, dict] = field(default_factory=dict)  # tenant -> {"waiting", "running", "oldest_waiting"}
    scanned: int = 0
    truncated: bool = False
    seconds: float = 0.0


def scan_jobs(r: redis.Redis, names: Names, limit: int | None = None) -> JobScan:
    start = time.monotonic()
    scan = JobScan(at=time.time())
    counts: dict[str, Counter] = {}
    prefix = names.job("")
    batch: list[str] = []

    def flush() -> None:
        pipe = r.pipeline(transaction=False)
        for key in batch:
            pipe.hmget(key, *JOB_FIELDS)
        for key, values in zip(batch, pipe.execute(raise_on_error=False), strict=True):
            if not isinstance(values, list) or values[0] is None:
                continue  # gone meanwhile, or not a job hash
            state, model, priority, created_at, cached, cache_key, tenant = values
            model = model or ""
            counts.setdefault(model, Counter())[state] += 1
            if state == JobState.QUEUED or state in RUNNING_STATES:
                _count_tenant(scan, tenant or DEFAULT_TENANT, state, created_at)
            scan.scanned += 1
            if cache_key or cached == "1":
                c = scan.cache.setdefault(model, {"hit": 0, "miss": 0})
                c["hit" if cached == "1" else "miss"] += 1
            if state == JobState.QUEUED and created_at:
                t = float(created_at)
                if t < scan.oldest_queued_by_model.get(model, float("inf")):
                    scan.oldest_queued_by_model[model] = t
                if scan.oldest_queued is None or t < scan.oldest_queued["created_at"]:
                    scan.oldest_queued = {"job_id": key[len(prefix):], "model": model,
                                          "priority": int(priority) if priority else None, "created_at": t}
        batch.clear()

    for key in r.scan_iter(match=names.job("*"), count=SCAN_BATCH):
        if limit is not None and scan.scanned + len(batch) >= limit:
            scan.truncated = True
            break
        batch.append(key)
        if len(batch) >= SCAN_BATCH:
            flush()
    if batch:
        flush()
    scan.counts = {model: {s: c.get(s, 0) for s in STATES} for model, c in counts.items()}
    scan.seconds = time.monotonic() - start
    return scan


def _count_tenant(scan: JobScan, tenant: str, state: str, created_at: str | None) -> None:
    row = scan.tenants.setdefault(tenant, {"waiting": 0, "running": 0, "oldest_waiting": None})
    if state in RUNNING_STATES:
        row["running"] += 1
        return
    row["waiting"] += 1
    if created_at and (row["oldest_waiting"] is None or float(created_at) < row["oldest_waiting"]):
        row["oldest_waiting"] = float(created_at)


def registered_models(r: redis.Redis, names: Names) -> dict[str, str]:
    """model name -> its generate queue, for every model a GPU worker has registered."""
    keys = list(r.scan_iter(match=names.model_pattern, count=SCAN_BATCH))
    pipe = r.pipeline(transaction=False)
    for key in keys:
        pipe.hmget(key, "name", "queue")
    return {name: queue for name, queue in pipe.execute() if name and queue}  # an alias has no queue


def queue_depths(r: redis.Redis, names: Names, queues: list[str]) -> dict[str, dict[int, int]]:
    """queue -> {pagedq priority: messages waiting}, from the queue's ten broker lists."""
    pipe = r.pipeline(transaction=False)
    for queue in queues:
        for step in PRIORITY_STEPS:
            pipe.llen(names.broker_list(queue, step))
    lengths = iter(pipe.execute())
    # kombu's priority step n holds pagedq priority 9 - n (broker_priority is its own inverse)
    return {queue: {broker_priority(step): next(lengths) for step in PRIORITY_STEPS} for queue in queues}


@dataclass
class Snapshot:
    at: float
    broker: str
    key_prefix: str
    workers: list[dict]
    queues: list[dict]  # {"queue", "model", "total", "by_priority": {"9": n, ..., "0": n}}
    models: dict[str, dict]  # model -> {"queue", "backlog", "registered"}
    jobs: dict[str, dict[str, int]]  # model -> state -> job records
    jobs_total: dict[str, int]  # state -> job records, all models
    result_cache: dict[str, dict[str, int]]
    oldest_queued: dict | None  # {"job_id", "model", "priority", "created_at", "age_s"}
    jobs_scanned: int
    jobs_truncated: bool
    # tenant -> {"waiting", "running", "weight", "oldest_waiting_s"}: the backlog per tenant
    tenants: dict[str, dict] = field(default_factory=dict)
    # model -> {"by_cache", "by_session", "by_load", "stolen", "skipped", "nudged", "hit_ratio"}: cache-aware
    # placement's decisions, and the share of its live GPU workers' prompt tokens served from their caches
    placement: dict[str, dict] = field(default_factory=dict)
    fenced: dict[str, int] = field(default_factory=dict)  # op -> writes refused to a worker that lost its job

    def as_dict(self) -> dict:
        return asdict(self)


def _int(value, default=None):
    try:
        return int(float(value))
    except (TypeError, ValueError):
        return default


def worker_rows(r: redis.Redis, names: Names, now: float) -> list[dict]:
    rows = []
    records = live_workers(r, names)
    for hostname, rec in sorted(records.items(), key=lambda kv: (kv[1].get("role", ""), kv[0])):
        used, total = _int(rec.get("used_blocks")), _int(rec.get("num_blocks"))
        rows.append({
            "hostname": hostname, "role": rec.get("role", "?"), "model": rec.get("model", ""),
            "host": hostname.rpartition("@")[2], "pid": _int(rec.get("pid")),
            "ready": rec.get("ready") == "1",
            "running": _int(rec.get("running")), "waiting": _int(rec.get("waiting")),
            "inflight": _int(rec.get("inflight")),
            "kv_used_blocks": used, "kv_blocks": total,
            "kv_usage": round(used / total, 4) if used is not None and total else None,
            "tokens_per_s": float(rec["tokens_per_s"]) if rec.get("tokens_per_s") else None,
            "metrics_port": _int(rec.get("metrics_port")),
            "seen_s_ago": round(now - float(rec["updated_at"]), 1) if rec.get("updated_at") else None,
            "prefix_hits": _int(rec.get("prefix_hits")), "prompt_tokens_computed": _int(rec.get("prompt_tokens_computed")),
        })
    return rows


def snapshot(r: redis.Redis, names: Names, broker: str = "", job_limit: int | None = STATUS_JOB_LIMIT,
             jobs: JobScan | None = None, registered: dict[str, str] | None = None,
             workers: list[dict] | None = None) -> Snapshot:
    """Everything ``pagedq status`` shows.

    ``jobs``, ``registered`` (``registered_models``), ``workers`` (``worker_rows``): parts read before, to
    reuse (each is a SCAN over the whole keyspace; the exporter refreshes them every few seconds, and reads
    only the queue lengths and backlog counters at every scrape).
    """
    now = time.time()
    jobs = jobs if jobs is not None else scan_jobs(r, names, job_limit)
    registered = registered if registered is not None else registered_models(r, names)
    models = sorted(set(registered) | {m for m in jobs.counts if m})
    queue_of = {m: registered.get(m) or names.generate_queue(m) for m in models}
    queues = [names.preprocess_queue, *sorted(set(queue_of.values())), names.results_queue]
    depths = queue_depths(r, names, queues)
    pipe = r.pipeline(transaction=False)
    for m in models:
        pipe.get(names.backlog(m))
    for m in models:
        pipe.hgetall(names.placement_stats(m))
    pipe.hgetall(names.tenant_weights)
    pipe.hgetall(names.fenced)
    *counts, weights, fenced = pipe.execute()
    backlogs, decisions = counts[:len(models)], counts[len(models):]
    workers = workers if workers is not None else worker_rows(r, names, now)
    model_of_queue = {q: m for m, q in queue_of.items()}
    queue_rows = [{"queue": q, "model": model_of_queue.get(q, ""), "total": sum(depths[q].values()),
                   "by_priority": {str(p): depths[q][p] for p in PRIORITIES}} for q in queues]
    totals = Counter()
    for by_state in jobs.counts.values():
        totals.update(by_state)
    oldest = None
    if jobs.oldest_queued is not None:
        oldest = {**jobs.oldest_queued, "age_s": round(max(0.0, now - jobs.oldest_queued["created_at"]), 1)}
    return Snapshot(
        at=now, broker=broker, key_prefix=names.key_prefix,
        workers=workers, queues=queue_rows,
        models={m: {"queue": queue_of[m], "backlog": _int(b, 0), "registered": m in registered}
                for m, b in zip(models, backlogs, strict=True)},
        jobs=jobs.counts, jobs_total={s: totals.get(s, 0) for s in STATES}, result_cache=jobs.cache,
        oldest_queued=oldest, jobs_scanned=jobs.scanned, jobs_truncated=jobs.truncated,
        tenants=tenant_rows(jobs, weights, now),
        placement={m: {**{k: int(v) for k, v in d.items()}, "hit_ratio": fleet_hit_ratio(workers, m)}
                   for m, d in zip(models, decisions, strict=True) if d},
        fenced={op: int(n) for op, n in sorted(fenced.items())})


def fleet_hit_ratio(workers: list[dict], model: str) -> float | None:
    """Prompt tokens the model's live GPU workers served from their prefix caches, of all they were given."""
    hits = sum(w["prefix_hits"] or 0 for w in workers if w["model"] == model)
    computed = sum(w["prompt_tokens_computed"] or 0 for w in workers if w["model"] == model)
    return round(hits / (hits + computed), 4) if hits + computed else None


def tenant_rows(jobs: JobScan, weights: dict[str, str], now: float) -> dict[str, dict]:
    """Per tenant with jobs waiting or running: those counts, its weight, how long its oldest has waited."""
    return {t: {"waiting": row["waiting"], "running": row["running"], "weight": float(weights.get(t) or 1.0),
                "oldest_waiting_s": None if row["oldest_waiting"] is None
                else round(max(0.0, now - row["oldest_waiting"]), 1)}
            for t, row in sorted(jobs.tenants.items())}


def connect(settings: Settings) -> tuple[redis.Redis, str]:
    """A client for the broker (``PAGEDQ_BROKER_URL``, else the embedded one), checked with a PING.

    Raises BrokerNotFoundError (no URL known) or BrokerUnavailable (no answer within ``broker_timeout_s``).
    """
    url = broker_url(settings)
    r = redis_client(url, settings.broker_timeout_s, settings)
    try:
        r.ping()
    except (redis.RedisError, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise BrokerUnavailable(f"cannot reach {mask_url(url)}: {reason}") from None
    return r, url


# --- the screen ------------------------------------------------------------------------------------------
def _table(headers: list[str], rows: list[list]) -> list[str]:
    cells = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [max([len(h), *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return lines


def _age(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def render(snap: Snapshot) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(snap.at))
    out = [f"pagedq  broker {snap.broker or '?'}  prefix {snap.key_prefix}  {when}", ""]
    out.append(f"WORKERS ({len(snap.workers)} live)")
    rows = [[w["role"], w["hostname"], w["model"] or None, w["host"], w["pid"], "yes" if w["ready"] else "no",
             w["running"], w["waiting"],
             f"{w['kv_usage'] * 100:.1f}%" if w["kv_usage"] is not None else None,
             f"{w['tokens_per_s']:.1f}" if w["tokens_per_s"] is not None else None,
             w["metrics_port"], _age(w["seen_s_ago"])] for w in snap.workers]
    headers = ["ROLE", "NAME", "MODEL", "HOST", "PID", "READY", "RUNNING", "WAITING", "KV USE", "TOK/S (1m)",
               "METRICS PORT", "SEEN"]
    out += _table(headers, rows) if rows else ["  (none)"]
    out += ["", "QUEUES (messages waiting on the broker, by priority; 9 is served first)"]
    out += _table(["QUEUE", "TOTAL", *(f"p{p}" for p in PRIORITIES)],
                  [[q["queue"], q["total"], *q["by_priority"].values()] for q in snap.queues])
    out += ["", "JOBS (job records by state; ended ones are kept for the result TTL)"]
    states = STATES
    job_rows = [[m or "(no model)", *(snap.jobs[m][s] for s in states),
                 snap.models.get(m, {}).get("backlog"),
                 "{hit}/{miss}".format(**snap.result_cache[m]) if m in snap.result_cache else None]
                for m in sorted(snap.jobs)]
    job_rows.append(["all", *(snap.jobs_total[s] for s in states), None, None])
    out += _table(["MODEL", *(s.upper() for s in states), "BACKLOG", "CACHE HIT/MISS"], job_rows)
    if snap.jobs_truncated:
        out.append(f"  (counted the first {snap.jobs_scanned} job records only)")
    out += ["", "TENANTS (jobs waiting and running; within a priority, service is shared by weight)"]
    tenant_rows_ = [[t, row["waiting"], row["running"], f"{row['weight']:g}", _age(row["oldest_waiting_s"])]
                    for t, row in snap.tenants.items()]
    out += _table(["TENANT", "WAITING", "RUNNING", "WEIGHT", "OLDEST WAITING"], tenant_rows_) \
        if tenant_rows_ else ["  (none)"]
    if snap.placement:
        out += ["", "PLACEMENT (cache-aware claims per model; hit ratio: prompt tokens served from the workers' "
                    "caches)"]
        out += _table(["MODEL", "BY CACHE", "BY SESSION", "BY LOAD", "STOLEN", "SKIPPED", "NUDGED", "FLEET HIT RATIO"],
                      [[m, *(d.get(k, 0) for k in ("by_cache", "by_session", "by_load", "stolen", "skipped", "nudged")),
                        f"{d['hit_ratio']:.1%}" if d.get("hit_ratio") is not None else None]
                       for m, d in sorted(snap.placement.items())])
    if snap.fenced:
        out += ["", "FENCED (writes refused to a worker whose job another worker had taken)  " +
                "  ".join(f"{op} {n}" for op, n in snap.fenced.items())]
    out.append("")
    o = snap.oldest_queued
    out.append("OLDEST QUEUED JOB  " + (f"{o['job_id']}  model {o['model'] or '-'}  priority {o['priority']}"
                                        f"  queued for {_age(o['age_s'])}" if o else "(none)"))
    return "\n".join(out)
