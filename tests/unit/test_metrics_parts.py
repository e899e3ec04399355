"""Metrics without a model: the worker's engine metrics over the real engine core (scripted executor), the
deployment snapshot / exporter against a real redis-server, `pagedq status` with no broker, and the KEDA /
Grafana files (names checked against what the code registers; tests/e2e/test_metrics.py checks them
against live scrapes)."""

from __future__ import annotations

import json
import os
import re
import socket
import time
import urllib.request
import uuid
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedq.config.names import JobState, Names, broker_priority
from pagedq.config.sampling_params import SamplingParams
from pagedq.pipeline.cli import main
from pagedq.pipeline.exporter import DeploymentCollector, deployment_registry
from pagedq.pipeline.status import render, scan_jobs, snapshot
from pagedq.store.jobs import JobStore
from pagedq.store.registry import ModelInfo, register_model
from pagedq.workers.engine import EngineConfig, LLMEngine, SamplerOutput, StepResult
from pagedq.workers.metrics import PrometheusEngineMetrics, TaskMetrics, TokenRate, serve
from pagedq.workers.processes import free_port

DOCKER = Path(__file__).resolve().parents[2] / "docker"
VOCAB = 1000


# --- the engine's metrics over the real engine core --------------------------------------------------------
class ScriptedExecutor:
    """Next token = (sum of the sequence's tokens) mod VOCAB: no model."""

    max_inflight = 1

    def __init__(self, num_blocks: int = 256) -> None:
        self.num_blocks = num_blocks
        self.done: deque[StepResult] = deque()

    @property
    def num_inflight(self) -> int:
        return len(self.done)

    def submit(self, sched) -> None:
        seqs = [s for s, n in sched.scheduled if s.num_computed_tokens + n == s.num_tokens]
        tokens = [sum(s.token_ids) % VOCAB for s in seqs]
        self.done.append(StepResult(sched, seqs, SamplerOutput(tokens, [None] * len(seqs))))

    def collect(self) -> StepResult:
        return self.done.popleft()

    def forget(self, request_id: str) -> None:
        pass

    def check(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def scripted_engine(num_blocks: int = 256) -> LLMEngine:
    config = EngineConfig(model_name="scripted", fingerprint="f", max_model_len=4096, vocab_size=VOCAB,
                          eos_token_ids=frozenset({VOCAB + 1}), block_size=4, max_num_batched_tokens=64)
    return LLMEngine(config, ScriptedExecutor(num_blocks))


def handle(out, requeue: bool = False, error: str | None = None):
    job = SimpleNamespace(job_id=out.request_id)
    return SimpleNamespace(job=job, requeue=requeue, error=error, output=out)


def value(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, {"model": "scripted", "worker": "w", **labels}) or 0.0


def run(engine: LLMEngine, metrics: PrometheusEngineMetrics, requests, submitted_ago: float = 2.0,
        attempts: dict | None = None) -> dict:
    """Admit, add and step ``requests`` (id, prompt, max_tokens) to the end as the EngineService does."""
    for rid, prompt, max_tokens in requests:
        metrics.admitted(rid, str(time.time() - submitted_ago), str((attempts or {}).get(rid, 1)))
        metrics.added(rid)
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    finished = {}
    while len(finished) < len(requests):
        outputs = engine.step()
        metrics.step(engine, outputs)
        for out in outputs:
            if out.finished:
                finished[out.request_id] = out
                metrics.released(handle(out))
    return finished


def test_engine_metrics_count_tokens_requests_and_observe_every_histogram_once_per_request():
    registry = CollectorRegistry()
    metrics = PrometheusEngineMetrics("scripted", "w", registry)
    engine = scripted_engine()
    # one prompt longer than the 64-token step budget: prefilled in chunks over three steps
    requests = [("a", list(range(1, 11)), 3), ("b", list(range(1, 151)), 5), ("c", list(range(7, 27)), 8)]
    run(engine, metrics, requests, attempts={"c": 2})
    n = len(requests)
    assert value(registry, "pagedq_generation_tokens_total") == sum(k for *_, k in requests)
    assert value(registry, "pagedq_prompt_tokens_total") == sum(len(p) for _, p, _ in requests)
    assert value(registry, "pagedq_request_success_total", finished_reason="length") == n
    assert value(registry, "pagedq_request_final_state_total", state="completed") == n
    assert value(registry, "pagedq_request_redeliveries_total") == 1
    assert value(registry, "pagedq_prefix_cache_queries_total") == engine.stats.prefix_queries
    for name in ("pagedq_request_queue_time_seconds", "pagedq_time_to_first_token_seconds",
                 "pagedq_request_time_per_output_token_seconds", "pagedq_e2e_request_latency_seconds",
                 "pagedq_request_prompt_tokens", "pagedq_request_generation_tokens"):
        assert value(registry, f"{name}_count") == n, name
    assert value(registry, "pagedq_request_generation_tokens_sum") == 16
    # measured from the submit time (2 s ago), in order: queued <= first token <= last token
    queue = value(registry, "pagedq_request_queue_time_seconds_sum")
    ttft = value(registry, "pagedq_time_to_first_token_seconds_sum")
    e2e = value(registry, "pagedq_e2e_request_latency_seconds_sum")
    assert 2 * n <= queue <= ttft <= e2e < 2 * n + 5
    assert value(registry, "pagedq_num_requests_running") == 0
    assert value(registry, "pagedq_num_requests_waiting") == 0
    assert value(registry, "pagedq_kv_cache_usage_ratio") == 0
    assert value(registry, "pagedq_kv_cache_free_blocks") == value(registry, "pagedq_kv_cache_blocks") == 256


def test_gauges_follow_the_engine_and_preemptions_are_counted():
    registry = CollectorRegistry()
    metrics = PrometheusEngineMetrics("scripted", "w", registry)
    engine = scripted_engine(num_blocks=12)  # 48 slots: three 12-token prompts growing to 24 cannot all fit
    for i in range(3):
        metrics.admitted(f"r{i}", None, "1")
        metrics.added(f"r{i}")
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        engine.add_request(f"r{i}", [i + 1] * 12, params)
    outputs = engine.step()
    metrics.step(engine, outputs)
    assert value(registry, "pagedq_num_requests_running") == len(engine.scheduler.running) == 3
    used = engine.block_manager.num_used_blocks
    assert value(registry, "pagedq_kv_cache_usage_ratio") == pytest.approx(used / 12)
    assert value(registry, "pagedq_kv_cache_free_blocks") == 12 - used
    finished = 0
    while finished < 3:
        outputs = engine.step()
        metrics.step(engine, outputs)
        finished += sum(o.finished for o in outputs)
    assert engine.stats.preemptions > 0
    assert value(registry, "pagedq_num_preemptions_total") == engine.stats.preemptions
    assert value(registry, "pagedq_request_queue_time_seconds_count") == 3  # first scheduling only


def test_final_states_abort_requeue_expired_and_refused():
    registry = CollectorRegistry()
    metrics = PrometheusEngineMetrics("scripted", "w", registry)
    engine = scripted_engine()
    for rid in ("cancel-me", "hand-back"):
        metrics.admitted(rid, None, "1")
        metrics.added(rid)
        engine.add_request(rid, [1, 2, 3], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    metrics.step(engine, engine.step())
    engine.abort_request("cancel-me")
    engine.abort_request("hand-back")
    outputs = engine.step()
    metrics.step(engine, outputs)
    for out in outputs:
        if out.finished:
            metrics.released(handle(out, requeue=out.request_id == "hand-back"))
    metrics.settled("expired")
    metrics.settled("cancelling")
    metrics.settled("completed")  # already ended before: not counted again
    metrics.admitted("refused", None, "1")
    metrics.added("refused")
    metrics.ended("refused", "failed")
    assert value(registry, "pagedq_request_success_total", finished_reason="abort") == 2
    assert value(registry, "pagedq_request_final_state_total", state="cancelled") == 2
    assert value(registry, "pagedq_request_final_state_total", state="expired") == 1
    assert value(registry, "pagedq_request_final_state_total", state="failed") == 1
    assert value(registry, "pagedq_request_final_state_total", state="completed") == 0
    assert value(registry, "pagedq_e2e_request_latency_seconds_count") == 0  # completed requests only
    assert value(registry, "pagedq_time_to_first_token_seconds_count") == 2


def test_token_rate_is_over_the_last_minute():
    rate = TokenRate(window_s=60)
    assert rate.update(0.0, 0) == 0
    for t in range(1, 121):
        r = rate.update(float(t), t * 10)  # 10 tokens/s
    assert r == pytest.approx(10)
    assert rate.update(121.0, 1210) == pytest.approx(10, rel=0.05)
    idle = rate.update(200.0, 1210)  # nothing for 79 s
    assert idle == 0
    assert rate.update(201.0, 5) == 0  # counters reset: starts over


def test_metrics_endpoint_takes_the_next_free_port_and_serves_over_http():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        registry = CollectorRegistry()
        tasks = TaskMetrics("cpu-w", registry)
        tasks._prerun(task_id="t1")
        tasks._postrun(task_id="t1", task=SimpleNamespace(name="pagedq.preprocess"), state="SUCCESS")
        got = serve(registry, port)
        assert got != port
        text = urllib.request.urlopen(f"http://127.0.0.1:{got}/metrics", timeout=10).read().decode()
    finally:
        taken.close()
    assert 'pagedq_tasks_total{state="success",task="pagedq.preprocess",worker="cpu-w"} 1.0' in text
    assert 'pagedq_task_duration_seconds_count{task="pagedq.preprocess",worker="cpu-w"} 1.0' in text


# --- the deployment view, from Redis ---------------------------------------------------------------------
@pytest.fixture
def names() -> Names:
    tag = uuid.uuid4().hex[:8]
    return Names(key_prefix=f"m{tag}:", queue_prefix=f"m{tag}.")


MODEL = "org/Model-1"


def deployment(redis, names) -> dict:
    """A model registered, six jobs in several states, messages on the broker lists, two live workers."""
    register_model(redis, names, ModelInfo(MODEL, "fp", 2048, 1000, names.generate_queue(MODEL)))
    store = JobStore(redis, names, result_ttl_s=60)
    now = time.time()
    jobs = {f"j{i}": {"state": "queued", "model": MODEL, "priority": p, "created_at": now - 30 + i,
                      "attempts": 0} for i, p in enumerate([9, 5, 5, 0, 2, 7])}
    jobs["j4"]["cache_key"] = "k4"
    jobs["j5"] |= {"cache_key": "k5"}
    store.create(list(jobs.items()), max_queued=100)
    store.admit("j0", worker="gpu0")  # in_progress
    store.finish("j4", JobState.FAILED)
    redis.hset(names.job("j5"), "cached", 1)
    store.finish("j5", JobState.COMPLETED, result={})
    waiting = {9: 1, 5: 2, 0: 3}  # pagedq priority -> messages on the generate queue
    queue = names.generate_queue(MODEL)
    for priority, n in waiting.items():
        redis.rpush(names.broker_list(queue, broker_priority(priority)), *[f"msg{i}" for i in range(n)])
    redis.rpush(names.broker_list(names.preprocess_queue, broker_priority(4)), "msg")
    redis.hset(names.worker("gpu0.1@hostA"), mapping={"role": "gpu", "model": MODEL, "pid": 11, "ready": 1,
                                                     "running": 3, "waiting": 1, "used_blocks": 25,
                                                     "num_blocks": 100, "tokens_per_s": 42.5,
                                                     "metrics_port": 9400, "updated_at": now})
    redis.hset(names.worker("cpu0.2@hostB"), mapping={"role": "cpu", "pid": 12, "ready": 1,
                                                     "updated_at": now})
    for host in ("gpu0.1@hostA", "cpu0.2@hostB"):
        redis.expire(names.worker(host), 60)
        redis.zadd(names.workers_index, {host: time.time() + 60})  # as their heartbeats list them
    return {"queue": queue, "waiting": waiting}


def test_snapshot_counts_queues_per_priority_jobs_by_state_and_the_oldest_queued_job(redis, names):
    d = deployment(redis, names)
    snap = snapshot(redis, names, "redis://x")
    queues = {q["queue"]: q for q in snap.queues}
    gen = queues[d["queue"]]
    assert gen["model"] == MODEL and gen["total"] == 6
    assert gen["by_priority"] == {str(p): d["waiting"].get(p, 0) for p in range(9, -1, -1)}
    assert queues[names.preprocess_queue]["by_priority"]["4"] == 1
    assert queues[names.results_queue]["total"] == 0
    assert snap.jobs[MODEL] == {"queued": 3, "in_progress": 1, "completed": 1, "failed": 1, "cancelling": 0,
                                "cancelled": 0, "expired": 0}
    assert snap.models[MODEL]["backlog"] == 4 and snap.models[MODEL]["registered"]
    assert snap.result_cache[MODEL] == {"hit": 1, "miss": 1}
    assert snap.oldest_queued["job_id"] == "j1" and snap.oldest_queued["priority"] == 5
    assert 25 < snap.oldest_queued["age_s"] < 40
    workers = {w["hostname"]: w for w in snap.workers}
    assert workers["gpu0.1@hostA"]["kv_usage"] == 0.25 and workers["gpu0.1@hostA"]["host"] == "hostA"
    screen = render(snap)
    assert "gpu0.1@hostA" in screen and "25.0%" in screen and "42.5" in screen and "j1" in screen
    json.dumps(snap.as_dict())
    assert scan_jobs(redis, names, limit=2).truncated


def test_exporter_gauges_match_the_snapshot(redis, names):
    d = deployment(redis, names)
    text = generate_latest(deployment_registry(redis, names)).decode()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def get(name, **labels):
        return samples[(name, tuple(sorted(labels.items())))]

    for p in range(10):
        waiting = get("pagedq_queue_messages", queue=d["queue"], model=MODEL, priority=str(p))
        assert waiting == d["waiting"].get(p, 0)
    assert get("pagedq_jobs", model=MODEL, state="queued") == 3
    assert get("pagedq_model_backlog", model=MODEL) == 4
    assert get("pagedq_workers", role="gpu", model=MODEL) == 1
    assert get("pagedq_workers", role="cpu", model="") == 1
    assert get("pagedq_result_cache_lookups", model=MODEL, result="hit") == 1
    assert 25 < get("pagedq_oldest_queued_job_age_seconds", model=MODEL) < 40
    assert get("pagedq_broker_up") == 1


def test_exporter_says_broker_down_instead_of_failing_the_scrape(names):
    import redis as redis_py

    down = redis_py.Redis(port=free_port(), socket_connect_timeout=1)
    families = list(DeploymentCollector(down, names).collect())
    assert [(f.name, f.samples[0].value) for f in families] == [("pagedq_broker_up", 0)]


@pytest.mark.parametrize("argv", [["status"], ["status", "--json"], ["exporter", "--port", "1"]])
def test_no_broker_reachable_is_one_error_line_and_a_nonzero_exit(argv, monkeypatch, capsys):
    cli_env(monkeypatch, PAGEDQ_BROKER_URL=f"redis://:secret@127.0.0.1:{free_port()}/0",
            PAGEDQ_BROKER_TIMEOUT_S="2")
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: broker: cannot reach redis://:***@127.0.0.1:") and "secret" not in err


def cli_env(monkeypatch, **variables) -> None:
    for var in [v for v in os.environ if v.startswith("PAGEDQ_")]:
        monkeypatch.delenv(var)
    for var, val in variables.items():
        monkeypatch.setenv(var, val)


def test_status_watch_redraws_until_ctrl_c_json_once_per_line(redis, redis_url, names, monkeypatch, capsys):
    deployment(redis, names)
    cli_env(monkeypatch, PAGEDQ_BROKER_URL=redis_url, PAGEDQ_KEY_PREFIX=names.key_prefix,
            PAGEDQ_QUEUE_PREFIX=names.queue_prefix)
    naps = []

    def sleep(seconds):
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", sleep)
    assert main(["status", "--watch", "0.5", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert naps == [0.5, 0.5] and len(lines) == 2
    assert all(json.loads(line)["jobs"][MODEL]["queued"] == 3 for line in lines)
    assert main(["status"]) == 0
    assert "gpu0.1@hostA" in capsys.readouterr().out
    assert main(["status", "some-job", "--watch"]) == 2
    assert capsys.readouterr().err.startswith("error: watch: only without a job id")


# --- the KEDA and Grafana files --------------------------------------------------------------------------
def referenced_metrics() -> dict[str, set[str]]:
    """Metric names in the PromQL of the KEDA triggers and the Grafana panels and variables."""
    keda = yaml.safe_load((DOCKER / "keda-scaledobject.yaml").read_text())
    dashboard = json.loads((DOCKER / "grafana-dashboard.json").read_text())
    keda_queries = [t["metadata"]["query"] for t in keda["spec"]["triggers"]]
    grafana_queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    grafana_queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    pattern = re.compile(r"\bpagedq_[a-z0-9_]+")
    return {"keda": {m for q in keda_queries for m in pattern.findall(q)},
            "grafana": {m for q in grafana_queries for m in pattern.findall(q)}}


def exposed_names(registry: CollectorRegistry) -> set[str]:
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}
    return {f.name + s for f in registry.collect() for s in suffixes.get(f.type, [""])}


def test_keda_and_grafana_files_parse_and_name_only_metrics_the_code_exports(redis, names):
    keda = yaml.safe_load((DOCKER / "keda-scaledobject.yaml").read_text())
    assert keda["kind"] == "ScaledObject" and all(t["type"] == "prometheus" for t in keda["spec"]["triggers"])
    assert "sum(pagedq_queue_messages{" in keda["spec"]["triggers"][0]["metadata"]["query"]
    deployment(redis, names)
    known = exposed_names(deployment_registry(redis, names))
    known |= exposed_names(PrometheusEngineMetrics("m", "w", CollectorRegistry()).registry)
    known |= exposed_names(TaskMetrics("w", CollectorRegistry()).registry)
    refs = referenced_metrics()
    assert refs["keda"] and refs["grafana"]
    assert refs["keda"] <= known, refs["keda"] - known
    assert refs["grafana"] <= known, refs["grafana"] - known


def test_compose_prometheus_scrapes_every_worker_and_the_exporter():
    compose = yaml.safe_load((DOCKER / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["prometheus"]["ports"] == ["127.0.0.1:9090:9090"]
    config = yaml.safe_load(compose["configs"]["prometheus-config"]["content"])
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    port = int(services["worker"]["environment"]["PAGEDQ_METRICS_PORT"])
    sd = jobs["pagedq-workers"]["dns_sd_configs"][0]
    assert set(sd["names"]) == {"worker", "cpu-worker"} and sd["port"] == port
    exporter = services["exporter"]["command"]
    assert jobs["pagedq-deployment"]["static_configs"][0]["targets"] == [f"exporter:{exporter[-1]}"]
