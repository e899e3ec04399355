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


def test_a_niced_busy_process_beside_us_does_not_take_a_core():
    """A CPU worker runs niced (PAGEDQ_CPU_WORKER_NICE): the kernel gives its core to our threads whenever they
    run, so the engine does not count it (it fell to one thread for a whole backlog of short jobs).  Compared
    with a budget that counts the nice column over the same intervals, so other load on the machine cancels."""
    budget, counting_nice = ThreadBudget(interval_s=1.0), ThreadBudget(interval_s=1.0)
    counting_nice.with_nice = True
    busy = subprocess.Popen([sys.executable, "-c", "import os; os.nice(10)\nwhile True: pass"])
    try:
        time.sleep(0.3)
        budget._last, counting_nice._last = budget._sample(), counting_nice._sample()
        time.sleep(1.1)
        budget.plan(), counting_nice.plan()
        time.sleep(1.1)
        threads, _ = budget.plan(), counting_nice.plan()
    finally:
        busy.kill()
        busy.wait()
    other, with_nice = budget.last_other, counting_nice.last_other
    print(f"other load {other:.2f} cores without the nice column, {with_nice:.2f} with it; plan {threads}")
    assert with_nice - other >= 0.75, "the niced busy loop (about a core) is left out"
    assert threads == max(1, budget.max_threads - int(other + 0.25))
