"""Tenants from the first write, against a real redis-server and no model: the record, the messages, the
weights, each tenant's share of a model's backlog bound, and what status, the exporter and the engine's
metrics show per tenant."""

from __future__ import annotations

import json
import math
import random
import time
import uuid

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedq.config import Settings
from pagedq.config.messages import PreprocessJob, RequestError, parse_message
from pagedq.config.sampling_params import SamplingParams
from pagedq.config.scheduling import SchedulingMeta
from pagedq.pipeline.client import Client
from pagedq.pipeline.exporter import deployment_registry
from pagedq.pipeline.status import render, snapshot
from pagedq.workers.metrics import PrometheusEngineMetrics


@pytest.fixture
def settings() -> Settings:
    tag = uuid.uuid4().hex[:8]
    return Settings(key_prefix=f"t{tag}:", queue_prefix=f"t{tag}.", result_cache=False,
                    max_queued_jobs=random.randint(6, 14), tenant_backlog_share=random.choice([0.25, 0.4, 0.5]),
                    tenant_weights={"team-a": round(random.uniform(1.5, 4), 2)})


def _submit(client: Client, tenant: str) -> str:
    return client.submit(prompt=uuid.uuid4().hex, max_tokens=random.randint(1, 8), tenant=tenant)


def test_a_tenants_flood_hits_queue_full_at_its_share_while_another_tenant_still_submits(settings, redis_url):
    share = math.ceil(settings.tenant_backlog_share * settings.max_queued_jobs)
    with Client(settings, redis_url, tenant="team-a") as client:
        flood = []
        with pytest.raises(RequestError) as refused:
            for _ in range(settings.max_queued_jobs + 1):
                flood.append(_submit(client, "team-a"))
        assert len(flood) == share, f"team-a got {len(flood)} jobs in, its share is {share}"
        assert refused.value.code == "queue_full" and "'team-a'" in str(refused.value) and "share" in str(refused.value)
        assert client.store.backlog(settings.model) == share

        other = _submit(client, "team-b")  # the shared bound is not full: another tenant is not refused
        assert client.status(other).tenant == "team-b" and client.status(other).state == "queued"
        # The counters go back down as jobs end (cancelled here; completed and failed go the same way).
        for job_id in flood[:2]:
            assert client.cancel(job_id).state == "cancelled"
        assert client.store.backlog(settings.model, "team-a") == share - 2
        assert client.store.backlog(settings.model) == share - 1
        flood.append(_submit(client, "team-a"))
        for job_id in flood[2:]:
            client.cancel(job_id)
        assert client.store.backlog(settings.model, "team-a") == 0

        with pytest.raises(RequestError) as whole:  # a batch over the share is refused whole
            client.submit_batch([_line(i) for i in range(share)], tenant="team-b")
        assert whole.value.code == "queue_full" and "'team-b'" in str(whole.value)
        assert client.store.backlog(settings.model, "team-b") == 1, "a refused batch writes nothing"
        client.cancel(other)
        assert client.store.backlog(settings.model, "team-b") == client.store.backlog(settings.model) == 0


def _line(i: int) -> dict:
    return {"custom_id": f"l{i}", "method": "POST", "url": "/v1/completions",
            "body": {"prompt": uuid.uuid4().hex, "max_tokens": random.randint(1, 8)}}


def test_the_tenant_is_written_with_the_record_and_carried_in_the_message(settings, redis_url, redis):
    settings = settings.model_copy(update={"tenant_backlog_share": 1.0})
    with Client(settings, redis_url, tenant="team-a") as client:
        timeout = random.uniform(30, 90)
        job_id = client.submit(prompt="hello", max_tokens=2, priority=7, timeout_s=timeout)
        rec = client.store.get(job_id)
        assert rec["tenant"] == "team-a" and client.status(job_id).tenant == "team-a"
        msg = parse_message(PreprocessJob, json.loads(redis.get(client.names.job_message(job_id))))
        assert msg.meta.tenant == "team-a" and msg.meta.priority == 7
        assert msg.meta.arrival == pytest.approx(float(rec["created_at"]))
        assert msg.meta.deadline == pytest.approx(float(rec["expires_at"]))
        assert msg.meta.deadline - msg.meta.arrival == pytest.approx(timeout)
        assert "tenant=team-a" in msg.describe()
        assert float(redis.hget(client.names.tenant_weights, "team-a")) == settings.tenant_weights["team-a"]

        batch = client.submit_batch([_line(0), {**_line(1), "body": {**_line(1)["body"], "priority": 8}}])
        jobs = redis.lrange(client.names.batch_jobs(batch), 0, -1)
        assert [client.status(j).tenant for j in jobs] == ["team-a", "team-a"]  # a batch inherits it
        assert [client.status(j).priority for j in jobs] == [client.batch_priority, 8]
        assert not redis.hexists(client.names.tenant_weights, "team-b"), "no weight known: none written"
    with pytest.raises(RequestError):
        Client(settings, redis_url, tenant="no spaces")


