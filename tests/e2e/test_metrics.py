"""Metrics end to end: real redis-server, real GPU and CPU worker processes, every /metrics scraped over HTTP.

The workers get one PAGEDQ_METRICS_PORT: the first to start takes it, the other the next free port, and
each writes its port into its Redis record (found there by the tests, as ``pagedq status`` finds it).
Prefixes ``pmx:`` / ``pmx.`` on the session's Redis.  About a minute on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from queue_helpers import wait_until

from pagedq.config import Settings
from pagedq.store.registry import live_workers
from pagedq.workers.processes import free_port, spawn

PREFIX = "pmx"
TIMEOUT = 180
DOCKER = Path(__file__).resolve().parents[2] / "docker"
GREEDY = {"temperature": 0, "ignore_eos": True}
# (prompt token ids, completion tokens): known counts on both sides
JOBS = [([101 + i for i in range(n)], k) for n, k in ((5, 2), (9, 3), (13, 4), (17, 5))]
HISTOGRAMS = ("pagedq_request_queue_time_seconds", "pagedq_time_to_first_token_seconds",
              "pagedq_request_time_per_output_token_seconds", "pagedq_e2e_request_latency_seconds",
              "pagedq_request_prompt_tokens", "pagedq_request_generation_tokens")


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:  # the conftest's `stack` and `client` fixtures run on these
    return Settings(broker_url=redis_url, key_prefix=f"{PREFIX}:", queue_prefix=f"{PREFIX}.", max_num_seqs=8,
                    kv_cache_memory="128MiB", progress_interval_s=0.5,
                    metrics_port=free_port())


@pytest.fixture(scope="module")
def env(settings, stack) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    return {**base, "PAGEDQ_BROKER_URL": stack.url, "PAGEDQ_KEY_PREFIX": settings.key_prefix,
            "PAGEDQ_QUEUE_PREFIX": settings.queue_prefix}


def scrape(port: int) -> dict[tuple, float]:
    """(sample name, sorted labels without worker/model) -> value, read over HTTP."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    def labels(s):
        return tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("worker", "model")))
    return {(s.name, labels(s)): s.value for s in samples}


def sample_names(port: int) -> set[str]:
    return {name for name, _ in scrape(port)}


