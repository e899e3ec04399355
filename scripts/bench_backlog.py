"""Short jobs: N one-token chat jobs through the queue vs ``run-batch --offline`` on the same JSONL file.

The queue side is what ``pagedq up`` starts (a ``Stack``: an embedded
redis-server, one GPU worker, one CPU worker); the N lines go in as one batch
(``Client.submit_batch``) and are timed from the submit until the batch is
done.  The offline side is ``pagedq run-batch --offline`` on the same file, in
a child process, timed whole (as ``scripts/chaos.py backlog`` does) and also
less its startup (a one-line run's time, the engine's load, is subtracted).

Printed, side by side: jobs/s of each and their ratio; for the queue, Redis
commands per job (``INFO commandstats`` before/after, the busiest commands
listed), CPU milliseconds per job per process kind (producer = this process;
CPU worker, GPU worker and redis-server: ``/proc/<pid>/stat`` utime+stime of
each process and its descendants, plus their reaped children, before/after),
Redis peak memory (``INFO memory`` used_memory_peak; the redis-server is fresh,
so the peak is this run's), and p50/p99 of (completed_at - created_at) from the
job records.

``--compare-rev REV`` runs the queue part a second time with the code of
another git revision: a ``git worktree`` of REV in /tmp, a folder of symlinks
laid out as the ``pagedq`` package (config, store, workers, ...) prepended to
PYTHONPATH, and this script rerun as a child process (``--queue-only``), so the
producer, the workers it starts and their pipeline stages all import REV's
code (checked: the child reports where ``pagedq.config`` came from).

    python scripts/bench_backlog.py                          # 10,000 jobs
    python scripts/bench_backlog.py --jobs 300               # a quick look
    python scripts/bench_backlog.py --compare-rev 0b45208    # this tree vs another revision, one run
    python scripts/bench_backlog.py --jobs 2000 --compare-rev 0b45208 --rounds 4   # ABBA x2: ratio per pair

PAGEDQ_* variables reach both revisions' processes, except those REV's settings do not define (left out, and
said so: an older revision refuses an unknown setting).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = ("config", "kernels", "store", "fleet", "workers", "pipeline")  # pyproject's package-dir mapping
TICK = os.sysconf("SC_CLK_TCK")
KINDS = ("producer", "cpu worker", "gpu worker", "redis-server")


def job_lines(n: int) -> list[dict]:
    """``n`` distinct one-token chat requests (distinct so that no cache answers one)."""
    return [{"custom_id": f"j{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": f"Item {i}: is {i * 7919 % 10007} prime?"}],
                      "max_tokens": 1, "temperature": 0}} for i in range(n)]


def write_jsonl(lines: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


# --- CPU time from /proc ------------------------------------------------------------------------------------
def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (field 3 onwards), or None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid`` and its live descendants (utime+stime), plus the reaped children of each
    (cutime+cstime): a pool process that ended is counted in its parent's cutime, a live one by itself."""
    total = 0
    for p in _descendants(pid):
        fields = _stat(p)
        if fields is not None:
            total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime (fields 14-17)
    return total / TICK


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --- the queue ----------------------------------------------------------------------------------------------
@dataclass
class QueueRun:
    """One queue run's figures (what ``--queue-only`` hands back as JSON)."""

    label: str
    jobs: int
    completed: int
    seconds: float
    commands: dict[str, int]  # Redis command -> calls during the run
    cpu_s: dict[str, float]  # process kind -> CPU seconds during the run
    redis_used_before: int
    redis_peak: int
    latency_s: list[float] = field(default_factory=list)  # completed_at - created_at, per completed job
    code_from: str = ""
    engine: dict[str, float] = field(default_factory=dict)  # GPU workers' engine counters during the run

    @property
    def jobs_per_step(self) -> float:
        return self.jobs / self.engine["steps"] if self.engine.get("steps") else float("nan")

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.seconds

    @property
    def commands_per_job(self) -> float:
        return sum(self.commands.values()) / self.jobs

    def cpu_ms_per_job(self, kind: str) -> float:
        return 1000 * self.cpu_s.get(kind, 0.0) / self.jobs

    def latency(self, q: float) -> float:
        ordered = sorted(self.latency_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _commandstats(r) -> Counter:
    return Counter({k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()})


def _snapshot(stack, r) -> dict[str, float]:
    """CPU seconds so far of this process, of each worker kind and of redis-server."""
    cpu = {"producer": self_cpu_s(), "cpu worker": 0.0, "gpu worker": 0.0}
    for child in stack.children:
        if child.role in ("cpu", "gpu"):
            cpu[f"{child.role} worker"] += tree_cpu_s(child.proc.pid)
    cpu["redis-server"] = tree_cpu_s(int(r.info("server")["process_id"]))
    return cpu


ENGINE_COUNTERS = ("steps", "prompt_tokens_computed", "prefix_hits")


def _engine_counters(r, names) -> dict[str, float]:
    """The GPU workers' engine counters (their records, published after steps), summed."""
    from pagedq.store.registry import live_workers

    totals = dict.fromkeys(ENGINE_COUNTERS, 0.0)
    for rec in live_workers(r, names).values():
        if rec.get("role") == "gpu":
            for k in ENGINE_COUNTERS:
                totals[k] += float(rec.get(k, 0) or 0)
    return totals


def _latencies(r, names, job_ids: list[str]) -> tuple[int, list[float]]:
    """(completed jobs, completed_at - created_at of each) from the job records."""
    done, out = 0, []
    for start in range(0, len(job_ids), 1000):
        pipe = r.pipeline(transaction=False)
        for job_id in job_ids[start:start + 1000]:
            pipe.hmget(names.job(job_id), "state", "created_at", "completed_at")
        for state, created, completed in pipe.execute():
            if state == "completed" and created and completed:
                done += 1
                out.append(float(completed) - float(created))
    return done, out


def run_queue(lines: list[dict], label: str, scratch: Path, timeout: float) -> QueueRun:
    import pagedq.config
    from pagedq.config import Settings
    from pagedq.pipeline.client import Client
    from pagedq.pipeline.local.stack import Stack
    from pagedq.store.connection import redis_client

    settings = Settings()
    if not settings.broker_url:  # a fresh embedded Redis: its commandstats and peak are this run's alone
        settings = settings.model_copy(update={"redis_dir": scratch / "redis"})
    settings = settings.model_copy(update={"result_cache": False})
    if hasattr(settings, "fair_share"):  # PAGEDQ_FAIR_SHARE (issue 19), where this revision has it
        label += f", fair dispatch {'on' if settings.fair_share else 'off'}"
    with Stack(settings, log_dir=scratch / "logs", loglevel="WARNING") as stack, \
            Client(settings, stack.url) as client:
        r = redis_client(stack.url, settings=settings)
        client.result(client.submit(prompt="warm-up", max_tokens=1, temperature=0), timeout=300)
        time.sleep(3)  # let the warm-up's postprocess settle out of the counters, its stats be published
        used_before = r.info("memory")["used_memory"]
        engine0 = _engine_counters(r, client.names)
        cmds0, cpu0, start = _commandstats(r), _snapshot(stack, r), time.perf_counter()
        batch = client.submit_batch(lines)
        client.wait_batch(batch, timeout=timeout)
        seconds = time.perf_counter() - start
        cmds1, cpu1 = _commandstats(r), _snapshot(stack, r)
        peak = r.info("memory")["used_memory_peak"]
        job_ids = r.lrange(client.names.batch_jobs(batch), 0, -1)
        job_ids = [j.decode() if isinstance(j, bytes) else j for j in job_ids]
        completed, latency = _latencies(r, client.names, job_ids)
        time.sleep(3)  # an idle worker publishes its stats every 2 s
        engine1 = _engine_counters(r, client.names)
    commands = {k: v for k, v in (cmds1 - cmds0).items() if v > 0}
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu1}
    return QueueRun(label, len(lines), completed, seconds, commands, cpu, used_before, peak, latency,
                    str(Path(pagedq.config.__file__).resolve().parent.parent),
                    {k: engine1[k] - engine0[k] for k in ENGINE_COUNTERS})


