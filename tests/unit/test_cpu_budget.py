"""The engine's thread budget sees the CPU other processes take."""

from __future__ import annotations

import subprocess
import sys
import time

from pagedq.workers.cpu_budget import ThreadBudget, cores_allowed


def test_cores_allowed_is_within_the_affinity_mask():
    import os

    assert 1 <= cores_allowed() <= len(os.sched_getaffinity(0))


def test_a_busy_process_beside_us_is_seen_and_leaves_us_the_rest():
    budget = ThreadBudget(interval_s=1.0)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        budget._last = budget._sample()  # the interval starts with the busy loop running
        time.sleep(1.1)
        first = budget.plan()  # one busy interval: not yet (a burst would look the same)
        time.sleep(1.1)
        threads = budget.plan()
    finally:
        busy.kill()
        busy.wait()
    other = budget.last_other
    print(f"other load {other:.2f} cores of {budget.max_threads}; plan {threads} thread(s)")
    assert other is not None and other >= 0.75, "one busy loop is about one core"
    assert first == budget.max_threads
    assert threads == max(1, budget.max_threads - int(other + 0.25))
    assert threads < budget.max_threads or budget.max_threads == 1
