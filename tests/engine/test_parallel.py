"""One model replica over several processes: pipeline stages and tensor parallelism (CPU, gloo).

Parity checks use the real model (all 30 layers) on 20 ShareGPT prompts x 48
greedy tokens against the one-process engine.  Each replica is spawned once
per module and reused by the checks that fit it.  The queue checks run real
Celery workers on the session's redis-server; stage processes there are
started by the test itself and rendezvous over TCP.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
from engine_fixtures import NUM_PROMPTS, fresh_engine, greedy, hf_model, settings, sharegpt_prompts
from engine_fixtures import engine as cached_engine

from pagedq.config import Settings
from pagedq.config.messages import RequestError
from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.llm import LLM
from pagedq.workers.processes import free_port

NEW_TOKENS = 48
TOP = 5


# One torch thread per process everywhere: on a 2-core machine shared with other work, a step whose
# OpenMP threads wait for a descheduled sibling can take 10x longer.
THREADS = 1


@functools.lru_cache(maxsize=1)
def reference() -> list:
    """The one-process engine's greedy tokens, with top-5 logprobs for the tensor-parallel check."""
    engine = fresh_engine(num_threads=THREADS)
    return engine.generate(sharegpt_prompts(), greedy(NEW_TOKENS, logprobs=TOP))


def replica(**overrides) -> LLM:
    return LLM(settings(num_threads=THREADS, **overrides))


@pytest.fixture(scope="module")
def two_stages():
    engine = replica(pipeline_stages=2)
    yield engine
    engine.shutdown()


def assert_token_identical(outputs) -> None:
    expected = [o.output_token_ids for o in reference()]
    got = [o.output_token_ids for o in outputs]
    assert len(got) == len(expected) == NUM_PROMPTS
    differ = [i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b]
    assert not differ, f"prompts {differ} differ from one process, e.g. {got[differ[0]]} vs {expected[differ[0]]}"


def top_ids(out, position: int) -> set[int]:
    return {token for token, _ in out.logprobs[position]["top"]}


def assert_close_to_reference(outputs, min_identical: float = 0.9) -> None:
    """vLLM's check against HF: mostly identical; at a first divergence each token is in the other's top-5."""
    ref = reference()
    identical = 0
    for i, (a, b) in enumerate(zip(ref, outputs, strict=True)):
        ta, tb = a.output_token_ids, b.output_token_ids
        if ta == tb:
            identical += 1
            continue
        j = next(k for k, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y)
        assert ta[j] in top_ids(b, j) and tb[j] in top_ids(a, j), (
            f"prompt {i} token {j}: {ta[j]} vs {tb[j]}, not in each other's top-{TOP}")
    print(f"identical on {identical}/{len(ref)} prompts")
    assert identical >= min_identical * len(ref), f"only {identical}/{len(ref)} prompts identical"


def test_two_stages_token_identical(two_stages):
    reference()
    outs = two_stages.generate(sharegpt_prompts(), greedy(NEW_TOKENS, logprobs=TOP))
    assert_token_identical(outs)
    for got, want in zip(outs, reference(), strict=True):  # logprobs come back from the last stage
        assert [[t for t, _ in lp["top"]] for lp in got.logprobs] == [[t for t, _ in lp["top"]] for lp in want.logprobs]
        assert [lp["token"][1] for lp in got.logprobs] == pytest.approx([lp["token"][1] for lp in want.logprobs],
                                                                        abs=1e-3)


def test_three_stages_token_identical():
    reference()
    engine = replica(pipeline_stages=3)
    try:
        assert_token_identical(engine.generate(sharegpt_prompts(), greedy(NEW_TOKENS)))
        assert engine.executor.max_inflight == 3
    finally:
        engine.shutdown()


def test_micro_batches_in_flight_never_share_a_sequence(two_stages):
    ex, seen_overlap, max_inflight = two_stages.executor, [], [0]
    submit = ex.submit

    def checked_submit(sched):
        ids = {id(s) for s, _ in sched.scheduled}
        inflight = {id(s) for batch in ex._inflight for s, _ in batch[0].scheduled}
        seen_overlap.append(ids & inflight)
        submit(sched)
        max_inflight[0] = max(max_inflight[0], ex.num_inflight)

    ex.submit = checked_submit
    try:
        two_stages.generate(sharegpt_prompts()[:12], greedy(16))
    finally:
        del ex.submit
    assert not any(seen_overlap)
    assert max_inflight[0] == 2, "two stages should keep two micro-batches in flight"


def test_seeded_sampling_and_penalties_match_one_process(two_stages):
    """The last stage samples from its own copies of the sequences: same generator, same history."""
    prompts = sharegpt_prompts()[:6]
    params = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=i, repetition_penalty=1.2,
                             frequency_penalty=0.3, ignore_eos=True) for i in range(len(prompts))]
    expected = [o.output_token_ids for o in fresh_engine(num_threads=THREADS).generate(prompts, params)]
    assert [o.output_token_ids for o in two_stages.generate(prompts, params)] == expected


def test_structured_outputs_refused_with_pipeline_stages(two_stages):
    """The last stage samples from its own copies of the sequences, which carry no grammar: refused, clearly."""
    params = SamplingParams(max_tokens=8, temperature=0, constraint=["json_object", ""])
    with pytest.raises(RequestError, match="pipeline_stages") as e:
        two_stages.add_request("constrained", [1, 2, 3], params)
    assert e.value.param == "response_format" and not two_stages.has_unfinished()


