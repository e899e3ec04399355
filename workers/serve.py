"""``pagedq worker --model M``: a GPU worker process.

Loads the model once, registers it in Redis, starts the engine's stepping
thread, then runs a Celery worker on the model's queue with a threads pool of
``worker_max_inflight`` (prefetch 1 each): that many generate tasks are in
flight at once, all feeding the one engine.  Any number of these, on any
hosts, may consume the same model queue.

    python -m pagedq.workers.serve --model HuggingFaceTB/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket

from celery import signals

from pagedq.config import Settings
from pagedq.config.celery_app import make_celery, mark_ready_on_start
from pagedq.config.jobstore import JobStore
from pagedq.config.names import Names
from pagedq.config.redis_server import broker_url, redis_client
from pagedq.config.registry import Heartbeat, register_model
from pagedq.workers.engine import LLMEngine
from pagedq.workers.service import WORKER_KEY_TTL_S, EngineService, model_info
from pagedq.workers.tasks import ControlListener, ProgressReporter, register_generate

log = logging.getLogger(__name__)


def default_hostname(role: str) -> str:
    return f"{role}.{os.getpid()}@{socket.gethostname()}"


def run_worker(settings: Settings, model: str | None = None, hostname: str | None = None,
               loglevel: str = "INFO") -> None:
    url = broker_url(settings)
    r = redis_client(url)
    names = Names.from_settings(settings)
    hostname = hostname or default_hostname("gpu")
    service = EngineService(lambda: LLMEngine(settings, model), r, names, hostname, settings.result_ttl_s,
                            on_replica_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))  # warm shutdown
    engine = service.start()  # built on the thread that will step it (see service.py)
    queue = names.generate_queue(engine.model_name)
    register_model(r, names, model_info(engine, names))
    worker_key = names.worker(hostname)
    Heartbeat(r, worker_key, {"role": "gpu", "model": engine.model_name, "pid": os.getpid(), "ready": 0},
              WORKER_KEY_TTL_S).start()
    app = make_celery(settings, url)
    register_generate(app, service, JobStore(r, names, settings.result_ttl_s), names)
    ControlListener(r, names, service).start()
    ProgressReporter(app, service, r, names, hostname, settings.progress_interval_s).start()
    signals.worker_shutting_down.connect(lambda **_: service.shutdown(), weak=False)
    mark_ready_on_start(r, worker_key)
    log.info("serving %s on queue %s as %s", engine.model_name, queue, hostname)
    try:
        app.worker_main(["worker", "--pool", "threads", "--concurrency", str(settings.worker_max_inflight),
                         "--queues", queue, "--hostname", hostname, "--without-gossip", "--without-mingle",
                         "--loglevel", loglevel])
    finally:
        engine.shutdown()  # a pipelined engine stops its stage processes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model name or local Hugging Face folder (default: settings.model)")
    p.add_argument("--hostname", help="Celery worker name (default gpu.<pid>@<host>)")
    p.add_argument("--loglevel", default="INFO")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pagedq worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    run_worker(Settings(), args.model, args.hostname, args.loglevel)


if __name__ == "__main__":
    main()