def test_batch_lines_without_a_priority_run_at_the_batch_priority(redis_url):
    tag = uuid.uuid4().hex[:8]
    low = random.randint(0, 4)
    settings = Settings(key_prefix=f"t{tag}:", queue_prefix=f"t{tag}.", result_cache=False, batch_priority=low)
    with Client(settings, redis_url) as client:
        batch = client.submit_batch([_line(0), {**_line(1), "body": {**_line(1)["body"], "priority": 9}}])
        jobs = client.r.lrange(client.names.batch_jobs(batch), 0, -1)
        assert [client.status(j).priority for j in jobs] == [low, 9]
        assert client.status(jobs[0]).tenant == "default"
        assert client.status(client.submit(prompt="x", max_tokens=1)).priority == settings.default_priority


def test_status_and_exporter_show_the_backlog_per_tenant(settings, redis_url, redis):
    settings = settings.model_copy(update={"tenant_backlog_share": 1.0, "max_queued_jobs": 100})
    counts = {"team-a": random.randint(2, 6), "team-b": random.randint(1, 4)}
    with Client(settings, redis_url) as client:
        jobs = {t: [_submit(client, t) for _ in range(n)] for t, n in counts.items()}
        client.store.admit(jobs["team-a"][0], worker="gpu0")  # one running
        snap = snapshot(redis, client.names)
        assert snap.tenants["team-a"]["waiting"] == counts["team-a"] - 1
        assert snap.tenants["team-a"]["running"] == 1
        assert snap.tenants["team-a"]["weight"] == settings.tenant_weights["team-a"]
        assert (snap.tenants["team-b"]["waiting"], snap.tenants["team-b"]["running"]) == (counts["team-b"], 0)
        assert snap.tenants["team-b"]["weight"] == 1.0 and snap.tenants["team-b"]["oldest_waiting_s"] >= 0
        assert "TENANTS" in render(snap) and "team-b" in render(snap)
        text = generate_latest(deployment_registry(redis, client.names)).decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        assert samples[("pagedq_tenant_jobs", (("state", "waiting"), ("tenant", "team-b")))] == counts["team-b"]
        assert samples[("pagedq_tenant_jobs", (("state", "running"), ("tenant", "team-a")))] == 1


def test_engine_metrics_count_tokens_and_queue_time_per_tenant():
    from test_metrics_parts import handle, scripted_engine, value

    registry = CollectorRegistry()
    metrics = PrometheusEngineMetrics("scripted", "w", registry)
    engine = scripted_engine()
    requests = [(f"r{i}", random.choice(["team-a", "team-b"]), [random.randrange(1, 999) for _ in range(
        random.randint(3, 30))], random.randint(1, 6)) for i in range(8)]
    for rid, tenant, prompt, max_tokens in requests:
        metrics.admitted(rid, str(time.time() - 1), "1")
        metrics.added(rid, tenant)
        engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           meta=SchedulingMeta(tenant))
    done = 0
    while done < len(requests):
        outputs = engine.step()
        metrics.step(engine, outputs)
        for out in outputs:
            if out.finished:
                done += 1
                metrics.released(handle(out))
    for tenant in ("team-a", "team-b"):
        mine = [r for r in requests if r[1] == tenant]
        assert value(registry, "pagedq_tenant_tokens_total", tenant=tenant, kind="generation") == \
            sum(r[3] for r in mine)
        assert value(registry, "pagedq_tenant_tokens_total", tenant=tenant, kind="prompt") == \
            sum(len(r[2]) for r in mine)
        assert value(registry, "pagedq_tenant_queue_time_seconds_count", tenant=tenant) == len(mine)
        assert value(registry, "pagedq_tenant_requests_waiting", tenant=tenant) == 0


def test_the_gateway_writes_the_keys_tenant_with_the_job_and_its_weight(settings, redis_url, redis, tmp_path):
    from pagedq.pipeline.gateway.keys import KeyRing, hash_key
    from pagedq.pipeline.gateway.shapes import job_object
    from pagedq.pipeline.gateway.state import Gateway

    weight = round(random.uniform(0.5, 5), 2)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hash_key("sk-x"), "tenant": "team@x", "weight": weight},
                                         {"sha256": hash_key("sk-y"), "tenant": "team-y"}]}))
    gw = Gateway(settings, redis_url, keyring=KeyRing.load(keys))
    try:
        tenant = gw.tenant_for("Bearer sk-x")
        assert tenant.weight == weight and gw.tenant_for("Bearer sk-y").weight == 1.0
        job_id = gw.submit(tenant, {"prompt": uuid.uuid4().hex, "max_tokens": 2})
        status, rec = gw.owned_job(job_id, tenant)  # owned from the first write: no update after the send
        assert rec["tenant"] == "team@x" and job_object(status)["tenant"] == "team@x"
        msg = parse_message(PreprocessJob, json.loads(redis.get(gw.names.job_message(job_id))))
        assert msg.meta.tenant == "team@x"
        assert float(redis.hget(gw.names.tenant_weights, "team@x")) == weight
        assert gw.client.store.backlog(settings.model, "team@x") == 1
    finally:
        gw.close()