def test_prompt_logprobs_with_pipeline_stages(two_stages):
    """The last stage scores prompt tokens from the plan the driver sends with each micro-batch."""
    prompts = sharegpt_prompts()[:3]
    outs = two_stages.generate(prompts, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.inference_mode():
            ref = hf_model()(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
        want = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        got = torch.tensor([e["token"][1] for e in out.prompt_logprobs[1:]])
        assert out.prompt_logprobs[0] is None and (got - want).abs().max().item() < 1e-4


def test_abort_while_in_flight_frees_blocks_after_it_returns(two_stages):
    prompts = sharegpt_prompts()[:4]
    for i, p in enumerate(prompts):
        two_stages.add_request(f"abort-{i}", p, greedy(NEW_TOKENS))
    busy = []
    for _ in range(4):  # the prompts run as one micro-batch; then their decodes split into two
        two_stages.step()
        busy = [s for s in two_stages.requests.values() if id(s) in two_stages.scheduler.busy]
        if busy:
            break
    assert busy, "a micro-batch should still be in flight"
    two_stages.abort_request(busy[0].request_id)
    finished = {}
    while two_stages.has_unfinished():
        for out in two_stages.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[busy[0].request_id].finish_reason == "abort"
    expected = reference()
    for i in range(4):
        if f"abort-{i}" != busy[0].request_id:
            assert finished[f"abort-{i}"].output_token_ids == expected[i].output_token_ids
    assert two_stages.block_manager.num_used_blocks == 0


def test_two_stages_identical_under_preemption():
    reference()
    engine = replica(pipeline_stages=2, num_kv_blocks=48, enable_prefix_caching=False)
    try:
        outs = engine.generate(sharegpt_prompts(), greedy(NEW_TOKENS))
        assert engine.stats.preemptions > 0, "the KV budget was meant to force preemption"
        assert_token_identical(outs)
    finally:
        engine.shutdown()


# --- tensor parallelism -------------------------------------------------------------------------
def test_tensor_parallel_2_close_to_one_process():
    reference()
    engine = replica(tensor_parallel=2)
    try:
        assert engine.executor.runner.model.num_kv_heads == 2  # 3 KV heads: 2 here, 1 on the other shard
        assert_close_to_reference(engine.generate(sharegpt_prompts(), greedy(NEW_TOKENS, logprobs=TOP)))
    finally:
        engine.shutdown()


def test_tensor_parallel_2_with_2_stages():
    reference()
    engine = replica(tensor_parallel=2, pipeline_stages=2)
    try:
        assert_close_to_reference(engine.generate(sharegpt_prompts(), greedy(NEW_TOKENS, logprobs=TOP)))
    finally:
        engine.shutdown()


# --- failure --------------------------------------------------------------------------------------
def test_dead_stage_raises_replica_lost():
    from pagedq.workers.parallel.distributed import ReplicaLostError

    engine = replica(pipeline_stages=2)
    try:
        engine.generate(sharegpt_prompts()[:2], greedy(4))
        engine.executor.children[0].kill()
        engine.executor.children[0].wait()
        with pytest.raises(ReplicaLostError):
            engine.generate(sharegpt_prompts()[:2], greedy(4))
        assert not engine.healthy()
    finally:
        engine.shutdown()


# --- through the queue ----------------------------------------------------------------------------
TIMEOUT = 300
QUEUE_TOKENS = NEW_TOKENS  # so the one-process reference above serves these checks too


@pytest.fixture(scope="module")
def queue_settings(redis_url) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="pqp:", queue_prefix="pqp.", result_cache=False,
                    kv_cache_memory="256MiB",
                    max_num_seqs=64, max_num_batched_tokens=512, progress_interval_s=0.5, num_threads=THREADS)


def submit_all(client, n: int) -> list[str]:
    return [client.submit(prompt=p, max_tokens=QUEUE_TOKENS, temperature=0, ignore_eos=True)
            for p in sharegpt_prompts()[:n]]


def expected_text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def stage_command(rank: int, stages: int, master: str) -> list[str]:
    return [sys.executable, "-m", "pagedq.pipeline.cli", "stage", "--rank", str(rank), "--stages", str(stages),
            "--master", master]


def test_separately_started_stages_serve_queue_jobs(queue_settings, tmp_path):
    """Stage 1 is its own OS process (started here, not by stage 0) and meets the worker over TCP."""
    from pagedq.pipeline import Client
    from pagedq.pipeline.local.stack import Stack, settings_env

    n = 8
    expected = [o.output_token_ids for o in reference()[:n]]
    master = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "stage1.log"
    with open(log_path, "wb") as log:
        stage = subprocess.Popen(stage_command(1, 2, master), stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **settings_env(queue_settings)}, start_new_session=True)
    try:
        with Stack(queue_settings, gpu_workers=0, cpu_workers=1, log_dir=tmp_path) as stack, \
                Client(queue_settings, stack.url) as client:
            gpu = stack.add_worker("gpu", {"PAGEDQ_PIPELINE_STAGES": "2", "PAGEDQ_STAGE_MASTER": master})
            stack.wait_ready(TIMEOUT, [gpu])
            assert stage.poll() is None, log_path.read_text()
            jobs = submit_all(client, n)
            tokenizer = cached_engine().tokenizer
            for job, tokens in zip(jobs, expected, strict=True):
                result = client.result(job, timeout=TIMEOUT)
                assert result["usage"]["completion_tokens"] == QUEUE_TOKENS
                assert result["choices"][0]["text"] == expected_text(tokenizer, tokens)
        # The worker stopped its replica on the way out; the separately started stage exits with it.
        assert stage.wait(timeout=60) == 0, log_path.read_text()
        assert "stage 1 shard 0, layers (17, 30)" in log_path.read_text()
    finally:
        if stage.poll() is None:
            stage.kill()
            stage.wait()
