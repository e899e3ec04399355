"""Evaluators: lm-evaluation-harness, unmodified, scores a multiple-choice task through ``pagedq serve``.

One stack for the module (a real redis-server, GPU and CPU worker processes, the gateway).  lm-eval's
``local-completions`` model sends each (context, continuation) as token ids with ``echo: true``,
``logprobs: 1``, ``max_tokens: 1`` and sums the continuation's prompt logprobs; every item's sum, as
``--log_samples`` records it, must equal Hugging Face transformers' own (same model, fp32) within 1e-4.  The
task is a local YAML over a local JSON file (no hub download), and a ``generate_until`` task runs beside it.
The same scores come back through ``echo`` with ``max_tokens: 0``, vLLM's ``prompt_logprobs``, and a batch.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
import time

import httpx
import pytest
import torch

from pagedq.config import Settings
from pagedq.workers.model.loader import resolve_model
from pagedq.workers.processes import free_port

TOL = 1e-4
NUM_ITEMS = 50
COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
THINGS = {"grass": "green", "the sky": "blue", "snow": "white", "coal": "black", "a banana": "yellow",
          "blood": "red", "an orange": "orange", "a plum": "purple"}


@pytest.fixture(scope="module")
def settings(redis_url) -> Settings:
    return Settings(broker_url=redis_url, key_prefix="plme:", queue_prefix="plme.", result_cache=False,
                    max_num_seqs=16, kv_cache_memory="256MiB", progress_interval_s=0.5)


@pytest.fixture(scope="module")
def base_url(stack) -> str:
    port = free_port()
    stack.add_gateway(port)
    return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def model_folder(settings) -> str:
    return str(resolve_model(settings.model, settings.state_dir).path)


@pytest.fixture(scope="module")
def hf(model_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_folder)


def hf_token_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, by transformers' own forward pass."""
    with torch.inference_mode():
        logprobs = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def hf_top_ids(model, ids: list[int], k: int) -> list[list[int]]:
    """The k most likely next ids after each prefix ids[:i], i >= 1, by transformers' own forward pass."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, :-1].float().topk(k, -1).indices.tolist()


def write_tasks(folder) -> None:
    rng = random.Random()
    items = []
    for _ in range(NUM_ITEMS):
        thing = rng.choice(list(THINGS))
        choices = rng.sample([c for c in COLOURS if c != THINGS[thing]], 3) + [THINGS[thing]]
        rng.shuffle(choices)
        items.append({"question": f"What colour is {thing}?", "choices": choices,
                      "answer": choices.index(THINGS[thing])})
    (folder / "mc.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    gen = [{"question": f"What colour is {t}?", "target": c} for t, c in list(THINGS.items())[:6]]
    (folder / "gen.jsonl").write_text("".join(json.dumps(i) + "\n" for i in gen))
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "pagedq_mc.yaml").write_text(
        f"task: pagedq_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (folder / "pagedq_gen.yaml").write_text(
        f"task: pagedq_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {folder / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"Question: {{question}}\\nAnswer:\"\n"
        "doc_to_target: \" {{target}}\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n"
        "metric_list:\n  - metric: exact_match\n")


def samples(out_dir, task: str) -> list[dict]:
    paths = list(out_dir.rglob(f"samples_{task}_*.jsonl"))
    assert len(paths) == 1, paths
    return [json.loads(line) for line in paths[0].read_text().splitlines()]


def test_lm_eval_multiple_choice_matches_transformers(base_url, settings, model_folder, hf, tmp_path):
    write_tasks(tmp_path)
    out_dir = tmp_path / "out"
    model_args = (f"model={settings.model},base_url={base_url}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={model_folder},num_concurrent=8,max_retries=1,max_length=2048")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
                          model_args, "--tasks", "pagedq_mc,pagedq_gen", "--include_path", str(tmp_path),
                          "--output_path", str(out_dir), "--log_samples"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]

    print(f"lm-eval ran in {time.monotonic() - start:.1f} s")
    model, tok = hf
    mc = samples(out_dir, "pagedq_mc")
    assert len(mc) == NUM_ITEMS
    worst = 0.0
    reference = functools.cache(lambda ids: hf_token_logprobs(model, list(ids)))  # items repeat questions
    for sample in mc:
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]  # (context, continuation)
        for (context, continuation), ((ll, _greedy),) in zip(pairs, sample["resps"], strict=True):
            whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
            ctxlen = len(tok(context, add_special_tokens=False)["input_ids"])
            want = sum(reference(tuple(whole))[ctxlen - 1:])
            worst = max(worst, abs(float(ll) - want))  # logged as a string
    assert worst < TOL, worst
    print(f"lm-eval: {NUM_ITEMS} items x 4 choices, max |pagedq - transformers| = {worst:.2e}")
    gen = samples(out_dir, "pagedq_gen")
    assert len(gen) == 6 and all(isinstance(s["filtered_resps"][0], str) for s in gen)


def test_echo_prompt_logprobs_and_batches_agree(base_url, settings, hf, client):
    model, tok = hf
    ids = [random.randrange(100, 40000) for _ in range(24)]
    want = hf_token_logprobs(model, ids)

    def post(**body) -> dict:
        r = httpx.post(f"{base_url}/v1/completions", json={"model": settings.model, "prompt": ids, **body},
                       timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    echoed = post(echo=True, logprobs=2, max_tokens=0)
    lps = echoed["logprobs"]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert len(lps["tokens"]) == len(ids) and echoed["finish_reason"] == "length"
    assert echoed["text"] == tok.decode(ids)
    assert max(abs(a - b) for a, b in zip(lps["token_logprobs"][1:], want, strict=True)) < TOL
    # Keyed by text, as OpenAI's: two of a position's top ids that decode alike (byte fragments) share one key.
    assert [len(top) for top in lps["top_logprobs"][1:]] == [len({tok.decode([t]) for t in pair})
                                                              for pair in hf_top_ids(model, ids, 2)]

    scored = post(prompt_logprobs=0, max_tokens=2, temperature=0)  # vLLM's shape, and generation goes on
    positions = scored["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(ids)
    got = [p[str(t)]["logprob"] for p, t in zip(positions[1:], ids[1:], strict=True)]
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL
    assert scored["text"] and "logprobs" in scored and scored["logprobs"] is None

    line = {"custom_id": "one", "url": "/v1/completions",
            "body": {"model": settings.model, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0}}
    batch_id = client.submit_batch([line])
    (result,) = client.batch_results(batch_id, timeout=120)
    batched = result["response"]["body"]["choices"][0]["logprobs"]["token_logprobs"]
    assert batched == lps["token_logprobs"]

    r = httpx.post(f"{base_url}/v1/completions", json={"prompt": ids, "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
