"""The engine's thread budget sees the CPU other processes take."""

from __future__ import annotations

import os
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


_SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
if sys.argv[2] == "yield":
    from pagedq.pipeline.cpu_worker import yield_cores
    yield_cores(10)
try:
    print(open("/proc/self/autogroup").read().strip(), flush=True)
except OSError:
    print("no autogroups", flush=True)  # a kernel without them: the plain nice is what must weigh
sys.stdin.readline()  # go
t0 = os.times()
end = time.monotonic() + 2.0
while time.monotonic() < end:
    pass
t1 = os.times()
print(t1.user + t1.system - t0.user - t0.system, flush=True)
"""


def test_a_cpu_worker_in_its_own_session_yields_its_core_to_another_session():
    """``pagedq up`` starts every process in its own session.  With autogroups the kernel shares a core equally
    between sessions whatever their processes' nice, so ``yield_cores`` lowers its session's weight too: two
    busy processes of two sessions on one core, the yielding one gets a small share, not half."""
    cpu = min(os.sched_getaffinity(0))

    def spin(mode: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", _SPIN, str(cpu), mode], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, start_new_session=True)

    worker, engine = spin("yield"), spin("plain")
    try:
        groups = [p.stdout.readline().strip() for p in (worker, engine)]
        for p in (worker, engine):
            p.stdin.write("\n")
            p.stdin.flush()
        used = [float(p.stdout.readline()) for p in (worker, engine)]
    finally:
        for p in (worker, engine):
            p.kill()
            p.wait()
    print(f"autogroups {groups}; CPU s worker {used[0]:.2f}, engine {used[1]:.2f}")
    if groups[0] != "no autogroups":
        assert groups[0].endswith("nice 10") and groups[1].endswith("nice 0")
    assert used[0] < 0.4 * used[1], "the niced session must not take its equal half of the core"
