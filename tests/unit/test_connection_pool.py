"""Many threads sharing one client wait for a connection instead of failing (redis-py's default pool caps at 100)."""

from __future__ import annotations

import random
import threading

from pagedq.store.connection import redis_client


def test_hundreds_of_threads_in_blocking_calls_at_once_all_succeed(redis_url):
    r = redis_client(redis_url, timeout_s=30)
    key = f"pool-test:{random.randrange(1 << 30)}"
    n = random.randint(150, 220)  # more than the default pool's 100, all inside a call at the same time
    results: list[object] = []
    errors: list[BaseException] = []
    started = threading.Barrier(n + 1)

    def take() -> None:
        started.wait()
        try:
            results.append(r.blpop([key], timeout=5))
        except BaseException as e:  # noqa: BLE001 - the test counts them
            errors.append(e)

    threads = [threading.Thread(target=take) for _ in range(n)]
    for t in threads:
        t.start()
    started.wait()
    values = [str(random.random()) for _ in range(n)]
    r.rpush(key, *values)
    for t in threads:
        t.join(30)
    assert not errors, f"{len(errors)} calls failed, first: {errors[0]!r}"
    assert sorted(v for _, v in results) == sorted(values)
