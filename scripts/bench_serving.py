"""GuideLLM (the vLLM project's serving benchmark, unmodified) against ``pagedq serve``.

    python scripts/bench_serving.py                                        # every profile
    python scripts/bench_serving.py --profile throughput --max-requests 16 # a smoke run
    python scripts/bench_serving.py --profile poisson1 --keep-reports out/

On first use GuideLLM is installed into its own venv, ``.venv-guidellm/`` in the repo root (CPU torch from
the local wheel first, then ``guidellm``); later runs reuse it.  The script starts a deployment itself
(``Stack``: redis-server, a GPU and a CPU worker; the model of ``PAGEDQ_MODEL``, else the default) and
``pagedq serve`` on 127.0.0.1 with a keys file of one tenant whose API key is made here and reaches GuideLLM
only through its environment (``GUIDELLM__SPEC__BACKEND__API_KEY``), never argv or a log.  GuideLLM's
synthetic prompts are tokenized with the local model folder the workers load (offline: no hub).

Profiles:

- ``throughput``: 256-token synthetic prompts, 64 output tokens, 32 concurrent streams, ``--max-requests``;
- ``poisson1``: the same requests, Poisson arrivals at 1 request/s for 60 s.

Per profile it prints requests (ok / errored / incomplete), output tokens/s (GuideLLM's own figure: the mean
rate over the run), and the p50 of TTFT, inter-token latency and request latency of the successful requests;
it exits 1 when any request errored (with the error texts GuideLLM recorded) or GuideLLM failed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from pagedq.config import Settings
from pagedq.config.served import default_model
from pagedq.pipeline.gateway.keys import hash_key
from pagedq.pipeline.local.stack import Stack, settings_env
from pagedq.workers.model.loader import resolve_model
from pagedq.workers.processes import free_port, spawn, stop

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-guidellm"
GUIDELLM = VENV / "bin" / "guidellm"
TORCH_PIN = "torch==2.13.0"  # the CPU build on this machine's disk: installed first, so pip never pulls CUDA's
TENANT = "bench"
PROMPT_TOKENS, OUTPUT_TOKENS = 256, 64
STREAMS = 32
POISSON_RATE, POISSON_SECONDS = 1.0, 60


def profile_spec(name: str, max_requests: int) -> tuple[dict, dict]:
    """GuideLLM's ``--profile`` and ``--constraint`` objects for one of our profiles."""
    if name == "throughput":
        return {"kind": "concurrent", "streams": STREAMS}, {"kind": "max_requests", "count": max_requests}
    return {"kind": "poisson", "rate": POISSON_RATE}, {"kind": "max_duration", "seconds": POISSON_SECONDS}


PROFILES = ("throughput", "poisson1")


# --- GuideLLM's venv -----------------------------------------------------------------------------------


def pip_install(*packages: str) -> None:
    subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", *packages], check=True)


