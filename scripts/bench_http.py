"""Through the HTTP gateway vs through the Python Client: the same ShareGPT workload on the same workers.

One stack (embedded redis-server, a GPU worker, a CPU worker) and one
``pagedq serve`` process in front of it.  The workload is
``bench_throughput``'s (ShareGPT sampled with a fixed seed, chat requests,
greedy, ``ignore_eos``, output length = the reply's, capped), run once each way,
each request streamed, ``--concurrency`` at a time:

- Client: that many threads, each ``Client.submit(..., stream=True)`` then ``Client.stream``;
- HTTP: that many streaming ``POST /v1/chat/completions`` connections (``stream_options.include_usage``).

Printed: output tok/s of each, the HTTP/Client ratio, and time to first token
(submit -> first text delta) p50/p99 of each.

    python scripts/bench_http.py                                   # 200 requests, 64 at a time
    python scripts/bench_http.py --num-requests 8 --concurrency 4 --max-output-len 16   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from sharegpt import BenchRequest, sample_requests

from pagedq.config import Settings
from pagedq.pipeline.client import Client
from pagedq.pipeline.gateway.config import HANDOFF_VARIABLE, KEYS_FILE_VARIABLE
from pagedq.pipeline.local.stack import Stack, settings_env
from pagedq.workers.processes import free_port, spawn, stop


@dataclass
class Run:
    name: str
    seconds: float = 0.0
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.seconds

    def percentile(self, q: float) -> float:
        ordered = sorted(self.ttft)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def row(self) -> str:
        return (f"| {self.name} | {len(self.ttft)} | {self.seconds:.1f} | {self.output_tps:.1f} | "
                f"{statistics.median(self.ttft) * 1000:.0f} | {self.percentile(0.99) * 1000:.0f} |")


def body_of(req: BenchRequest) -> dict:
    return {"messages": req.messages, "max_tokens": req.output_len, "temperature": 0, "ignore_eos": True}


def run_client(client: Client, requests: list[BenchRequest], concurrency: int) -> Run:
    run, lock, todo = Run("Client (Python)"), threading.Lock(), list(enumerate(requests))

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                _, req = todo.pop(0)
            start, first = time.perf_counter(), None
            job = client.submit(**body_of(req), stream=True)
            for delta in client.stream(job):
                if first is None and delta:
                    first = time.perf_counter() - start
            tokens = client.result(job, timeout=600)["usage"]["completion_tokens"]
            with lock:
                run.ttft.append(first if first is not None else time.perf_counter() - start)
                run.output_tokens += tokens

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.seconds = time.perf_counter() - start
    return run


async def _http(base: str, requests: list[BenchRequest], concurrency: int) -> Run:
    run, gate = Run("HTTP gateway (SSE)"), asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as http:
        async def one(req: BenchRequest) -> None:
            async with gate:
                body = {**body_of(req), "stream": True, "stream_options": {"include_usage": True}}
                start, first, tokens = time.perf_counter(), None, None
                async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()}")
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[len("data: "):])
                        if "error" in chunk:
                            raise RuntimeError(f"stream error: {chunk['error']}")
                        if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            first = time.perf_counter() - start
                        if chunk.get("usage"):
                            tokens = chunk["usage"]["completion_tokens"]
                run.ttft.append(first if first is not None else time.perf_counter() - start)
                run.output_tokens += tokens or 0

        start = time.perf_counter()
        await asyncio.gather(*(one(r) for r in requests))
        run.seconds = time.perf_counter() - start
    return run


def run_http(base: str, requests: list[BenchRequest], concurrency: int) -> Run:
    return asyncio.run(_http(base, requests, concurrency))


def start_gateway(settings: Settings, url: str, workers: int, log_dir: Path):
    port = free_port()
    env = {**settings_env(settings), "PAGEDQ_BROKER_URL": url}
    proc = spawn([sys.executable, "-m", "pagedq.pipeline.cli", "serve", "--port", str(port), "--workers",
                  str(workers), "--log-level", "warning"], log_dir / "gateway.log", {**_environ(), **env})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited; see {log_dir / 'gateway.log'}")
        try:
            if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop(proc)
    raise TimeoutError("the gateway did not become ready")


def _environ() -> dict[str, str]:
    """This environment, less an API keys file: the benchmark's gateway serves loopback without keys."""
    return {k: v for k, v in os.environ.items() if k not in (KEYS_FILE_VARIABLE, HANDOFF_VARIABLE)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=64, help="streams at once, on each side")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--gateway-workers", type=int, default=1, help="uvicorn worker processes")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from pagedq.workers.model.loader import resolve_model

    scratch = Path(tempfile.mkdtemp(prefix="pagedq-bench-http-"))
    settings = Settings()
    if not settings.broker_url:  # a fresh embedded Redis, not the user's
        settings = settings.model_copy(update={"redis_dir": scratch / "redis"})
    settings = settings.model_copy(update={"result_cache": False})  # every request reaches the engine
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(settings.model, settings.state_dir).path)
    requests = sample_requests(tokenizer, args.num_requests, args.seed, args.max_prompt_len, args.max_output_len)
    print(f"{len(requests)} requests: {sum(len(r.prompt_token_ids) for r in requests)} prompt tokens, "
          f"{sum(r.output_len for r in requests)} output tokens; {args.concurrency} streams at once", flush=True)

    with Stack(settings, log_dir=scratch / "logs", loglevel="WARNING") as stack, \
            Client(settings, stack.url) as client:
        gateway, base = start_gateway(settings, stack.url, args.gateway_workers, scratch)
        try:
            client.result(client.submit(prompt="warm-up", max_tokens=2, temperature=0), timeout=120)
            httpx.post(f"{base}/v1/completions", json={"prompt": "warm-up", "max_tokens": 2}, timeout=120)
            runs = [run_client(client, requests, args.concurrency)]
            print(runs[-1].row(), flush=True)
            runs.append(run_http(base, requests, args.concurrency))
            print(runs[-1].row(), flush=True)
        finally:
            stop(gateway)
    expected = sum(r.output_len for r in requests)
    for run in runs:
        assert run.output_tokens == expected, f"{run.name} produced {run.output_tokens} tokens, not {expected}"

    print("\n| path | requests | seconds | output tok/s | TTFT p50 ms | TTFT p99 ms |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        print(run.row())
    ratio = runs[1].output_tps / runs[0].output_tps
    print(f"\noutput tok/s ratio, HTTP gateway / Client: {ratio:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": [{**r.__dict__, "output_tps": r.output_tps} for r in runs], "ratio": ratio}, f,
                      indent=1)


if __name__ == "__main__":
    main()
