"""The engine's greedy outputs are unchanged when the Triton kernels are forced (interpreter, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from engine_fixtures import engine, greedy

SCRIPT = """
import json, sys
from pagedq.config import Settings
from pagedq.workers.llm import LLM
from pagedq.config.sampling_params import SamplingParams
eng = LLM(Settings(attention_backend="triton", kv_cache_memory="64MiB", max_num_batched_tokens=32))
assert eng.executor.runner.model.attention.name == "triton"
prompts = json.loads(sys.argv[1])
outs = eng.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print(json.dumps([o.output_token_ids for o in outs]))
"""


def test_forced_triton_backend_matches_torch_backend():
    tok = engine().tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Queues let producers and consumers"]
    prompts = [tok(t)["input_ids"] for t in texts]
    prompts.append(sum(prompts, []) * 2)  # longer than the 32-token budget: chunked prefill over paged KV
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(prompts)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = [o.output_token_ids for o in engine().generate(prompts, greedy(4))]
    assert got == want


def test_triton_backend_on_cpu_needs_the_interpreter():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("from pagedq.kernels import get_attention_backend\n"
            "try:\n    get_attention_backend('triton', 'cpu')\nexcept ValueError as e:\n    print('refused:', e)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "refused:" in proc.stdout and "TRITON_INTERPRET" in proc.stdout
