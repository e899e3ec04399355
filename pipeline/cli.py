"""The ``pagedq`` command line.

Each subcommand is a small function; ``build_parser`` wires them up.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pagedq.config import Settings


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {}
    for name in ("model", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "block_size",
                 "pipeline_stages", "tensor_parallel", "stage_master"):
        value = getattr(args, name, None)
        if value is not None:
            overrides[name] = value
    return Settings(**overrides)


def cmd_run_batch(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.offline:
        from pagedq.pipeline.batch import run_offline

        summary = run_offline(Path(args.input), Path(args.output), settings, args.model)
    else:
        from pagedq.pipeline.queued_batch import run_queued

        summary = run_queued(Path(args.input), args.output, settings, args.model)
    print(json.dumps({k: v for k, v in summary.items() if k != "stats"}), file=sys.stderr)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from pagedq.workers.gpu_worker import run_worker

    run_worker(_settings(args), args.model, args.hostname, args.loglevel)
    return 0


def cmd_cpu_worker(args: argparse.Namespace) -> int:
    from pagedq.pipeline.cpu_worker import run_cpu_worker

    run_cpu_worker(_settings(args), args.hostname, args.loglevel)
    return 0


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    import signal

    from pagedq.pipeline.local.stack import Stack

    # Ctrl-C and SIGTERM stop everything the same way (SIGINT too: a background shell may have ignored it).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    stack = Stack(_settings(args), args.model, args.gpu_workers, args.cpu_workers, loglevel=args.loglevel)
    try:
        stack.start()
        print(f"pagedq up: broker {stack.url}; {args.gpu_workers} GPU + {args.cpu_workers} CPU worker(s) ready. "
              "Ctrl-C stops all.", file=sys.stderr, flush=True)
        exited = stack.wait()
        print(f"{exited.role} worker {exited.hostname} exited ({exited.proc.returncode}); stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def _client(args: argparse.Namespace):
    from pagedq.pipeline.client import Client

    return Client(_settings(args))


def cmd_submit(args: argparse.Namespace) -> int:
    body = json.loads(args.body) if args.body else {}
    for name in ("model", "max_tokens", "temperature", "priority"):
        if getattr(args, name) is not None:
            body[name] = getattr(args, name)
    if args.text is not None:
        body["prompt" if args.completion else "messages"] = (
            args.text if args.completion else [{"role": "user", "content": args.text}])
    with _client(args) as client:
        job_id = client.submit(**body)
        if not args.wait:
            print(job_id)
            return 0
        print(json.dumps(client.result(job_id, args.timeout), indent=1))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    with _client(args) as client:
        print(json.dumps(asdict(client.status(args.job_id)), indent=1))
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(json.dumps(client.result(args.job_id, args.timeout), indent=1))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        print(client.cancel(args.job_id).state)
    return 0


def cmd_cache_invalidate(args: argparse.Namespace) -> int:
    with _client(args) as client:
        version = client.invalidate_cache(args.model)
    print(f"result cache of {args.model or client.settings.model}: version {version}; earlier entries unreachable")
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    with _client(args) as client:
        fingerprint = client.reload(args.model, args.timeout)
    print(f"reloaded; fingerprint {fingerprint}")
    return 0


def cmd_flower(args: argparse.Namespace) -> int:
    import os

    from pagedq.config.celery_app import make_celery
    from pagedq.store.connection import broker_url

    if args.unauthenticated_api:
        os.environ["FLOWER_UNAUTHENTICATED_API"] = "true"
    argv = ["flower", f"--port={args.port}", f"--address={args.address}", *args.flower_args]
    if args.basic_auth:
        argv.append(f"--basic-auth={args.basic_auth}")
    settings = _settings(args)
    return make_celery(settings, broker_url(settings)).start(argv) or 0


def _engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model name or local Hugging Face folder (default: the packaged SmolLM2)")
    p.add_argument("--kv-cache-memory", dest="kv_cache_memory", help="KV cache size, e.g. 2GiB")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--pipeline-stages", type=int, help="run the model as this many processes, layers split among them")
    p.add_argument("--tensor-parallel", type=int, help="split every layer across this many processes (per stage)")
    p.add_argument("--stage-master", help="HOST:PORT where separately started stages (pagedq stage) join; "
                   "default: spawn them locally")


def cmd_stage(args: argparse.Namespace) -> int:
    from pagedq.workers.parallel.stage import serve_stage

    return serve_stage(args.rank, args.stages, args.tensor_parallel, args.master, args.model, args.device,
                       args.threads)


def _worker_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hostname", help="Celery worker name (default <role>.<pid>@<host>)")
    p.add_argument("--loglevel", default="INFO")


def _client_commands(sub) -> None:
    p = sub.add_parser("submit", help="enqueue one request; prints its job id (or, with --wait, the result)")
    p.add_argument("text", nargs="?", help="the user message (or, with --completion, the prompt)")
    p.add_argument("--completion", action="store_true", help="a text completion, not a chat")
    p.add_argument("--body", help="OpenAI request fields as JSON, e.g. '{\"messages\": [...]}'")
    p.add_argument("--model")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--priority", type=int, help="0-9, 9 most urgent (default 5)")
    p.add_argument("--wait", action="store_true", help="wait and print the result")
    p.add_argument("--timeout", type=float)
    p.set_defaults(func=cmd_submit)
    for name, func, text in (("status", cmd_status, "a job's state, timestamps, attempts, error"),
                             ("result", cmd_result, "wait for a job's result and print it"),
                             ("cancel", cmd_cancel, "cancel a queued or running job")):
        p = sub.add_parser(name, help=text)
        p.add_argument("job_id")
        if name == "result":
            p.add_argument("--timeout", type=float)
        p.set_defaults(func=func)
    p = sub.add_parser("cache", help="the result cache")
    cache_sub = p.add_subparsers(dest="cache_command", required=True)
    p = cache_sub.add_parser("invalidate", help="make every cached result of a model unreachable")
    p.add_argument("--model", help="default: settings.model")
    p.set_defaults(func=cmd_cache_invalidate)
    p = sub.add_parser("reload", help="GPU workers reload a model's weights from its folder (prefix cache dropped)")
    p.add_argument("--model", help="default: settings.model")
    p.add_argument("--timeout", type=float, default=120)
    p.set_defaults(func=cmd_reload)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedq", description="LLM serving behind a message queue")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run-batch", help="run an OpenAI Batch JSONL file (through the queue, or --offline)")
    p.add_argument("-i", "--input", required=True)
    p.add_argument("-o", "--output", required=True, help="output JSONL ('-' for stdout)")
    p.add_argument("--offline", action="store_true", help="run an engine in this process, no queue")
    _engine_options(p)
    p.set_defaults(func=cmd_run_batch)

    p = sub.add_parser("worker", help="a GPU worker: one engine serving a model's queue")
    _engine_options(p)
    _worker_options(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("stage", help="join a model replica as one of its processes (a pipeline stage / shard)")
    p.add_argument("--rank", type=int, required=True,
                   help="1 .. S*T-1: shard rank %% T of stage rank // T (rank 0 is the worker or run-batch driving it)")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages in the replica")
    p.add_argument("--tensor-parallel", type=int, default=1, help="shards per stage")
    p.add_argument("--master", required=True, help="HOST:PORT of the driver's rendezvous (its --stage-master)")
    p.add_argument("--model", help="model name or local folder (default: what the driver serves)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: settings.device)")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.set_defaults(func=cmd_stage)

    p = sub.add_parser("cpu-worker", help="a CPU worker: preprocess and postprocess tasks")
    _worker_options(p)
    p.set_defaults(func=cmd_cpu_worker)

    p = sub.add_parser("up", help="Redis (embedded unless PAGEDQ_BROKER_URL) + GPU + CPU workers; Ctrl-C stops")
    _engine_options(p)
    p.add_argument("--gpu-workers", type=int, default=1)
    p.add_argument("--cpu-workers", type=int, default=1)
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=cmd_up)

    _client_commands(sub)

    p = sub.add_parser("flower", help="Flower, pointed at the broker (workers send events)")
    p.add_argument("--port", type=int, default=5555)
    p.add_argument("--address", default="127.0.0.1")
    p.add_argument("--basic-auth", help="user:password for the UI and API")
    p.add_argument("--unauthenticated-api", action="store_true",
                   help="serve /api/* without auth (sets FLOWER_UNAUTHENTICATED_API; local use only)")
    p.add_argument("flower_args", nargs="*", help="more Flower options, after --")
    p.set_defaults(func=cmd_flower)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except _user_errors() as e:
        print(f"pagedq {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[Exception], ...]:
    from pagedq.pipeline.client import JobFailedError, JobNotFoundError
    from pagedq.pipeline.protocol import RequestError
    from pagedq.store.connection import BrokerNotFoundError

    return (RequestError, JobFailedError, JobNotFoundError, BrokerNotFoundError, TimeoutError)


if __name__ == "__main__":
    sys.exit(main())