def get(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def ports(client, stack) -> dict[str, int]:
    """role -> metrics port, from the workers' Redis records."""
    def found():
        recs = live_workers(client.r, client.names).values()
        by_role = {rec.get("role"): int(rec["metrics_port"]) for rec in recs if rec.get("metrics_port")}
        return by_role if {"gpu", "cpu"} <= set(by_role) else None
    by_role = wait_until(found, 30, interval=0.2, what="both workers' metrics_port in their records")
    assert by_role["gpu"] != by_role["cpu"]
    return by_role


@pytest.fixture(scope="module")
def ran(client, ports) -> dict:
    """N jobs with known prompt and completion token counts, scraped before and after."""
    before = {role: scrape(port) for role, port in ports.items()}
    jobs = [client.submit(prompt=ids, max_tokens=k, **GREEDY) for ids, k in JOBS]
    results = [client.result(job, timeout=TIMEOUT) for job in jobs]
    for (ids, k), result in zip(JOBS, results, strict=True):
        assert (result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"]) == (len(ids), k)

    def cpu_done():  # a task's counter moves once it has returned: just after the result is written
        now = scrape(ports["cpu"])
        return all(get(now, "pagedq_tasks_total", task=t, state="success") -
                   get(before["cpu"], "pagedq_tasks_total", task=t, state="success") == len(JOBS)
                   for t in ("pagedq.preprocess", "pagedq.postprocess")) and now
    after_cpu = wait_until(cpu_done, 30, interval=0.2, what="the CPU worker's task counters")
    return {"jobs": jobs, "before": before, "after": {"gpu": scrape(ports["gpu"]), "cpu": after_cpu}}


def test_gpu_worker_counters_are_exact_and_each_histogram_has_one_observation_per_job(ran):
    before, after, n = ran["before"]["gpu"], ran["after"]["gpu"], len(JOBS)

    def delta(name, **labels):
        return get(after, name, **labels) - get(before, name, **labels)

    assert delta("pagedq_generation_tokens_total") == sum(k for _, k in JOBS)
    assert delta("pagedq_prompt_tokens_total") == sum(len(ids) for ids, _ in JOBS)
    assert delta("pagedq_request_final_state_total", state="completed") == n
    for state in ("failed", "cancelled", "expired"):
        assert delta("pagedq_request_final_state_total", state=state) == 0, state
    assert delta("pagedq_request_success_total", finished_reason="length") == n
    assert delta("pagedq_request_redeliveries_total") == 0
    for name in HISTOGRAMS:
        assert delta(f"{name}_count") == n, name
    assert delta("pagedq_request_generation_tokens_sum") == sum(k for _, k in JOBS)
    # submit -> first scheduled <= submit -> first token <= submit -> last token, each summed over the jobs
    sums = [delta(f"{name}_sum") for name in HISTOGRAMS[:2] + HISTOGRAMS[3:4]]
    assert 0 < sums[0] <= sums[1] <= sums[2] < n * TIMEOUT
    assert get(after, "pagedq_num_requests_running") == 0 == get(after, "pagedq_num_requests_waiting")
    assert get(after, "pagedq_kv_cache_blocks") > 0
    assert get(after, "pagedq_kv_cache_free_blocks") == get(after, "pagedq_kv_cache_blocks")


def pagedq(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_status_prints_every_live_worker_of_the_registry_and_json_parses(env, client, ran):
    done = pagedq(env, "status")
    assert done.returncode == 0, done.stderr
    screen = done.stdout
    registry = live_workers(client.r, client.names)
    assert {rec["role"] for rec in registry.values()} == {"gpu", "cpu"}
    for hostname, rec in registry.items():
        row = next(line.split() for line in screen.splitlines() if hostname in line.split())
        assert row[0] == rec["role"] and rec["pid"] in row and rec["metrics_port"] in row, (row, rec)
        if rec["role"] == "gpu":
            assert rec["model"] in row and row[row.index(rec["model"]) + 1] == hostname.rpartition("@")[2]
    for section in ("WORKERS (2 live)", "QUEUES", f"{PREFIX}.generate.", "JOBS", "OLDEST QUEUED JOB"):
        assert section in screen, section
    snap = json.loads(pagedq(env, "status", "--json").stdout)
    assert {w["hostname"] for w in snap["workers"]} == set(registry)
    assert snap["jobs_total"]["completed"] >= len(JOBS)
    assert {q["queue"] for q in snap["queues"]} >= {f"{PREFIX}.preprocess", f"{PREFIX}.results"}


@pytest.fixture(scope="module")
def exporter(env, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("exporter") / "exporter.log"
    proc = spawn([sys.executable, "-m", "pagedq.pipeline.cli", "exporter", "--port", str(port),
                  "--jobs-interval", "0.1"], log, env)

    def up():
        assert proc.poll() is None, log.read_text()
        try:
            return scrape(port)
        except (urllib.error.URLError, ConnectionError):
            return None
    wait_until(up, 60, interval=0.2, what="pagedq exporter")
    yield port
    proc.terminate()
    assert proc.wait(30) == 0, log.read_text()


def referenced_metrics() -> set[str]:
    keda = yaml.safe_load((DOCKER / "keda-scaledobject.yaml").read_text())
    dashboard = json.loads((DOCKER / "grafana-dashboard.json").read_text())
    queries = [t["metadata"]["query"] for t in keda["spec"]["triggers"]]
    queries += [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return {m for q in queries for m in re.findall(r"\bpagedq_[a-z0-9_]+", q)}


def test_exporter_and_keda_grafana_files_name_only_metrics_a_live_scrape_has(client, ports, ran, exporter):
    ids, k = JOBS[0]
    cached = client.submit(prompt=ids, max_tokens=k, **GREEDY)  # answered from the result cache
    assert client.status(cached).cached == 1

    def counted():  # the exporter counts job records at most every --jobs-interval (0.1 s)
        now = scrape(exporter)
        return now if get(now, "pagedq_jobs", state="completed") == len(JOBS) + 1 else None
    deployment = wait_until(counted, 10, interval=0.2, what="the exporter to count the cached job")
    model = client.settings.model
    assert get(deployment, "pagedq_broker_up") == 1
    assert get(deployment, "pagedq_result_cache_lookups", result="hit") == 1
    assert get(deployment, "pagedq_result_cache_lookups", result="miss") == len(JOBS)
    assert get(deployment, "pagedq_workers", role="gpu") == 1 == get(deployment, "pagedq_workers", role="cpu")
    assert get(deployment, "pagedq_model_backlog") == 0
    live = {name for name, _ in deployment} | sample_names(ports["gpu"]) | sample_names(ports["cpu"])
    missing = referenced_metrics() - live
    assert not missing, f"KEDA / Grafana name metrics no endpoint emits: {missing} ({model})"


def test_backlog_per_priority_matches_jobs_left_queued_with_no_gpu_worker(client, stack, exporter, env):
    gpu = next(c for c in stack.children if c.role == "gpu")
    stack.stop_worker(gpu)  # the model stays registered: the CPU worker forwards jobs to its queue, none runs
    per_priority = {9: 1, 5: 2, 1: 3}
    jobs = [client.submit(prompt=f"left queued {p}.{i}", max_tokens=2, temperature=1, priority=p)
            for p, n in per_priority.items() for i in range(n)]
    queue = client.names.generate_queue(client.settings.model)

    def forwarded():
        now = scrape(exporter)
        depth = {p: get(now, "pagedq_queue_messages", queue=queue, priority=str(p)) for p in range(10)}
        return now if sum(depth.values()) == len(jobs) else None
    deployment = wait_until(forwarded, 60, interval=0.2, what="the jobs on the generate queue")
    for p in range(10):
        waiting = get(deployment, "pagedq_queue_messages", queue=queue, priority=str(p))
        assert waiting == per_priority.get(p, 0), p
    assert get(deployment, "pagedq_jobs", state="queued") == len(jobs)
    assert get(deployment, "pagedq_model_backlog") == len(jobs)
    assert get(deployment, "pagedq_oldest_queued_job_age_seconds") > 0
    row = next(q for q in json.loads(pagedq(env, "status", "--json").stdout)["queues"] if q["queue"] == queue)
    assert row["by_priority"] == {str(p): per_priority.get(p, 0) for p in range(9, -1, -1)}
    for job in jobs:
        client.cancel(job)
