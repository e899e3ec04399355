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

With ``--connections N`` it is a load test of one gateway process instead: N
chat completions of ``--max-tokens`` tokens (greedy, ``ignore_eos``) sent all
at once, each on its own connection, streamed or (``--blocking``) not.  Each
answer is checked against its job: the whole text (every token), the token
count, ``[DONE]`` at the end of a stream, and the job's state.  Printed:
completed / failed / cancelled, time to first token (streams; the whole answer
when blocking) p50/p99, and the gateway's memory (VmRSS before, VmHWM after,
from ``/proc/<pid>/status``).

    python scripts/bench_http.py                                   # 200 requests, 64 at a time
    python scripts/bench_http.py --num-requests 8 --concurrency 4 --max-output-len 16   # a quick look
    python scripts/bench_http.py --connections 1000                # 1,000 streams at once, 16 tokens each
    python scripts/bench_http.py --connections 1000 --blocking     # 1,000 blocking requests
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


# --- --connections: N requests at once through one gateway process ------------------------------------------
@dataclass
class Answer:
    """One request's outcome: ``error`` is None when it answered 200 with a whole response."""

    job_id: str | None = None
    text: str = ""
    tokens: int | None = None
    done: bool = False  # a stream ended with [DONE]
    ttft: float | None = None
    error: str | None = None


