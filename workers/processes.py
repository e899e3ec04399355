"""Child processes that never outlive their parent (Redis, workers, stages), free ports, worker names."""

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


def worker_hostname(role: str, index: int | None = None) -> str:
    """The one Celery worker-name format: ``<role>[index].<pid>@<host>`` (e.g. ``gpu0.4242@box``)."""
    return f"{role}{'' if index is None else index}.{os.getpid()}@{socket.gethostname()}"
