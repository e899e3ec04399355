"""Cache-aware placement: conversations replayed turn by turn on 1, 2 and 4 GPU workers, default settings.

Workload (seeded): ShareGPT conversations with at least ``--min-turns`` human turns (each turn's text capped at
``--turn-tokens`` tokens), a shared system prompt (``bench_prefix.SYSTEM``); each turn is the whole history
with the model's own greedy replies (``--max-tokens``), so the cached blocks really are the history.  All
``--conversations`` run at once, each submitting its next turn when the last one ends (streamed: time to first
token from the submit to the first text delta).

Runs, one sitting, same conversations, each on a fresh stack (``pagedq up``'s: embedded redis-server, N GPU
workers, one CPU worker; the one dispatch path, placement always on): 1 worker, then 2 and 4.  Printed per run:
prompt tokens computed and served from cache (``usage.prompt_tokens_details``), the fleet's hit ratio, TTFT
p50/p99, requests/s and output tok/s, each worker's share of the requests, and the placement counters; then the
lines of issue 46 as PASS/FAIL: N workers keep >= 95% of one worker's hit ratio, no worker above 40% of the
requests with 4.

    python scripts/bench_placement.py                         # 32 conversations x 4 turns, 1/2/4 workers
    python scripts/bench_placement.py --conversations 8 --workers 1 2   # a quick look
    python scripts/bench_placement.py --workers 1 --tenant-scope       # one tenant's private cache vs none

``--tenant-scope`` runs each worker count twice: with no cache scope (as ``Client`` jobs run, and every job did
before caches were private), then with every request in one tenant's scope (the ``cache_salt`` the gateway gives
each request of a tenant, ``scoped_cache_salt``), and prints the second's hit ratio against the first's (issue
48: within 2%).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench_prefix import SYSTEM
from sharegpt import iter_conversations

from pagedq.config import Settings
from pagedq.pipeline import Client
from pagedq.pipeline.local.stack import Stack
from pagedq.pipeline.protocol import scoped_cache_salt
from pagedq.store.dispatch import FairDispatch


@dataclass
class Turn:
    conversation: int
    job_id: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    worker: str = ""


@dataclass
class Run:
    label: str
    workers: int
    turns: list[Turn] = field(default_factory=list)
    seconds: float = 0.0
    stats: dict = field(default_factory=dict)

    @property
    def computed(self) -> int:
        return sum(t.prompt_tokens - t.cached_tokens for t in self.turns)

    @property
    def hit_ratio(self) -> float:
        total = sum(t.prompt_tokens for t in self.turns)
        return sum(t.cached_tokens for t in self.turns) / total if total else 0.0

    def shares(self) -> dict[str, float]:
        counts = Counter(t.worker for t in self.turns)
        return {w: n / len(self.turns) for w, n in sorted(counts.items())}


def conversations(tokenizer, n: int, min_turns: int, turn_tokens: int, seed: int) -> list[list[str]]:
    """``n`` conversations' human turns (at least ``min_turns`` each, each cut to ``turn_tokens`` tokens)."""
    picked: list[list[str]] = []
    for conv in iter_conversations():
        humans = [t["value"] for t in conv.get("conversations", []) if t.get("from") == "human"]
        if len(humans) >= min_turns and all(h.strip() for h in humans[:min_turns]):
            picked.append(humans[:min_turns])
        if len(picked) >= n * 4:
            break
    random.Random(seed).shuffle(picked)
    if len(picked) < n:
        raise SystemExit(f"only {len(picked)} conversations with {min_turns} human turns")
    cut = [[tokenizer.decode(tokenizer(h, add_special_tokens=False)["input_ids"][:turn_tokens]) for h in c]
           for c in picked[:n]]
    return cut


def stream_turn(client: Client, messages: list[dict], max_tokens: int, conversation: int,
                salt: str | None = None) -> tuple[Turn, str]:
    sent = time.perf_counter()
    job = client.submit(messages=messages, max_tokens=max_tokens, temperature=0,
                        **({"cache_salt": salt} if salt else {}))
    turn = Turn(conversation, job)
    text = []
    for delta in client.stream(job, timeout=3600):
        if not text:
            turn.ttft = time.perf_counter() - sent
        text.append(delta)
    result = client.result(job, timeout=3600)
    usage = result["usage"]
    turn.prompt_tokens = usage["prompt_tokens"]
    turn.cached_tokens = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    turn.output_tokens = usage["completion_tokens"]
    turn.worker = client.status(job).worker or ""
    return turn, result["choices"][0]["message"]["content"]


