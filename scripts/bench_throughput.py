"""Offline throughput, vLLM's method: pagedq's engine vs Hugging Face `generate` with static batches.

ShareGPT sampled with a fixed seed; prompt = first human turn, chat-templated;
output length = token length of the first reply, capped; ignore_eos; all
requests submitted at once.  Both sides run in this one process, one after
the other, so the ratio is measured under the same conditions.

    python scripts/bench_throughput.py                      # 200 requests, both sides
    python scripts/bench_throughput.py --hf-requests 64     # shorter HF side, for a quick look
    python scripts/bench_throughput.py --via-queue          # offline engine vs the full queue pipeline
    python scripts/bench_throughput.py --pipeline-stages 2  # 1 stage vs 2 stages, one CPU thread per process

``--via-queue`` runs the same requests through the whole pipeline instead of HF:
an embedded redis-server, a GPU worker and a CPU worker as separate processes,
the Python producer submitting them all at once as chat requests (preprocess
tokenizes and templates them, postprocess builds the completions), timed from
the first submit until the last result is published.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from sharegpt import BenchRequest, sample_requests

from pagedq.config import Settings
from pagedq.config.sampling_params import SamplingParams
from pagedq.workers.llm import LLM


@dataclass
class Result:
    name: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    extra: str = ""

    def row(self) -> str:
        r = self.num_requests / self.seconds
        o = self.output_tokens / self.seconds
        t = (self.prompt_tokens + self.output_tokens) / self.seconds
        return f"| {self.name} | {self.num_requests} | {self.seconds:.1f} | {r:.2f} | {o:.1f} | {t:.1f} | {self.extra} |"

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds


def params_for(req: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=req.output_len, temperature=0, ignore_eos=True)


class LoadMeter:
    """CPU that processes other than this one and its children used meanwhile, in cores (Linux /proc).

    On a shared machine a wall-clock ratio is only meaningful when both sides saw little of it.
    """

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK")
        self.start = self._sample()

    @staticmethod
    def _busy_ticks() -> int:
        fields = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait (guest time is in user)

    @staticmethod
    def _own_ticks() -> int:
        me, total = os.getpid(), 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                pid, rest = stat.read_text().split(" (", 1)
                fields = rest.rsplit(") ", 1)[1].split()
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            if int(pid) == me or int(fields[1]) == me:  # this process and its children (redis, workers)
                total += int(fields[11]) + int(fields[12])
        return total

    def _sample(self) -> tuple[float, int, int]:
        return time.perf_counter(), self._busy_ticks(), self._own_ticks()

    def read(self) -> str:
        """'cpu=<seconds ours> other load=<cores>' since construction."""
        t1, busy1, own1 = self._sample()
        t0, busy0, own0 = self.start
        other = max(0.0, ((busy1 - busy0) - (own1 - own0)) / self.hz / (t1 - t0))
        return f"cpu={(own1 - own0) / self.hz:.0f}s other load={other:.2f} cores"


def run_engine(settings: Settings, requests: list[BenchRequest], name: str = "pagedq engine") -> Result:
    engine = LLM(settings)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    engine.reset_stats()
    start, meter = time.perf_counter(), LoadMeter()
    outs = engine.generate([r.prompt_token_ids for r in requests], [params_for(r) for r in requests])
    seconds, load = time.perf_counter() - start, meter.read()
    produced = sum(len(o.output_token_ids) for o in outs)
    assert produced == sum(r.output_len for r in requests), "engine produced the wrong number of tokens"
    st = engine.stats
    extra = (f"steps={st.steps} preemptions={st.preemptions} kv_waste={st.kv_waste_fraction:.1%} (at peak use {st.kv_peak_waste_fraction:.1%}) "
             f"prefix_hit={st.prefix_hit_rate:.1%} {load}")
    return Result(name, len(requests), sum(len(r.prompt_token_ids) for r in requests), produced, seconds, extra)


def run_via_queue(settings: Settings, requests: list[BenchRequest]) -> Result:
    import tempfile

    from pagedq.pipeline.client import Client
    from pagedq.pipeline.local.stack import Stack

    scratch = Path(tempfile.mkdtemp(prefix="pagedq-bench-"))
    if not settings.broker_url:  # a fresh embedded Redis, not the user's
        settings = settings.model_copy(update={"redis_dir": scratch / "redis"})
    with Stack(settings, log_dir=scratch / "logs", loglevel="WARNING") as stack, Client(settings, stack.url) as client:
        client.result(client.submit(prompt="warm-up", max_tokens=2, temperature=0), timeout=120)
        lines = [{"custom_id": str(i), "url": "/v1/chat/completions",
                  "body": {"messages": r.messages, "max_tokens": r.output_len, "temperature": 0, "ignore_eos": True}}
                 for i, r in enumerate(requests)]
        start, meter = time.perf_counter(), LoadMeter()
        batch = client.submit_batch(lines)
        client.wait_batch(batch)
        seconds, load = time.perf_counter() - start, meter.read()
        out = client.batch_results(batch)
        stats = client.r.hgetall(client.names.worker(next(c.hostname for c in stack.children if c.role == "gpu")))
    produced = sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    assert produced == sum(r.output_len for r in requests), "the queue produced the wrong number of tokens"
    prompt_tokens = sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in out)
    assert prompt_tokens == sum(len(r.prompt_token_ids) for r in requests), "preprocess tokenized differently"
    extra = f"steps={int(stats['steps']) - 1} preemptions={stats['preemptions']} {load} (redis + GPU + CPU worker)"
    return Result("pagedq via queue", len(requests), prompt_tokens, produced, seconds, extra)


def via_queue(settings: Settings, requests: list[BenchRequest], rounds: int, json_path: str | None) -> None:
    results: list[Result] = []
    for i in range(rounds):
        for side in ("offline", "queue") if i % 2 == 0 else ("queue", "offline"):
            results.append(run_engine(settings, requests) if side == "offline" else run_via_queue(settings, requests))
            print(results[-1].row(), flush=True)
            gc.collect()
    offline = [r for r in results if r.name == "pagedq engine"]
    queued = [r for r in results if r.name == "pagedq via queue"]
    print("\n| system | requests | seconds | requests/s | output tok/s | total tok/s | notes |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(r.row())
    ratio = (sum(r.output_tokens for r in queued) / sum(r.seconds for r in queued)) / (
        sum(r.output_tokens for r in offline) / sum(r.seconds for r in offline))
    print(f"\noutput tok/s ratio, via queue / offline engine ({rounds} run(s) each): {ratio:.1%}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"runs": [r.__dict__ for r in results], "ratio": ratio}, f, indent=1)


def run_stages(settings: Settings, requests: list[BenchRequest], stages: int) -> Result:
    """The offline engine as ``stages`` processes of one thread each; notes each stage's busy share and the overlap."""
    engine = LLM(settings.model_copy(update={"pipeline_stages": stages, "num_threads": 1}))
    try:
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
        engine.reset_stats()
        if stages > 1:
            engine.executor.reset_busy()
        start, clock_start, cpu_start, meter = time.perf_counter(), time.monotonic(), time.process_time(), LoadMeter()
        outs = engine.generate([r.prompt_token_ids for r in requests], [params_for(r) for r in requests])
        seconds, clock_end, load = time.perf_counter() - start, time.monotonic(), meter.read()
        busy = engine.executor.busy_report(clock_start, clock_end) if stages > 1 else None
        cpu = busy["cpu_s"] if busy else [time.process_time() - cpu_start]
    finally:
        engine.shutdown()
    produced = sum(len(o.output_token_ids) for o in outs)
    assert produced == sum(r.output_len for r in requests), "engine produced the wrong number of tokens"
    extra = f"micro-batches={engine.stats.steps} CPU s per process={'/'.join(f'{c:.0f}' for c in cpu)} {load}"
    if busy:
        extra += (" busy per stage=" + "/".join(f"{b:.0%}" for b in busy["busy"])
                  + f" both busy={busy['overlap']:.0%} of wall time")
    return Result(f"{stages} stage(s) x 1 thread", len(requests), sum(len(r.prompt_token_ids) for r in requests),
                  produced, seconds, extra)


