"""Families other than Llama through the whole queue: ``Client`` -> CPU worker -> GPU worker -> result, greedy
tokens equal to transformers' own ``generate``.

One module-scoped stack (real redis-server, one CPU worker, one GPU worker process per model) serving a small
random model of each family, built here by transformers (``tests/family_models.py``): Qwen3, Qwen3-MoE and
Mixtral (experts), Gemma 2 and Gemma 3 (sliding layers keep their own KV blocks beside the global ones) and Phi-3;
and a folder of an architecture pagedq does not serve, refused by the worker and by a request in one line.  Prompts are 16
random token-id lists of 10-300 tokens; the answers' per-token strings (``logprobs``) are compared with the
strings of transformers' greedy tokens.  Prefixes ``fam:`` / ``fam.``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from family_models import (
    MIN_IDENTICAL,
    NEW_TOKENS,
    NUM_PROMPTS,
    build_hf,
    hf_greedy,
    prompts,
    save,
    tokenizer,
)

from pagedq.config import Settings
from pagedq.config.messages import RequestError
from pagedq.pipeline.local.stack import Stack

TIMEOUT = 300
MODELS = ("qwen3", "qwen3-moe", "mixtral", "gemma2", "gemma3", "phi3")


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="fam:", queue_prefix="fam.", kv_cache_memory="64MiB",
                    max_num_batched_tokens=256, num_threads=1)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[str, object]]:
    """Family name -> (its folder, the transformers model saved there)."""
    built = {}
    for name in MODELS:
        folder = tmp_path_factory.mktemp(name)
        hf = build_hf(name)
        save(hf, folder)
        built[name] = (str(folder), hf)
    return built


@pytest.fixture(scope="module")
def stack(settings, models, tmp_path_factory):
    with Stack(settings, gpu_workers=0, cpu_workers=1, log_dir=tmp_path_factory.mktemp("logs")) as s:
        s.wait_ready(TIMEOUT, [s.add_worker("gpu", model=folder) for folder, _ in models.values()])
        yield s


@pytest.mark.parametrize("name", MODELS)
def test_greedy_through_the_queue_matches_transformers(client, models, name):
    folder, hf = models[name]
    batch = prompts()
    jobs = [client.submit(prompt=p, model=folder, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                          logprobs=0) for p in batch]
    differ = []
    for i, (prompt, job) in enumerate(zip(batch, jobs, strict=True)):
        choice = client.result(job, timeout=TIMEOUT)["choices"][0]
        ours = choice["logprobs"]["tokens"]
        want = [tokenizer().decode([t]) for t in hf_greedy(hf, prompt)]
        assert len(ours) == NEW_TOKENS and choice["finish_reason"] == "length"
        if ours != want:
            differ.append(i)
    assert NUM_PROMPTS - len(differ) >= MIN_IDENTICAL, f"{name}: prompts {differ} differ from transformers"


def test_an_unknown_architecture_is_refused_in_one_line_by_a_request_and_by_the_worker(settings, stack, client,
                                                                                      tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 50257}))

    def keys() -> set[bytes]:
        return {*client.r.scan_iter(f"{settings.key_prefix}*"), *client.r.scan_iter(f"{settings.queue_prefix}*")}

    before = keys()
    with pytest.raises(RequestError) as err:
        client.submit(prompt="Hello", model=str(folder), max_tokens=4)
    message = str(err.value)
    assert "GPT2LMHeadModel" in message and "Qwen3MoeForCausalLM" in message and "\n" not in message
    assert keys() == before  # nothing enqueued, no job record

    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}, "PAGEDQ_BROKER_URL": stack.url,
           "PAGEDQ_KEY_PREFIX": settings.key_prefix, "PAGEDQ_QUEUE_PREFIX": settings.queue_prefix}
    done = subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "worker", "--model", str(folder)], env=env,
                          capture_output=True, text=True, timeout=TIMEOUT)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, (done.returncode, lines)
    assert "GPT2LMHeadModel" in lines[0] and "Gemma3ForCausalLM" in lines[0]
