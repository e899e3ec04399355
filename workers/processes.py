"""Child processes that never outlive their parent (Redis, workers, stages), free ports, worker names, and
whether a process recorded by a worker (on this host) still runs."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import NoReturn

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the parent dies, even by SIGKILL, the child gets SIGTERM.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(cmd: list[str], log_path: Path | None = None, env: dict[str, str] | None = None,
          umask: int = -1) -> subprocess.Popen:
    """Start ``cmd`` in its own session (a terminal's Ctrl-C reaches only the parent, which stops it).

    Output goes to ``log_path``, or to the parent's stdout/stderr when it is None.
    """
    out = os.fdopen(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") if log_path else None
    try:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, start_new_session=True,
                                preexec_fn=_die_with_parent, umask=umask)
    finally:
        if log_path:
            out.close()


def stop(proc: subprocess.Popen, timeout: float = 30, sig: int = signal.SIGTERM) -> int | None:
    """Signal once, wait up to ``timeout``, then kill. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
    return wait_or_kill(proc, timeout)


def wait_or_kill(proc: subprocess.Popen, timeout: float = 30) -> int | None:
    # Never signal twice: a second SIGTERM lands inside Celery's warm shutdown and can abort it halfway.
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("process %d did not stop in %.0f s; killing it", proc.pid, timeout)
        proc.kill()
        proc.wait()
    return proc.returncode


def exit_process(code: int | str | None = 0) -> NoReturn:
    """End a worker process that has stopped cleanly, skipping the interpreter's teardown.

    With torch and transformers loaded, that teardown takes over a second and does nothing a stopped
    worker needs (its messages are acked or handed back, its engine and stages are shut down).
    Logs and output are flushed first.
    """
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (it can be taken before the caller binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> str:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22), or "" when no
    such process runs here (or this is not Linux).  Two processes with one pid never share it."""
    stat = _read(f"/proc/{pid}/stat")
    # comm (field 2) may hold spaces and parentheses; the fields after it follow its last ')'
    return stat.rsplit(")", 1)[1].split()[19] if stat else ""


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_identity() -> dict[str, str]:
    """Fields that name this process uniquely to another process on the same host: the host, its boot, the pid
    namespace, the pid and the pid's start time.  Empty strings where the platform has no /proc."""
    pid = os.getpid()
    return {"host": socket.gethostname(), "boot_id": _read("/proc/sys/kernel/random/boot_id"),
            "pid_ns": _pid_namespace(), "pid": str(pid), "pid_start": start_ticks(pid)}


def same_pid_space(record: dict[str, str]) -> bool:
    """True when ``record`` (a worker's, with ``process_identity`` fields) names a process whose pid means the
    same here: same host, same boot, same pid namespace.  False when it cannot be shown (old record, no /proc)."""
    here = process_identity()
    return bool(record.get("pid_start")) and all(here[k] and record.get(k) == here[k]
                                                 for k in ("host", "boot_id", "pid_ns"))


def recorded_process_running(record: dict[str, str]) -> bool:
    """Whether the process ``record`` names still runs (only meaningful when ``same_pid_space(record)``): its pid
    exists and started when the record says, so a pid reused by another process does not count."""
    pid = record.get("pid", "")
    return pid.isdigit() and start_ticks(int(pid)) == record.get("pid_start")


def worker_hostname(role: str, index: int | None = None) -> str:
    """The one Celery worker-name format: ``<role>[index].<pid>@<host>`` (e.g. ``gpu0.4242@box``)."""
    return f"{role}{'' if index is None else index}.{os.getpid()}@{socket.gethostname()}"
