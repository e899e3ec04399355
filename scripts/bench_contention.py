"""Throughput through the queue on a quiet CPU and beside one busy-loop process, in one sitting.

    python scripts/bench_contention.py                    # 200 ShareGPT requests: quiet, then busy
    python scripts/bench_contention.py --baseline         # also busy with adaptive threads off (all cores)
    python scripts/bench_contention.py --quiet-baseline   # also quiet with adaptive threads off (the cost of adapting)

The competitor is one Python busy loop pinned to one core (the last one this
process may use).  A GPU worker on the CPU computes with the cores other
processes leave free (``PAGEDQ_ADAPTIVE_THREADS``, on by default), so a
competitor taking one core of two should cost about half the throughput, not
nine tenths.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
from contextlib import contextmanager

from bench_throughput import Result, run_via_queue
from sharegpt import sample_requests

from pagedq.config import Settings
from pagedq.workers.llm import LLM


@contextmanager
def busy_loop(core: int):
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--baseline", action="store_true", help="also run busy with adaptive threads off")
    ap.add_argument("--quiet-baseline", action="store_true", help="also run quiet with adaptive threads off")
    args = ap.parse_args()

    settings = Settings()
    tokenizer = LLM(settings).tokenizer
    gc.collect()
    requests = sample_requests(tokenizer, args.num_requests, args.seed, 512, args.max_output_len)
    core = max(os.sched_getaffinity(0))
    runs: list[tuple[str, Result]] = []

    def run(name: str, s: Settings) -> None:
        result = run_via_queue(s, requests)
        result.name = name
        runs.append((name, result))
        print(result.row(), flush=True)
        gc.collect()

    run("quiet", settings)
    if args.quiet_baseline:
        run("quiet, adaptive threads off", settings.model_copy(update={"adaptive_threads": False}))
    with busy_loop(core):
        run("one busy loop beside it", settings)
    if args.baseline:
        with busy_loop(core):
            run("one busy loop, adaptive threads off", settings.model_copy(update={"adaptive_threads": False}))

    print("\n| run | requests | seconds | requests/s | output tok/s | total tok/s | notes |")
    print("|---|---|---|---|---|---|---|")
    for _, r in runs:
        print(r.row())
    quiet = runs[0][1].output_tps
    for name, r in runs[1:]:
        print(f"{name}: {r.output_tps / quiet:.1%} of quiet output tok/s")
    if args.quiet_baseline:
        off = runs[1][1].output_tps
        print(f"quiet with adaptive threads vs without: {quiet / off:.1%}")


if __name__ == "__main__":
    main()
