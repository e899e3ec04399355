"""Submit latency with ``PAGEDQ_REDIS_MIN_REPLICAS_ACK=1`` vs 0, side by side: the cost of a submit that returns only
once a replica holds the job.

A master and one replica (the embedded redis-server binary, password, AOF ``everysec``, loopback), no workers:
the jobs just wait in their queue.  Two producers, one with the option and one without, submit in alternating
rounds (``--round`` jobs each, one at a time), so both see the same machine; then each submits ``--batches``
batches of ``--batch-lines`` lines.  Printed: p50 / p99 / mean of each, and the ratio.

    python scripts/bench_replica_ack.py                     # 2,000 submits each, 20 batches of 100 lines each
    python scripts/bench_replica_ack.py --jobs 200 --batches 4   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from pagedq.config import Settings
from pagedq.pipeline import Client
from pagedq.pipeline.local.redis_server import RedisServer


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def wait_synced(replica: RedisServer, timeout: float = 30) -> None:
    import redis

    r = redis.Redis.from_url(replica.url, decode_responses=True)
    deadline = time.monotonic() + timeout
    while r.info("replication").get("master_link_status") != "up":
        if time.monotonic() > deadline:
            raise SystemExit("the replica did not sync")
        time.sleep(0.1)


def timed_submit(client: Client, tag: str) -> float:
    started = time.perf_counter()
    client.submit(prompt=f"{tag} {uuid.uuid4().hex}", max_tokens=4)
    return time.perf_counter() - started


def timed_batch(client: Client, lines: int) -> float:
    body = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
             "body": {"prompt": f"line {i} {uuid.uuid4().hex}", "max_tokens": 4}} for i in range(lines)]
    started = time.perf_counter()
    client.submit_batch(body)
    return time.perf_counter() - started


def line(name: str, xs: list[float]) -> str:
    ms = [x * 1000 for x in xs]
    return f"| {name} | {len(ms)} | {pct(ms, 0.5):.2f} | {pct(ms, 0.99):.2f} | {statistics.mean(ms):.2f} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2000, help="single submits per setting")
    ap.add_argument("--round", type=int, default=50, help="submits per setting before switching to the other")
    ap.add_argument("--batches", type=int, default=20, help="batches per setting")
    ap.add_argument("--batch-lines", type=int, default=100)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pagedq-bench-ack-") as scratch:
        master = RedisServer(Path(scratch) / "master", write_run_file=False)
        master.start()
        replica = RedisServer(Path(scratch) / "replica", write_run_file=False, replica_of=master)
        try:
            replica.start()
            wait_synced(replica)
            clients = {}
            for acks in (0, 1):
                s = Settings(broker_url=master.url, key_prefix=f"ack{acks}:", queue_prefix=f"ack{acks}.",
                             result_cache=False, redis_min_replicas_ack=acks)
                clients[acks] = Client(s, master.url)
            single: dict[int, list[float]] = {0: [], 1: []}
            batch: dict[int, list[float]] = {0: [], 1: []}
            for client in clients.values():  # warm up: scripts loaded, connections open
                for _ in range(20):
                    timed_submit(client, "warm")
            while len(single[1]) < args.jobs:
                for acks, client in clients.items():
                    single[acks] += [timed_submit(client, "single") for _ in range(args.round)]
            for _ in range(args.batches):
                for acks, client in clients.items():
                    batch[acks].append(timed_batch(client, args.batch_lines))
            for client in clients.values():
                client.close()
        finally:
            replica.stop()
            master.stop()
    print(f"\nsubmit latency, one master + one replica on loopback (ms); {args.jobs} single submits and "
          f"{args.batches} batches of {args.batch_lines} lines per setting, alternating\n")
    print("| submit | n | p50 | p99 | mean |")
    print("|---|---|---|---|---|")
    print(line("single, PAGEDQ_REDIS_MIN_REPLICAS_ACK=0", single[0]))
    print(line("single, PAGEDQ_REDIS_MIN_REPLICAS_ACK=1", single[1]))
    print(line(f"batch of {args.batch_lines}, =0", batch[0]))
    print(line(f"batch of {args.batch_lines}, =1", batch[1]))
    print(f"\np50 with / without: single {pct(single[1], 0.5) / pct(single[0], 0.5):.2f}x, "
          f"batch {pct(batch[1], 0.5) / pct(batch[0], 0.5):.2f}x")


if __name__ == "__main__":
    main()