def ensure_guidellm() -> str:
    """Install GuideLLM into ``.venv-guidellm`` unless it is there; its version."""
    if not GUIDELLM.is_file():
        started = time.monotonic()
        print(f"installing GuideLLM into {VENV} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        pip_install(TORCH_PIN)
        pip_install("guidellm")
        print(f"installed in {time.monotonic() - started:.0f} s", flush=True)
    out = subprocess.run([str(GUIDELLM), "--version"], check=True, capture_output=True, text=True).stdout
    return out.strip().rsplit(" ", 1)[-1]


# --- the deployment ------------------------------------------------------------------------------------


def wait_ready(base: str, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the gateway did not get ready: {log.read_text()[-2000:]}")


def start_gateway(settings: Settings, url: str, folder: Path, key: str) -> tuple[str, subprocess.Popen]:
    """``pagedq serve`` on a free port of 127.0.0.1, with a keys file of one tenant."""
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"keys": [{"sha256": hash_key(key), "tenant": TENANT}]}))
    port = free_port()
    env = {**os.environ, **settings_env(settings), "PAGEDQ_BROKER_URL": url}
    log = folder / "gateway.log"
    proc = spawn([sys.executable, "-m", "pagedq.pipeline.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                  "--api-keys-file", str(keys)], log, env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, log)
    except BaseException:
        stop(proc, 30)
        raise
    return base, proc


# --- one GuideLLM run ----------------------------------------------------------------------------------


@dataclass
class Target:
    base: str
    key: str
    model: str  # the name requests call the model by
    tokenizer: Path  # the local folder the workers load


def guidellm_argv(target: Target, profile: str, args: argparse.Namespace, report: Path) -> list[str]:
    prof, constraint = profile_spec(profile, args.max_requests)
    options = {
        "--backend": {"kind": "openai_http", "target": target.base, "model": target.model},
        "--profile": prof,
        "--constraint": constraint,
        "--data": {"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS},
        "--tokenizer": {"kind": "huggingface_auto", "model": str(target.tokenizer)},
        "--seed": {"kind": "static", "value": args.seed},
        "--output": {"kind": "json", "path": str(report)},
    }
    argv = [str(GUIDELLM), "run", "--label", f"profile={profile}", "--disable-console-interactive"]
    for flag, value in options.items():
        argv += [flag, json.dumps(value)]
    return argv


def guidellm_env(target: Target, args: argparse.Namespace) -> dict[str, str]:
    """The key goes by environment (GuideLLM's settings read ``GUIDELLM__SPEC__BACKEND__API_KEY``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDQ_", "GUIDELLM__", "VIRTUAL_ENV"))}
    return {**env, "GUIDELLM__SPEC__BACKEND__API_KEY": target.key, "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": str(args.client_processes)}


def run_guidellm(target: Target, profile: str, args: argparse.Namespace, folder: Path) -> tuple[int, Path]:
    """Run GuideLLM for one profile (its console output passes through); its exit code and report path."""
    (folder / "reports").mkdir(exist_ok=True)
    report = folder / "reports" / f"{profile}.json"
    argv = guidellm_argv(target, profile, args, report)
    print(f"\n=== {profile}: guidellm {' '.join(argv[1:])}", flush=True)
    proc = spawn(argv, None, guidellm_env(target, args))
    try:
        return proc.wait(), report
    finally:
        if proc.poll() is None:  # interrupted: stop it, and the worker processes it made
            stop_tree(proc)


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` (``spawn`` starts each child in a session of its own)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
            pids.append(int(stat.parent.name))
    return pids


def stop_tree(proc: subprocess.Popen) -> None:
    """Stop ``proc`` (SIGINT, as a terminal's Ctrl-C would), then whatever of its session is left (its worker
    processes: the session keeps the leader's id after it exits, and a reused pid is in a session of its own)."""
    stop(proc, 30, signal.SIGINT)
    for pid in session_pids(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- the report ----------------------------------------------------------------------------------------


@dataclass
class Row:
    profile: str
    ok: int = 0
    errored: int = 0
    incomplete: int = 0
    out_tok_s: float = float("nan")
    ttft_ms: float = float("nan")
    itl_ms: float = float("nan")
    latency_s: float = float("nan")
    errors: Counter | None = None
    failed: str = ""  # GuideLLM itself failed: why


def p50(metric: dict) -> float:
    return metric["successful"]["percentiles"]["p50"]


def summarize(profile: str, report: Path) -> Row:
    """One row from GuideLLM's JSON report (``GenerativeBenchmarksReport``: ``benchmarks[].metrics``)."""
    bench = json.loads(report.read_text())["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    errors = Counter((r.get("info", {}).get("error") or "?")[:300] for r in bench["requests"].get("errored") or [])
    return Row(profile, totals["successful"], totals["errored"], totals["incomplete"],
               m["output_tokens_per_second"]["total"]["mean"], p50(m["time_to_first_token_ms"]),
               p50(m["inter_token_latency_ms"]), p50(m["request_latency"]), errors)


def print_table(rows: list[Row]) -> None:
    print("\n| profile | requests (ok / err / incomplete) | output tok/s | TTFT p50 ms | ITL p50 ms | "
          "request latency p50 s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r.failed:
            print(f"| {r.profile} | GuideLLM failed: {r.failed} | | | | |")
            continue
        print(f"| {r.profile} | {r.ok + r.errored + r.incomplete} ({r.ok} / {r.errored} / {r.incomplete}) | "
              f"{r.out_tok_s:.1f} | {r.ttft_ms:.0f} | {r.itl_ms:.1f} | {r.latency_s:.2f} |")
    for r in rows:
        for text, n in (r.errors or {}).items():
            print(f"{r.profile}: {n} x {text}")


def probe(target: Target) -> str:
    """One request of the shape GuideLLM 0.8's chat requests have (``OpenAIRequestHandler`` for
    ``/v1/chat/completions``, streamed, a fixed output length), sent here so that a refusal's body shows: GuideLLM
    records only httpx's status line."""
    body = {"model": target.model, "stream": True, "stream_options": {"include_usage": True,
                                                                       "continuous_usage_stats": True},
            "max_completion_tokens": OUTPUT_TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": "river stone lantern " * 20}]}
    reply = httpx.post(target.base + "/v1/chat/completions", json=body, timeout=600,
                       headers={"Authorization": f"Bearer {target.key}"})
    shown = {k: v if k != "messages" else "[one user message]" for k, v in body.items()}
    return f"probe {json.dumps(shown)} -> {reply.status_code}: {reply.text[:1000]}"


def bench(target: Target, args: argparse.Namespace, folder: Path) -> list[Row]:
    rows = []
    for profile in args.profile or PROFILES:
        code, report = run_guidellm(target, profile, args, folder)
        if code != 0 or not report.is_file():
            rows.append(Row(profile, failed=f"exit {code}" + ("" if report.is_file() else ", no report")))
        else:
            rows.append(summarize(profile, report))
    if any(r.errored for r in rows):
        print(probe(target), flush=True)
    return rows


# --- main ----------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", action="append", choices=PROFILES,
                    help="a profile to run; repeatable (default: every one)")
    ap.add_argument("--max-requests", type=int, default=200, help="throughput's requests (default 200)")
    ap.add_argument("--seed", type=int, default=42, help="GuideLLM's seed (synthetic data, Poisson arrivals)")
    ap.add_argument("--client-processes", type=int, default=2,
                    help="GuideLLM's worker processes (its default of 10 crowds a small machine)")
    ap.add_argument("--keep-reports", type=Path, help="a folder to copy GuideLLM's JSON reports (and the gateway's log) to")
    return ap.parse_args()


def run_all(args: argparse.Namespace, scratch: Path) -> list[Row]:
    settings = Settings()
    if not settings.broker_url:
        settings = settings.model_copy(update={"redis_dir": scratch / "redis"})
    tokenizer = resolve_model(settings.model, settings.state_dir).path
    key = f"sk-{secrets.token_hex(16)}"
    with Stack(settings, log_dir=scratch / "logs") as stack:
        stack.wait_ready(900)
        base, gateway = start_gateway(settings, stack.url, scratch, key)
        try:
            return bench(Target(base, key, default_model(settings), tokenizer), args, scratch)
        finally:
            stop(gateway, 30)


def keep(scratch: Path, folder: Path | None) -> None:
    """GuideLLM's JSON reports and the gateway's log, copied to ``folder``."""
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    for path in [*sorted((scratch / "reports").glob("*.json")), scratch / "gateway.log"]:
        if path.is_file():
            (folder / path.name).write_bytes(path.read_bytes())


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops what it started
    version = ensure_guidellm()
    print(f"guidellm {version}", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pagedq-guidellm-") as tmp:
        rows = run_all(args, Path(tmp))
        keep(Path(tmp), args.keep_reports)
    print_table(rows)
    print(f"\nguidellm {version}; {time.monotonic() - started:.0f} s with the deployment's start")
    if any(r.failed or r.errored for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # everything started is stopped by then (the finally blocks, Stack's exit)
        sys.exit(130)