def load_body(i: int, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": f"Request {i}: tell me about the number {i * 7919 % 10007}."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def _stream_one(http: httpx.AsyncClient, body: dict) -> Answer:
    answer, start = Answer(), time.perf_counter()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return Answer(error=f"HTTP {resp.status_code}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                answer.done = True
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                answer.error = f"stream error {chunk['error'].get('code')}"
                continue
            answer.job_id = chunk["id"].removeprefix("chatcmpl-")
            content = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
            if content:
                answer.ttft = answer.ttft or time.perf_counter() - start
                answer.text += content
            if chunk.get("usage"):
                answer.tokens = chunk["usage"]["completion_tokens"]
    return answer


async def _block_one(http: httpx.AsyncClient, body: dict) -> Answer:
    start = time.perf_counter()
    resp = await http.post("/v1/chat/completions", json=body)
    if resp.status_code != 200:
        return Answer(error=f"HTTP {resp.status_code}")
    result = resp.json()
    return Answer(result["id"].removeprefix("chatcmpl-"), result["choices"][0]["message"]["content"],
                  result["usage"]["completion_tokens"], True, time.perf_counter() - start)


async def _load(base: str, n: int, max_tokens: int, blocking: bool) -> tuple[list[Answer], float]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    one = _block_one if blocking else _stream_one
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(1800, connect=120), limits=limits) as http:
        async def guarded(i: int) -> Answer:
            try:
                return await one(http, load_body(i, max_tokens))
            except httpx.HTTPError as e:
                return Answer(error=type(e).__name__)

        start = time.perf_counter()
        answers = await asyncio.gather(*(guarded(i) for i in range(n)))
        return answers, time.perf_counter() - start


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in KiB."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0])
    return fields


def check(client: Client, answer: Answer, max_tokens: int) -> str:
    """'completed', 'cancelled' or 'failed: why' for one answer, judged against its job."""
    if answer.job_id is None:
        return f"failed: {answer.error or 'no job id'}"
    state = client.status(answer.job_id).state
    if state == "cancelled":
        return "cancelled"
    if answer.error is not None or state != "completed":
        return f"failed: {answer.error or state}"
    expected = client.result(answer.job_id, timeout=60)["choices"][0]["message"]["content"]
    if answer.text != expected:
        return "failed: text differs from the job's"
    if answer.tokens != max_tokens:
        return f"failed: {answer.tokens} tokens"
    return "completed" if answer.done else "failed: no [DONE]"


def run_load(args: argparse.Namespace, settings: Settings, scratch: Path) -> dict:
    mode = "blocking" if args.blocking else "streaming"
    with Stack(settings, log_dir=scratch / "logs", loglevel="WARNING") as stack, \
            Client(settings, stack.url) as client:
        extra = ["--limit-concurrency", str(args.limit_concurrency)] if args.limit_concurrency else []
        gateway, base = start_gateway(settings, stack.url, 1, scratch, extra)
        try:
            httpx.post(f"{base}/v1/completions", json={"prompt": "warm-up", "max_tokens": 2}, timeout=120)
            before = memory_kib(gateway.pid)
            print(f"{args.connections} {mode} chat completions at once, {args.max_tokens} tokens each; "
                  f"gateway pid {gateway.pid}, VmRSS {before['VmRSS'] / 1024:.0f} MiB", flush=True)
            answers, seconds = asyncio.run(_load(base, args.connections, args.max_tokens, args.blocking))
            after = memory_kib(gateway.pid)
        finally:
            stop(gateway)
        verdicts = [check(client, a, args.max_tokens) for a in answers]
    failures: dict[str, int] = {}
    for v in verdicts:
        if v.startswith("failed"):
            failures[v] = failures.get(v, 0) + 1
    ttft = sorted(a.ttft for a in answers if a.ttft is not None)
    report = {"mode": mode, "connections": args.connections, "max_tokens": args.max_tokens, "seconds": seconds,
              "completed": verdicts.count("completed"), "cancelled": verdicts.count("cancelled"),
              "failed": sum(failures.values()), "failures": failures,
              "ttft_p50_ms": 1000 * ttft[len(ttft) // 2] if ttft else None,
              "ttft_p99_ms": 1000 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] if ttft else None,
              "gateway_rss_before_mib": before["VmRSS"] / 1024, "gateway_peak_rss_mib": after["VmHWM"] / 1024}
    what = "TTFT" if mode == "streaming" else "latency"
    print(f"\n| mode | connections | completed | failed | cancelled | seconds | {what} p50 ms | {what} p99 ms "
          "| gateway RSS before / peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    p50, p99 = (f"{report[k]:.0f}" if report[k] is not None else "-" for k in ("ttft_p50_ms", "ttft_p99_ms"))
    print(f"| {mode} | {args.connections} | {report['completed']} | {report['failed']} | {report['cancelled']} | "
          f"{seconds:.1f} | {p50} | {p99} | {report['gateway_rss_before_mib']:.0f} / "
          f"{report['gateway_peak_rss_mib']:.0f} |")
    if failures:
        print(f"failures: {failures}")
    return report


def start_gateway(settings: Settings, url: str, workers: int, log_dir: Path, extra: list[str] | None = None):
    port = free_port()
    env = {**settings_env(settings), "PAGEDQ_BROKER_URL": url}
    proc = spawn([sys.executable, "-m", "pagedq.pipeline.cli", "serve", "--port", str(port), "--workers",
                  str(workers), "--log-level", "warning", *(extra or [])], log_dir / "gateway.log",
                 {**_environ(), **env})
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
    ap.add_argument("--connections", type=int, help="load test instead: this many requests at once through one "
                                                    "gateway process (see above)")
    ap.add_argument("--blocking", action="store_true", help="with --connections: blocking requests, not streams")
    ap.add_argument("--max-tokens", type=int, default=16, help="with --connections: tokens per request")
    ap.add_argument("--limit-concurrency", type=int, help="with --connections: the gateway's --limit-concurrency")
    args = ap.parse_args()
    if args.connections:
        scratch = Path(tempfile.mkdtemp(prefix="pagedq-bench-http-"))
        settings = Settings()
        if not settings.broker_url:
            settings = settings.model_copy(update={"redis_dir": scratch / "redis"})
        report = run_load(args, settings.model_copy(update={"result_cache": False}), scratch)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        sys.exit(0 if report["completed"] == args.connections else 1)

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