def replay(client: Client, convs: list[list[str]], max_tokens: int, salt: str | None = None) -> list[Turn]:
    turns: list[Turn] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def one(i: int, humans: list[str]) -> None:
        messages = [{"role": "system", "content": SYSTEM}]
        try:
            for human in humans:
                messages.append({"role": "user", "content": human})
                turn, reply = stream_turn(client, messages, max_tokens, i, salt)
                messages.append({"role": "assistant", "content": reply})
                with lock:
                    turns.append(turn)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i, c)) for i, c in enumerate(convs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return turns


def run_once(args, workers: int, work, suffix: str = "") -> Run:
    label = f"{workers} worker{'s' if workers > 1 else ''}{suffix}"
    with tempfile.TemporaryDirectory(prefix="pagedq-bench-placement-") as scratch:
        settings = Settings()
        if not settings.broker_url:
            settings = settings.model_copy(update={"redis_dir": Path(scratch) / "redis"})
        settings = settings.model_copy(update={
            "result_cache": False, "num_threads": args.threads,
            "adaptive_threads": False,
            **({"num_kv_blocks": args.kv_blocks} if args.kv_blocks else {})})
        with Stack(settings, gpu_workers=workers, log_dir=Path(scratch) / "logs") as stack, \
                Client(settings, stack.url) as client:
            stack.wait_ready(900)
            run = Run(label, workers)
            start = time.perf_counter()
            run.turns = work(client)
            run.seconds = time.perf_counter() - start
            run.stats = FairDispatch(client.r, client.names).placement_stats(settings.model)
    report(run)
    return run


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else 0.0


def report(run: Run) -> None:
    ttft = [t.ttft for t in run.turns if t.ttft]
    out = sum(t.output_tokens for t in run.turns)
    print(f"\n{run.label}: {len(run.turns)} requests in {run.seconds:.1f} s "
          f"({len(run.turns) / run.seconds:.2f} req/s, {out / run.seconds:.1f} output tok/s)")
    print(f"  prompt tokens: {sum(t.prompt_tokens for t in run.turns)} total, {run.computed} computed, "
          f"{sum(t.cached_tokens for t in run.turns)} from cache: fleet hit ratio {run.hit_ratio:.1%}")
    if ttft:
        print(f"  TTFT p50 {pct(ttft, 0.5):.2f} s, p99 {pct(ttft, 0.99):.2f} s")
    print("  requests per worker: " + ", ".join(f"{w}: {s:.0%}" for w, s in run.shares().items()))
    if run.stats:
        print(f"  placement: {run.stats}")


def verdicts(runs: dict[int, Run]) -> None:
    one = runs.get(1)
    print("\nissue 46, Done when:")
    for n, run in sorted(runs.items()):
        if n > 1 and one:
            ok = run.hit_ratio >= 0.95 * one.hit_ratio
            print(f"  {'PASS' if ok else 'FAIL'} hit ratio, {n} workers: {run.hit_ratio:.1%} vs one worker's "
                  f"{one.hit_ratio:.1%} (>= 95%: {0.95 * one.hit_ratio:.1%})")
        if n == 4:
            top = max(run.shares().values())
            print(f"  {'PASS' if top <= 0.4 else 'FAIL'} busiest worker's share, 4 workers: {top:.0%} (<= 40%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--min-turns", type=int, default=4)
    ap.add_argument("--turn-tokens", type=int, default=120, help="each human turn cut to this many tokens")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per GPU worker")
    ap.add_argument("--kv-blocks", type=int, default=0, help="KV blocks per worker (0: from kv_cache_memory)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tenant-scope", action="store_true",
                    help="also run each worker count with every request in one tenant's cache scope")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from pagedq.workers.model.loader import resolve_model

    settings = Settings()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(settings.model, settings.state_dir).path)
    runs: dict[int, Run] = {}
    convs = conversations(tokenizer, args.conversations, args.min_turns, args.turn_tokens, args.seed)
    print(f"{len(convs)} conversations x {args.min_turns} turns, max_tokens {args.max_tokens}")
    scoped: dict[int, Run] = {}
    salt = scoped_cache_salt("tenant-a", None)  # what the gateway gives each request of tenant-a
    for n in args.workers:
        runs[n] = run_once(args, n, lambda c: replay(c, convs, args.max_tokens))
        if args.tenant_scope:
            scoped[n] = run_once(args, n, lambda c: replay(c, convs, args.max_tokens, salt), ", one tenant's scope")
    verdicts(runs)
    for n, run in sorted(scoped.items()):
        ok = abs(run.hit_ratio - runs[n].hit_ratio) <= 0.02 * runs[n].hit_ratio
        print(f"  {'PASS' if ok else 'FAIL'} issue 48, {run.label}: hit ratio {run.hit_ratio:.1%} vs "
              f"{runs[n].hit_ratio:.1%} with no scope ({run.hit_ratio / runs[n].hit_ratio:.1%}; within 2%)")
    if args.json:
        Path(args.json).write_text(json.dumps({r.label: {
            "requests": len(r.turns), "seconds": r.seconds, "computed": r.computed, "hit_ratio": r.hit_ratio,
            "shares": r.shares(), "stats": r.stats} for r in [*runs.values(), *scoped.values()]}, indent=2))


if __name__ == "__main__":
    main()