def compare_stages(settings: Settings, requests: list[BenchRequest], stages: int, rounds: int,
                   json_path: str | None) -> None:
    results: list[Result] = []
    for i in range(rounds):
        for n in (1, stages) if i % 2 == 0 else (stages, 1):
            results.append(run_stages(settings, requests, n))
            print(results[-1].row(), flush=True)
            gc.collect()
    print("\n| system | requests | seconds | requests/s | output tok/s | total tok/s | notes |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(r.row())
    one = [r for r in results if r.name.startswith("1 ")]
    many = [r for r in results if not r.name.startswith("1 ")]
    speedup = (sum(r.output_tokens for r in many) / sum(r.seconds for r in many)) / (
        sum(r.output_tokens for r in one) / sum(r.seconds for r in one))
    print(f"\noutput tok/s, {stages} stages / 1 stage ({rounds} run(s) each, one thread per process): {speedup:.2f}x")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"runs": [r.__dict__ for r in results], "speedup": speedup}, f, indent=1)


def run_hf(model_path, tokenizer, requests: list[BenchRequest], batch_size: int) -> Result:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    start = time.perf_counter()
    produced = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad)
        produced += sum(min(r.output_len, out.shape[1] - width) for r in batch)
    seconds = time.perf_counter() - start
    return Result(f"HF generate (static batch {batch_size})", len(requests),
                  sum(len(r.prompt_token_ids) for r in requests), produced, seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=32)
    ap.add_argument("--hf-requests", type=int, default=None, help="run HF on only the first N requests")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--via-queue", action="store_true",
                    help="compare with the full queue pipeline (embedded Redis + worker processes) instead of HF")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --via-queue / --pipeline-stages: this many runs of each side, alternating (AB BA AB ...) "
                         "so a drift in machine load hits both sides alike")
    ap.add_argument("--pipeline-stages", type=int, default=None,
                    help="compare 1 stage with this many (each process one CPU thread) instead of HF; "
                         "--rounds alternates them")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    settings = Settings()
    engine_probe = LLM(settings)  # resolves/converts the model once
    tokenizer, model_path = engine_probe.tokenizer, engine_probe.model_path
    del engine_probe
    gc.collect()
    requests = sample_requests(tokenizer, args.num_requests, args.seed, args.max_prompt_len, args.max_output_len)
    print(f"{len(requests)} requests: {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens; torch threads={torch.get_num_threads()}",
          flush=True)

    if args.via_queue:
        via_queue(settings, requests, args.rounds, args.json)
        return
    if args.pipeline_stages:
        compare_stages(settings, requests, args.pipeline_stages, args.rounds, args.json)
        return
    results = [run_engine(settings, requests)]
    print(results[-1].row(), flush=True)
    gc.collect()
    if not args.skip_hf:
        hf_reqs = requests[: args.hf_requests] if args.hf_requests else requests
        results.append(run_hf(model_path, tokenizer, hf_reqs, args.hf_batch_size))
        print(results[-1].row(), flush=True)

    print("\n| system | requests | seconds | requests/s | output tok/s | total tok/s | notes |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(r.row())
    if len(results) > 1:
        print(f"\noutput tok/s ratio, pagedq engine / HF static batching: {results[0].output_tps / results[-1].output_tps:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.__dict__ for r in results], f, indent=1)


if __name__ == "__main__":
    main()
