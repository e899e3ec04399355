"""How many threads the engine should compute with: the cores this process gets, less what others are using.

On a CPU, every operator is an OpenMP parallel region, and a region ends only
when its slowest thread does.  If another process takes a core, one of our
threads waits for a time slice at every region, thousands of times a step:
two threads on two busy cores run many times slower than one thread on the
core that is free.  So the stepping thread re-plans its thread count every
``interval_s`` (half a second: a step that starts with every thread just as
another process's burst begins runs ten times slower, so the plan must follow
the load within a step or two) from

- the cores it may run on (CPU affinity, and a cgroup v2 ``cpu.max`` quota);
- minus the CPU time other processes used on those CPUs over the last
  interval (from ``/proc/stat``, less this process's own), rounded to whole
  cores.  Time of niced processes (``nice`` > 0, as CPU workers run:
  ``PAGEDQ_CPU_WORKER_NICE``) is not counted: the kernel hands their core to
  our thread as soon as it is runnable, so they do not hold a region up (a
  CPU worker busy with a backlog's postprocessing otherwise kept the engine
  on one thread for a whole run);

and never fewer than one.  A quiet machine keeps every core.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path


def set_omp_spin_count(count: int) -> bool:
    """Set ``GOMP_SPINCOUNT`` for this process's OpenMP threads (``Settings.omp_spin_count``); returns whether it
    did.  Call it before torch is imported: libgomp reads the variable once, as it loads (raises otherwise).

    Why: between two operators the engine's other OpenMP threads spin, waiting for the next one.  A GPU worker
    on a CPU shares its cores with the CPU worker, Redis and its own Celery threads; each time one of those
    takes a core mid-operator, the thread left running spins at the barrier, and with libgomp's default
    (300,000 spins: milliseconds) that burns CPU the others needed.  A few hundred microseconds keeps the
    spin across an operator's gap (decode's many small ones) and sleeps through a preemption.  A
    ``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY`` the user set wins."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    if "torch" in sys.modules:
        raise RuntimeError("set_omp_spin_count: torch is imported already (libgomp has read its settings)")
    os.environ["GOMP_SPINCOUNT"] = str(count)
    return True


def cores_allowed() -> int:
    """Cores this process may use: its affinity mask, capped by a cgroup v2 CPU quota."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def _busy_ticks(cpus: set[int], with_nice: bool) -> int:
    """Clock ticks the CPUs ``cpus`` spent busy (user, system, irq, softirq, steal, and nice if ``with_nice``)
    since boot."""
    total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
            total += user + system + irq + softirq + steal + (nice if with_nice else 0)
    return total


def _own_ticks() -> int:
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime of every thread of this process


BUSY_CORE_SLACK = 0.25  # others using 0.75 of a core or more take it away from us


class ThreadBudget:
    """Call ``plan()`` between engine steps; it returns the thread count to use (it re-plans every interval)."""

    def __init__(self, interval_s: float = 0.5, max_threads: int | None = None) -> None:
        self.interval_s = interval_s
        self.max_threads = max_threads or cores_allowed()
        self.threads = self.max_threads
        self.last_other: float | None = None  # the other load the current plan was made from
        self.hz = os.sysconf("SC_CLK_TCK")
        # Only the CPUs this process may run on: other load elsewhere on a big host is not ours to yield to.
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
        # A niced engine's own ticks are in the nice column: then count that column, or ours would be missed.
        self.with_nice = os.getpriority(os.PRIO_PROCESS, 0) > 0
        self._last = self._sample()

    def _sample(self) -> tuple[float, int, int] | None:
        try:
            return time.monotonic(), _busy_ticks(self.cpus, self.with_nice), _own_ticks()
        except (OSError, ValueError, IndexError):
            return None  # no /proc: keep every core

    def other_load(self) -> float | None:
        """Cores' worth of CPU other processes used since the last call (None until an interval passed)."""
        if self._last is None or time.monotonic() - self._last[0] < self.interval_s:
            return None  # checked before reading /proc: plan() runs every engine step
        now = self._sample()
        if now is None:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / self.hz / (t1 - t0))

    def plan(self) -> int:
        """Fewer threads only after two intervals in a row each saw others busy (a short burst, such as a CPU
        worker tokenizing a batch, does not count); all of them again as soon as one interval is quiet."""
        other = self.other_load()
        if other is not None:
            wanted = max(1, min(self.max_threads, self.max_threads - int(other + BUSY_CORE_SLACK)))
            if wanted >= self.threads or (self.last_other is not None and
                                          max(1, self.max_threads - int(self.last_other + BUSY_CORE_SLACK)) <= wanted):
                self.threads = wanted
            self.last_other = other
        return self.threads
