"""Prefix caching on vs off, side by side in one run.

100 requests share a ~400-token system prompt and ask distinct questions
(first human turns from ShareGPT, short ones); all are submitted at once.
Reports prompt tokens computed, mean time to first token, and throughput.

    python scripts/bench_prefix.py [--num-requests 100] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import time

from sharegpt import chat_prompt_ids, iter_conversations

from pagedq.config import Settings
from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.llm import LLM

SYSTEM = (
    "You are the support assistant of Acme Queue, a hosted service that runs machine-learning jobs "
    "behind priority message queues. Customers submit jobs from Python, watch them in a dashboard and "
    "poll for results. Answer in a friendly, precise way. Rules: never invent features; when a customer "
    "asks about billing, point them to the billing page; when they ask about outages, point them to the "
    "status page; when they paste an error, explain what it means before suggesting a fix; prefer short "
    "numbered steps for procedures; mention the relevant command-line flag when one exists; and say so "
    "plainly when you do not know. Jobs have priorities from 0 to 9, where 9 is the most urgent; "
    "results are kept for 24 hours; cancelled jobs free their resources within two steps; workers can "
    "run on any number of hosts; the result cache answers repeated deterministic requests without "
    "running the model again, and is invalidated whenever the model's weights change. "
) * 2


def questions(tokenizer, n: int) -> list[str]:
    out: list[str] = []
    for conv in iter_conversations():
        turns = conv.get("conversations", [])
        if turns and turns[0].get("from") == "human":
            q = turns[0]["value"].strip()
            if 5 <= len(tokenizer(q)["input_ids"]) <= 40 and q not in out:
                out.append(q)
        if len(out) == n:
            return out
    raise RuntimeError("not enough short questions")


def run(engine: LLM, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    first_token: dict[str, float] = {}
    done = 0
    while engine.has_unfinished():
        for out in engine.step():
            now = time.perf_counter() - start
            first_token.setdefault(out.request_id, now)
            done += out.finished
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "computed": engine.stats.prompt_tokens_computed,
            "ttft": sum(first_token.values()) / len(first_token), "hit_rate": engine.stats.prefix_hit_rate,
            "req_s": len(prompts) / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()

    results = {}
    for label, on in (("prefix cache off", False), ("prefix cache on", True)):
        engine = LLM(Settings(enable_prefix_caching=on))
        if not results:
            qs = questions(engine.tokenizer, args.num_requests)
            prompts = [chat_prompt_ids(engine.tokenizer, [{"role": "system", "content": SYSTEM},
                                                          {"role": "user", "content": q}]) for q in qs]
            shared = len(chat_prompt_ids(engine.tokenizer, [{"role": "system", "content": SYSTEM}]))
            print(f"{len(prompts)} requests, ~{shared} shared system-prompt tokens, "
                  f"{sum(map(len, prompts))} prompt tokens in all, {args.max_tokens} output tokens each")
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))  # warm-up
        engine.reset_stats()
        results[label] = run(engine, prompts, args.max_tokens)
        del engine

    off, on = results["prefix cache off"], results["prefix cache on"]
    print("\n| prefix cache | prompt tokens computed | hit rate | mean TTFT (s) | requests/s | wall (s) |")
    print("|---|---|---|---|---|---|")
    for label, r in results.items():
        print(f"| {label.split()[-1]} | {r['computed']} | {r['hit_rate']:.1%} | {r['ttft']:.2f} | "
              f"{r['req_s']:.2f} | {r['seconds']:.1f} |")
    print(f"\nprompt tokens computed: -{1 - on['computed'] / off['computed']:.1%}; "
          f"TTFT {off['ttft'] / on['ttft']:.2f}x faster; throughput {on['req_s'] / off['req_s']:.2f}x")


if __name__ == "__main__":
    main()