# --- another revision ---------------------------------------------------------------------------------------
def revision_tree(rev: str) -> tuple[str, Path, Path]:
    """(commit, worktree, package root): REV checked out in /tmp and a folder holding ``pagedq/<part>``
    symlinks into it, laid out as the installed package (pyproject maps pagedq.config -> config/, ...)."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    root = Path(tempfile.gettempdir()) / f"pagedq-rev-{sha[:12]}"
    tree, pkg = root / "tree", root / "pkg"
    if not tree.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), sha], check=True,
                       capture_output=True)
    (pkg / "pagedq").mkdir(parents=True, exist_ok=True)
    for part in PACKAGE_DIRS:
        link = pkg / "pagedq" / part
        if (tree / part).is_dir() and not link.exists():
            link.symlink_to(tree / part, target_is_directory=True)
    return sha, tree, pkg


def remove_tree(tree: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)


def known_settings(environ: dict[str, str], tree: Path) -> dict[str, str]:
    """``environ`` less the PAGEDQ_* variables REV's settings do not define (an older revision refuses an
    unknown setting; e.g. PAGEDQ_FAIR_SHARE before fair dispatch: that revision runs arrival order)."""
    source = (tree / "config" / "settings.py").read_text()
    kept = {}
    for name, value in environ.items():
        field = name.removeprefix("PAGEDQ_").lower()
        if name.startswith("PAGEDQ_") and f"{field}:" not in source:
            print(f"  {name} left out: revision has no such setting", flush=True)
            continue
        kept[name] = value
    return kept


def run_queue_at(rev: str, jobs: int, timeout: float, keep: bool) -> QueueRun:
    """The queue part under REV's code, in a child process (its workers inherit its PYTHONPATH)."""
    sha, tree, pkg = revision_tree(rev)
    try:
        out = Path(tempfile.mkdtemp(prefix="pagedq-bench-backlog-")) / "queue.json"
        env = {**known_settings(os.environ, tree),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(pkg), os.environ.get("PYTHONPATH")]))}
        cmd = [sys.executable, __file__, "--jobs", str(jobs), "--timeout", str(timeout), "--queue-only", str(out),
               "--label", f"queue @ {sha[:9]}"]
        subprocess.run(cmd, check=True, env=env)
        run = QueueRun(**json.loads(out.read_text()))
    finally:
        if not keep:
            remove_tree(tree)
    if Path(run.code_from) != tree.resolve():
        raise RuntimeError(f"the child imported pagedq from {run.code_from}, not {tree}: the comparison would "
                           "measure this tree twice")
    return run


