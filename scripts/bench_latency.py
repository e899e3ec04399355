"""The latency budget: what one job's time is made of between submit and result, on an idle deployment.

A stack as ``pagedq up`` starts it (embedded redis-server, one GPU worker, one CPU worker) runs ``--jobs``
chat jobs one after another (``--max-tokens`` each, greedy, distinct prompts, result cache off), each submitted
only once the last one's result is in, so nothing queues behind anything.  From each job's record and the
producer's clock (one host, one clock):

    submit -> preprocessed      broker wait on the preprocess queue, tokenize, the fair push and its token
    preprocessed -> admitted    the dispatch token's wait on the generate queue and its claim, admit
    admitted -> generated       the engine: seated at the next step, prefill, decode
    generated -> completed      the Completion through the results queue, detokenize and build the answer,
                                the terminal write (``finish``)
    completed -> result seen    the done notification reaching the producer (``Client.result``)

Printed: p50 and p90 of each part and of the whole, on the default settings, and beside
them the engine alone: ``LLM.generate`` in this process on prompts of the same shape, one at a time (what
``admitted -> generated`` would be with no queue around the engine).

    python scripts/bench_latency.py                  # 50 one-token jobs
    python scripts/bench_latency.py --max-tokens 16
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

from pagedq.config import Settings
from pagedq.pipeline import Client
from pagedq.pipeline.local.stack import Stack

PARTS = [("submit -> preprocessed", "created_at", "preprocessed_at"),
         ("preprocessed -> admitted", "preprocessed_at", "started_at"),
         ("admitted -> generated", "started_at", "generated_at"),
         ("generated -> completed", "generated_at", "completed_at"),
         ("completed -> result seen", "completed_at", "seen_at")]
WORDS = ["queue", "lease", "worker", "token", "cache", "batch", "tenant", "stream", "engine", "block"]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def messages(i: int) -> list[dict]:
    """Job ``i``'s chat: distinct, of one shape (about 40 prompt tokens with SmolLM2's template)."""
    return [{"role": "user", "content": f"{i}: {' '.join(random.choice(WORDS) for _ in range(8))}"}]


def engine_alone(jobs: int, max_tokens: int) -> list[float]:
    """Seconds per ``LLM.generate`` call of one chat prompt, rendered by the CPU worker's own ``render_prompt``."""
    from pagedq.pipeline.preprocess import render_prompt
    from pagedq.pipeline.protocol import CHAT_URL, parse_request, to_sampling_params
    from pagedq.workers.llm import LLM

    llm = LLM(Settings())

    def request(i: int):
        return parse_request(CHAT_URL, {"messages": messages(i), "max_tokens": max_tokens, "temperature": 0})

    params = to_sampling_params(request(-1))
    llm.generate([render_prompt(llm.tokenizer, request(-1))], params)  # warm up
    took = []
    for i in range(jobs):
        prompt = render_prompt(llm.tokenizer, request(i))
        start = time.perf_counter()
        llm.generate([prompt], params)
        took.append(time.perf_counter() - start)
    return took


def run(jobs: int, max_tokens: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="pagedq-bench-latency-") as scratch:
        settings = Settings()
        if not settings.broker_url:
            settings = settings.model_copy(update={"redis_dir": Path(scratch) / "redis"})
        settings = settings.model_copy(update={"result_cache": False})
        with Stack(settings, log_dir=Path(scratch) / "logs") as stack, Client(settings, stack.url) as client:
            stack.wait_ready(600)
            client.result(client.submit([{"role": "user", "content": "warm up"}], max_tokens=1), timeout=300)
            parts: dict[str, list[float]] = {name: [] for name, _, _ in PARTS}
            parts["whole"] = []
            for i in range(jobs):
                chat = messages(i)
                sent = time.time()
                job = client.submit(chat, max_tokens=max_tokens, temperature=0)
                client.result(job, timeout=300)
                seen = time.time()
                rec = client.r.hgetall(client.names.job(job))
                times = {k: float(rec[k]) for k in ("created_at", "preprocessed_at", "started_at", "generated_at",
                                                    "completed_at")}
                times["seen_at"] = seen
                for name, start, end in PARTS:
                    parts[name].append(times[end] - times[start])
                parts["whole"].append(seen - sent)
            return parts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--max-tokens", type=int, default=1)
    args = ap.parse_args()
    result = run(args.jobs, args.max_tokens)
    print(f"\n{args.jobs} jobs one at a time, max_tokens {args.max_tokens}; milliseconds, p50 / p90")
    print("| part | queue |")
    print("|---|---|")
    for name in [*(n for n, _, _ in PARTS), "whole"]:
        print(f"| {name} | {pct(result[name], 0.5) * 1e3:.1f} / {pct(result[name], 0.9) * 1e3:.1f} |")
    alone = engine_alone(args.jobs, args.max_tokens)
    print(f"\nthe engine alone (LLM.generate in this process, one at a time): p50 {pct(alone, 0.5) * 1e3:.1f} / "
          f"p90 {pct(alone, 0.9) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
