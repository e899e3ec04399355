"""A whole deployment on one machine, as child processes.

The broker (an embedded ``redis-server`` unless ``PAGEDQ_BROKER_URL`` is set or
one is already running; with ``replicas`` and ``sentinels``, a local Sentinel
topology, ``topology.py``), GPU workers (``pagedq worker``) and CPU workers
(``pagedq cpu-worker``).  ``pagedq up``,
``pagedq run-batch`` (queued), the benchmark and the tests all use it.  Stop
order: GPU workers (their running jobs go back to the queue), CPU workers,
then the broker, so nothing is left behind.

With ``reuse_workers`` (``pagedq up``) a role already served is not started
again, but only by workers shown to be alive: a killed worker's record lasts
until its TTL, and trusting it would leave a restarted deployment with no
worker at all (and nobody to restore the dead one's leases).  On this host a
record's pid must still run and have started when the record says; a worker
elsewhere must renew its record within a heartbeat interval.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

import redis
from pydantic import SecretStr

from pagedq.config import Settings
from pagedq.config.names import Names
from pagedq.config.served import engine_model_name
from pagedq.pipeline.local.redis_server import ensure_broker
from pagedq.pipeline.local.topology import ensure_topology
from pagedq.store.connection import redis_client
from pagedq.store.registry import live_workers, renewed_records
from pagedq.workers.processes import (
    recorded_process_running,
    same_pid_space,
    spawn,
    stop,
    wait_or_kill,
    worker_hostname,
)

log = logging.getLogger(__name__)


@dataclass
class Child:
    hostname: str
    role: str  # "gpu" | "cpu"
    proc: Popen
    log_path: Path | None


@dataclass
class Reuse:
    """Whether ``pagedq up`` reuses a worker it found registered, and why."""
    hostname: str
    role: str
    alive: bool
    why: str

    def line(self) -> str:
        return f"reusing {self.hostname} ({self.why})" if self.alive else f"ignoring {self.hostname}: {self.why}"


def judge_workers(r: redis.Redis, names: Names, records: dict[str, dict[str, str]], ttl_s: float) -> list[Reuse]:
    """Which registered workers still run.  Same pid space (host, boot, pid namespace): the recorded pid runs
    and started when recorded.  Elsewhere (or an old record without those fields): its record is renewed within
    one heartbeat interval (a third of its TTL, the record's ``ttl_s`` or else ``ttl_s``) plus a second; all such
    records are watched at once."""
    verdicts: dict[str, Reuse] = {}
    remote = []
    for host, rec in records.items():
        if not same_pid_space(rec):
            remote.append(host)
        elif recorded_process_running(rec):
            verdicts[host] = Reuse(host, rec.get("role", ""), True, f"pid {rec['pid']}, alive")
        else:
            verdicts[host] = Reuse(host, rec.get("role", ""), False, f"pid {rec.get('pid', '?')} is not running")
    if remote:
        window = max(float(records[host].get("ttl_s") or ttl_s) for host in remote) / 3 + 1
        renewed = renewed_records(r, names, remote, window)
        for host in remote:
            role, where = records[host].get("role", ""), records[host].get("host") or "another host"
            verdicts[host] = (Reuse(host, role, True, f"on {where}, heartbeat seen") if host in renewed else
                              Reuse(host, role, False, f"on {where}, no heartbeat within {window:.0f} s"))
    return [verdicts[host] for host in records]


def settings_env(settings: Settings) -> dict[str, str]:
    """PAGEDQ_* variables that give a child process the same settings as ``settings``."""
    env = {}
    for name in settings.model_fields_set:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            value = value.get_secret_value()  # in the child's environment, never in its argv
        if value is not None:
            env[f"PAGEDQ_{name.upper()}"] = (str(value).lower() if isinstance(value, bool) else
                                             json.dumps(value) if isinstance(value, (list, dict)) else str(value))
    return env


class Stack:
    def __init__(self, settings: Settings, model: str | None = None, gpu_workers: int = 1, cpu_workers: int = 1,
                 log_dir: Path | None = None, reuse_workers: bool = False, loglevel: str = "INFO",
                 env: dict[str, str] | None = None, first_index: int = 0, replicas: int = 0, sentinels: int = 0,
                 down_after_ms: int = 2000) -> None:
        """``replicas`` and ``sentinels`` (both > 0): the embedded broker is a Sentinel topology of one master,
        that many replicas and sentinels (``down_after_ms``: how long a silent master has before a failover)."""
        self.settings = settings
        self.replicas, self.sentinels, self.down_after_ms = replicas, sentinels, down_after_ms
        self.model = model or settings.model
        self.num_gpu, self.num_cpu = gpu_workers, cpu_workers
        self.log_dir = log_dir
        self.reuse_workers = reuse_workers
        self.loglevel = loglevel
        self.env = env or {}
        self.names = Names.from_settings(settings)
        self.children: list[Child] = []
        self._started = first_index  # children ever started: a replacement gets a name (and log file) of its own
        self.reused: list[Reuse] = []  # with reuse_workers: the registered workers judged, alive or not
        self.url: str | None = None
        self.owns_broker = False  # started the embedded redis-server (and stops it)
        self._exit = ExitStack()

    def start(self, timeout: float = 600) -> Stack:
        try:
            broker = (ensure_topology(self.settings, self.replicas, self.sentinels, self.down_after_ms)
                      if self.replicas and self.sentinels else ensure_broker(self.settings))
            self.url, self.owns_broker = self._exit.enter_context(broker)
            gpu, cpu = self._workers_needed()
            for i in range(gpu):
                first = self.add_worker("gpu")
                if i == 0 and gpu > 1:  # it converts the packaged model on first use; the others then load it
                    self.wait_ready(timeout, [first])
            for _ in range(cpu):
                self.add_worker("cpu")
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _workers_needed(self) -> tuple[int, int]:
        if not self.reuse_workers:
            return self.num_gpu, self.num_cpu
        r = redis_client(self.url, settings=self.settings)
        served = engine_model_name(self.settings, self.model)  # what its GPU workers' records name
        serving = {host: rec for host, rec in live_workers(r, self.names).items() if rec.get("ready") == "1" and
                   (rec.get("role") == "cpu" or (rec.get("role") == "gpu" and rec.get("model") == served))}
        self.reused = judge_workers(r, self.names, serving, self.settings.worker_ttl_s)
        for verdict in self.reused:
            log.info("%s", verdict.line())
        alive = {v.role for v in self.reused if v.alive}
        return (0 if "gpu" in alive else self.num_gpu), (0 if "cpu" in alive else self.num_cpu)

    @property
    def workers_started(self) -> int:
        """Children ever started (names are numbered from it; a stack restarted after this one can go on)."""
        return self._started

    def _next_hostname(self, role: str) -> str:
        self._started += 1
        return worker_hostname(role, self._started - 1)

    def add_worker(self, role: str, extra_env: dict[str, str] | None = None, model: str | None = None) -> Child:
        """A GPU or CPU worker; a GPU worker serves ``model`` (default: the stack's)."""
        hostname = self._next_hostname(role)
        verb = "worker" if role == "gpu" else "cpu-worker"
        cmd = [sys.executable, "-m", "pagedq.pipeline.cli", verb, "--hostname", hostname, "--loglevel", self.loglevel]
        if role == "gpu":
            cmd += ["--model", model or self.model]
        log_path = None
        if self.log_dir:
            Path(self.log_dir).mkdir(parents=True, exist_ok=True)
            log_path = Path(self.log_dir) / f"{hostname.split('@')[0]}.log"
        env = {**settings_env(self.settings), **self.env, **(extra_env or {}), **self._broker_env()}
        child = Child(hostname, role, spawn(cmd, log_path, env), log_path)
        self.children.append(child)
        return child

    def _broker_env(self) -> dict[str, str]:
        """The broker a child uses: this stack's URL, and with a sentinel:// URL the master's name."""
        env = {"PAGEDQ_BROKER_URL": self.url}
        if self.url.startswith("sentinel://"):
            env["PAGEDQ_REDIS_MASTER_NAME"] = self.settings.redis_master_name
        return env

    def add_gateway(self, port: int, timeout: float = 120) -> Child:
        """The HTTP gateway (``pagedq serve``) on 127.0.0.1:``port``, once its /health answers."""
        import urllib.request

        hostname = self._next_hostname("http")
        log_path = Path(self.log_dir) / "http.log" if self.log_dir else None
        env = {**settings_env(self.settings), **self.env, **self._broker_env()}
        cmd = [sys.executable, "-m", "pagedq.pipeline.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
        child = Child(hostname, "http", spawn(cmd, log_path, env), log_path)
        self.children.append(child)
        deadline = time.monotonic() + timeout
        while True:
            if child.proc.poll() is not None:
                raise RuntimeError(f"the HTTP gateway exited with {child.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return child
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the HTTP gateway did not answer /health within {timeout} s")
            time.sleep(0.2)

    def wait_ready(self, timeout: float = 600, children: list[Child] | None = None) -> None:
        r = redis_client(self.url, settings=self.settings)
        pending = list(children or self.children)
        deadline = time.monotonic() + timeout
        while pending:
            for child in list(pending):
                if child.proc.poll() is not None:
                    raise RuntimeError(f"{child.role} worker {child.hostname} exited with {child.proc.returncode}"
                                       + (f"; see {child.log_path}" if child.log_path else ""))
                # its own record: a dead worker's of the same name says ready until it expires
                if r.hmget(self.names.worker(child.hostname), "ready", "pid") == ["1", str(child.proc.pid)]:
                    pending.remove(child)
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers not ready after {timeout} s: {[c.hostname for c in pending]}")
            time.sleep(0.1)

    def stop_worker(self, child: Child, timeout: float = 60) -> int | None:
        code = stop(child.proc, timeout)
        self.children.remove(child)
        return code

    def stop(self) -> None:
        for role in ("http", "gpu", "cpu"):  # the front door closes first
            group = [c for c in self.children if c.role == role]
            for child in group:
                if child.proc.poll() is None:
                    child.proc.terminate()  # warm shutdown; all of a role stop in parallel
            for child in group:
                wait_or_kill(child.proc, 60)
                self.children.remove(child)
        self._exit.close()

    def wait(self) -> Child:
        """Block until some child exits (``pagedq up`` runs until Ctrl-C or a crash)."""
        while True:
            for child in self.children:
                if child.proc.poll() is not None:
                    return child
            time.sleep(0.5)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