# --- offline ------------------------------------------------------------------------------------------------
@dataclass
class OfflineRun:
    jobs: int
    seconds: float  # the whole command, engine load included
    startup_s: float  # a one-line run of the same command
    cpu_s: float

    @property
    def jobs_per_s(self) -> float:
        return self.jobs / self.seconds

    @property
    def jobs_per_s_loaded(self) -> float:
        """Jobs/s less the startup (what an engine already loaded would do)."""
        return self.jobs / max(self.seconds - self.startup_s, 1e-9)


def _offline_once(src: Path, out: Path) -> float:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "run-batch", "--offline", "-i", str(src),
                           "-o", str(out)], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"run-batch --offline failed:\n{proc.stderr[-4000:]}")
    return seconds


def run_offline(src: Path, lines: list[dict], scratch: Path) -> OfflineRun:
    startup = _offline_once(write_jsonl(lines[:1], scratch / "one.jsonl"), scratch / "one.out.jsonl")
    cpu0 = children_cpu_s()
    seconds = _offline_once(src, scratch / "offline.out.jsonl")
    cpu = children_cpu_s() - cpu0
    answers = [json.loads(x) for x in (scratch / "offline.out.jsonl").read_text().splitlines()]
    failed = sum(1 for a in answers if a.get("error"))
    if len(answers) != len(lines) or failed:
        raise RuntimeError(f"run-batch --offline: {len(answers)} lines out of {len(lines)}, {failed} failed")
    return OfflineRun(len(lines), seconds, startup, cpu)


