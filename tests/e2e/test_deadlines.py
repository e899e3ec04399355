"""Start deadlines end to end: ``pagedq cpu-worker`` with its model registered but no GPU worker running (so no
worker ever takes a job off the generate queue) ends each waiting job past its ``timeout_s`` ``expired`` within
2 s of its deadline (issue 19, item 4), with fair dispatch off and on."""

from __future__ import annotations

import json
import random
import time
import uuid

from queue_helpers import wait_until

from pagedq.config import Settings
from pagedq.config.names import JobState, Names
from pagedq.pipeline.client import Client
from pagedq.pipeline.local.stack import Stack
from pagedq.store.dispatch import FairDispatch
from pagedq.store.registry import ModelInfo, register_model


def test_waiting_jobs_expire_within_two_seconds_with_no_gpu_worker(redis_url, tmp_path):
    tag = uuid.uuid4().hex[:8]
    settings = Settings(broker_url=redis_url, key_prefix=f"dl{tag}:", queue_prefix=f"dl{tag}.", result_cache=False)
    names = Names.from_settings(settings)
    with Stack(settings, gpu_workers=0, cpu_workers=1, log_dir=tmp_path) as stack, \
            Client(settings, stack.url) as client:
        register_model(client.r, names, ModelInfo(name=settings.model, fingerprint="none", max_model_len=2048,
                                                  vocab_size=49152, queue=names.generate_queue(settings.model)))
        kept = client.submit(prompt="no deadline: waits for a worker", max_tokens=2)
        wait_until(lambda: client.store.get(kept).get("prompt_tokens"), timeout=120, what="tokenizer loaded")
        due = [client.submit(prompt=f"deadline {i} {random.random()}", max_tokens=2,
                             timeout_s=round(random.uniform(1.0, 2.0), 3)) for i in range(4)]
        wait_until(lambda: all(client.status(j).state == JobState.EXPIRED for j in due), timeout=30,
                   what="every job past its deadline expired")
        records = [client.store.get(j) for j in due]
        # Tokenized before its deadline: it was waiting for a GPU worker, not for preprocess, when it expired.
        assert all(int(rec.get("prompt_tokens", 0)) > 0 for rec in records)
        lateness = [float(rec["expired_at"]) - float(rec["expires_at"]) for rec in records]
        print(f"expired after the deadline by: {', '.join(f'{x:.3f}' for x in lateness)} s")
        assert max(lateness) <= 2.0
        assert all(json.loads(rec["error"])["code"] == "expired" for rec in records)
        time.sleep(0.5)
        assert client.status(kept).state == JobState.QUEUED
        dispatch = FairDispatch(client.r, names)
        assert dispatch.waiting(settings.model) == 1 and dispatch.is_waiting(kept)
        client.cancel(kept)