# --- report -------------------------------------------------------------------------------------------------
def report(runs: list[QueueRun], offline: OfflineRun | None) -> None:
    print("\n| path | jobs | completed | seconds | jobs/s |")
    print("|---|---|---|---|---|")
    for run in runs:
        print(f"| {run.label} | {run.jobs} | {run.completed} | {run.seconds:.1f} | {run.jobs_per_s:.1f} |")
    if offline:
        print(f"| run-batch --offline (whole command) | {offline.jobs} | {offline.jobs} | {offline.seconds:.1f} | "
              f"{offline.jobs_per_s:.1f} |")
        print(f"| run-batch --offline (less {offline.startup_s:.1f} s startup) | {offline.jobs} | {offline.jobs} | "
              f"{offline.seconds - offline.startup_s:.1f} | {offline.jobs_per_s_loaded:.1f} |")
        for run in runs:
            print(f"\n{run.label} / offline: {run.jobs_per_s / offline.jobs_per_s:.1%} of the whole command, "
                  f"{run.jobs_per_s / offline.jobs_per_s_loaded:.1%} of it less startup")
        print(f"offline CPU: {1000 * offline.cpu_s / offline.jobs:.2f} ms per job (one process, load included)")

    heads = " | ".join(run.label for run in runs)
    print(f"\n| per job | {heads} |")
    print("|---|" + "---|" * len(runs))
    print("| Redis commands | " + " | ".join(f"{r.commands_per_job:.1f}" for r in runs) + " |")
    for kind in KINDS:
        print(f"| CPU ms, {kind} | " + " | ".join(f"{r.cpu_ms_per_job(kind):.2f}" for r in runs) + " |")
    print("| CPU ms, all | " + " | ".join(f"{sum(r.cpu_ms_per_job(k) for k in KINDS):.2f}" for r in runs) + " |")
    print("| engine steps (jobs per step) | " + " | ".join(
        f"{r.engine.get('steps', 0):.0f} ({r.jobs_per_step:.1f})" for r in runs) + " |")
    print("| prompt tokens computed | " + " | ".join(f"{r.engine.get('prompt_tokens_computed', 0):.0f}"
                                                    for r in runs) + " |")
    print("| latency p50 s (completed_at - created_at) | " + " | ".join(f"{r.latency(0.5):.2f}" for r in runs) + " |")
    print("| latency p99 s | " + " | ".join(f"{r.latency(0.99):.2f}" for r in runs) + " |")
    print("| Redis used_memory before, MiB | " + " | ".join(f"{r.redis_used_before / 2**20:.1f}" for r in runs) + " |")
    print("| Redis used_memory_peak, MiB | " + " | ".join(f"{r.redis_peak / 2**20:.1f}" for r in runs) + " |")

    for run in runs:
        top = sorted(run.commands.items(), key=lambda kv: -kv[1])[:12]
        print(f"\nRedis commands per job, {run.label}: " +
              ", ".join(f"{name} {calls / run.jobs:.2f}" for name, calls in top))
        print(f"  (code from {run.code_from})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=10_000, help="one-token chat jobs (default 10,000)")
    ap.add_argument("--compare-rev", help="also run the queue part with this git revision's code")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --compare-rev: run both this many times each, in ABBA order (this tree, REV, REV, "
                         "this tree, ...) so a drift of the machine's speed hits both; prints each pair's ratio "
                         "and their median")
    ap.add_argument("--keep-worktree", action="store_true", help="with --compare-rev: leave the worktree in /tmp")
    ap.add_argument("--no-offline", action="store_true", help="skip run-batch --offline")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds to wait for the batch")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--queue-only", metavar="JSON", help=argparse.SUPPRESS)  # the child of --compare-rev
    ap.add_argument("--label", default="queue (this tree)", help=argparse.SUPPRESS)
    args = ap.parse_args()

    lines = job_lines(args.jobs)
    scratch = Path(tempfile.mkdtemp(prefix="pagedq-bench-backlog-"))
    if args.queue_only:
        run = run_queue(lines, args.label, scratch, args.timeout)
        Path(args.queue_only).write_text(json.dumps(asdict(run)))
        return 0

    src = write_jsonl(lines, scratch / "in.jsonl")
    print(f"{args.jobs} one-token chat jobs ({src}); scratch {scratch}", flush=True)
    runs, pairs = [], []
    for i in range(args.rounds if args.compare_rev else 1):
        order = ["this", "rev"] if args.compare_rev else ["this"]
        pair = {}
        for which in order if i % 2 == 0 else order[::-1]:  # ABBA: a drift of the machine's speed hits both
            if which == "this":
                run = run_queue(lines, args.label, scratch / f"queue{i}", args.timeout)
            else:
                run = run_queue_at(args.compare_rev, args.jobs, args.timeout, args.keep_worktree)
            if args.rounds > 1:
                run.label += f" #{i + 1}"
            print(f"{run.label}: {run.jobs_per_s:.1f} jobs/s", flush=True)
            runs.append(run)
            pair[which] = run
        pairs.append(pair)
    offline = None if args.no_offline else run_offline(src, lines, scratch)
    report(runs, offline)
    if args.compare_rev and args.rounds > 1:
        ratios = [p["this"].jobs_per_s / p["rev"].jobs_per_s for p in pairs]
        print("\njobs/s, this tree / REV, per round: " + ", ".join(f"{r:.1%}" for r in ratios) +
              f"; median {statistics.median(ratios):.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "queue": [{**asdict(r), "jobs_per_s": r.jobs_per_s, "latency_s": None,
                       "latency_p50_s": r.latency(0.5), "latency_p99_s": r.latency(0.99)} for r in runs],
            "offline": None if offline is None else {**asdict(offline), "jobs_per_s": offline.jobs_per_s,
                                                     "jobs_per_s_loaded": offline.jobs_per_s_loaded}}, indent=1))
    incomplete = [r.label for r in runs if r.completed != r.jobs]
    if incomplete:
        print(f"\nnot every job completed: {incomplete}", file=sys.stderr)
    return 1 if incomplete else 0


if __name__ == "__main__":
    sys.exit(main())
