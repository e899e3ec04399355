"""The ``pagedq`` command line.

Each subcommand is a small function; ``build_parser`` wires them up.  Every
error a user can cause prints one line, ``error: <field>: <message>``, and
exits non-zero (2 for a bad request or argument, 1 for a job that did not
complete or a broker that is not there, 130 for Ctrl-C); never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pagedq.config import Settings
from pagedq.config.served import default_model

# Settings a command line flag of the same name overrides (engine and worker commands).
ENGINE_FLAGS = ("model", "served_model_name", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens",
                "block_size", "pipeline_stages", "tensor_parallel", "stage_master")


class CliError(Exception):
    """A user-facing error: printed as ``error: <message>``."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _settings(args: argparse.Namespace, flags: tuple[str, ...] = ENGINE_FLAGS) -> Settings:
    if getattr(args, "config", None):
        if not Path(args.config).is_file():
            raise CliError(f"config: no such file: {args.config}")
        os.environ["PAGEDQ_CONFIG_FILE"] = str(args.config)
    overrides = {name: value for name in flags if (value := getattr(args, name, None)) is not None}
    try:
        return Settings(**overrides)
    except ValueError as e:  # pydantic's ValidationError is one
        raise CliError(_first_line(e)) from None


def _verify_broker(settings: Settings, consumer: bool = True) -> None:
    """Check the broker (maxmemory-policy, version, not Cluster, the user's permissions) before anything starts
    or loads a model: an unsuitable one is refused with one line (``store/redis_check.py``)."""
    from pagedq.store.connection import broker_url
    from pagedq.store.redis_check import verify_broker

    verify_broker(broker_url(settings), settings, consumer)


def _first_line(e: Exception) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        err = errors()[0]
        return f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
    return str(e).splitlines()[0]


# --- processes ---------------------------------------------------------------------------------------------
def cmd_run_batch(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not Path(args.input).is_file():
        raise CliError(f"input: no such file: {args.input}")
    if args.offline:
        from pagedq.pipeline.batch import run_offline

        summary = run_offline(Path(args.input), Path(args.output), settings, args.model)
    else:
        if settings.broker_url:  # an existing broker; an embedded one is pagedq's own, configured right
            _verify_broker(settings)
        from pagedq.pipeline.queued_batch import run_queued

        summary = run_queued(Path(args.input), args.output, settings, args.model)
    print(json.dumps({k: v for k, v in summary.items() if k != "stats"}), file=sys.stderr)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from pagedq.workers.cpu_budget import set_omp_spin_count

    settings = _settings(args)
    _verify_broker(settings)
    set_omp_spin_count(settings.omp_spin_count)  # before torch loads libgomp
    from pagedq.workers.gpu_worker import run_worker

    return _run_worker_process(lambda: run_worker(settings, args.model, args.hostname, args.loglevel))


def cmd_cpu_worker(args: argparse.Namespace) -> int:
    from pagedq.pipeline.cpu_worker import run_cpu_worker

    settings = _settings(args)
    _verify_broker(settings)
    return _run_worker_process(lambda: run_cpu_worker(settings, args.hostname, args.loglevel))


def _run_worker_process(run) -> int:
    """Run a worker; once it has stopped, end the process at once (see ``exit_process``)."""
    from pagedq.workers.processes import exit_process

    try:
        code = run()
    except SystemExit as e:
        code = e.code
    exit_process(code)


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    import signal

    from pagedq.pipeline.local.stack import Stack
    from pagedq.store.connection import mask_url

    # Ctrl-C and SIGTERM stop everything the same way (SIGINT too: a background shell may have ignored it).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    settings = _settings(args)
    if (args.replicas > 0) != (args.sentinels > 0):
        raise CliError("--replicas and --sentinels go together: a Sentinel topology needs both (e.g. 1 and 3)")
    if args.replicas and settings.broker_url:
        raise CliError("--replicas/--sentinels start a local Sentinel topology; PAGEDQ_BROKER_URL is set")
    if settings.broker_url:  # an existing broker; an embedded one is pagedq's own, configured right
        _verify_broker(settings)
    stack = Stack(settings, args.model, args.gpu_workers, args.cpu_workers, loglevel=args.loglevel,
                  reuse_workers=True, replicas=args.replicas, sentinels=args.sentinels,
                  down_after_ms=args.down_after_ms)
    try:
        stack.start()
        if args.http is not None:
            stack.add_gateway(args.http)
            print(f"pagedq up: OpenAI-compatible API on http://127.0.0.1:{args.http}/v1", file=sys.stderr)
        joined = "" if stack.owns_broker else " (joined the running broker)"
        for verdict in stack.reused:  # registered workers: reused only when shown alive
            print(f"pagedq up: {verdict.line()}", file=sys.stderr)
        started = sum(c.role == "gpu" for c in stack.children), sum(c.role == "cpu" for c in stack.children)
        reused = [v.hostname for v in stack.reused if v.alive]
        reusing = f" (reusing {', '.join(reused)})" if reused else ""
        print(f"pagedq up: broker {mask_url(stack.url)}{joined}; started {started[0]} GPU + {started[1]} CPU "
              f"worker(s){reusing}. Ctrl-C stops what this command started.", file=sys.stderr, flush=True)
        exited = stack.wait()
        print(f"{exited.role} worker {exited.hostname} exited ({exited.proc.returncode}); stopping", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedq.pipeline.gateway.serve import serve

    settings = _settings(args, (*ENGINE_FLAGS, "gateway_limit_concurrency"))
    _verify_broker(settings, consumer=False)
    return serve(settings, args.host, args.port, args.workers, args.log_level,
                 api_keys_file=args.api_keys_file, max_request_bytes=args.max_request_bytes,
                 max_file_bytes=args.max_file_bytes)


def cmd_stage(args: argparse.Namespace) -> int:
    from pagedq.workers.cpu_budget import set_omp_spin_count

    set_omp_spin_count(_settings(args).omp_spin_count)  # stages a worker spawns inherit its GOMP_SPINCOUNT
    from pagedq.workers.parallel.stage import serve_stage

    return _run_worker_process(lambda: serve_stage(args.rank, args.stages, args.tensor_parallel, args.master,
                                                   args.model, args.device, args.threads))


def cmd_flower(args: argparse.Namespace) -> int:
    from pagedq.config.celery_app import make_celery
    from pagedq.store.connection import broker_url

    # Auth reaches Flower through its environment (FLOWER_BASIC_AUTH), never through its argv.
    if args.basic_auth:
        print("pagedq flower: --basic-auth puts the password in this process's argv; prefer FLOWER_BASIC_AUTH",
              file=sys.stderr)
        os.environ["FLOWER_BASIC_AUTH"] = args.basic_auth
    authenticated = bool(os.environ.get("FLOWER_BASIC_AUTH") or os.environ.get("FLOWER_AUTH"))
    if args.address not in ("127.0.0.1", "localhost", "::1") and (not authenticated or args.unauthenticated_api):
        raise CliError(f"address: Flower on {args.address} (beyond loopback) needs auth: set FLOWER_BASIC_AUTH="
                       "user:password (and no --unauthenticated-api)")
    if args.unauthenticated_api:
        os.environ["FLOWER_UNAUTHENTICATED_API"] = "true"
    argv = ["flower", f"--port={args.port}", f"--address={args.address}", *args.flower_args]
    settings = _settings(args)
    return make_celery(settings, broker_url(settings)).start(argv) or 0


# --- the producer's commands ---------------------------------------------------------------------------------
def _client(args: argparse.Namespace):
    from pagedq.pipeline.client import Client

    return Client(_settings(args, flags=()))  # --model names the request's model, not the client's default


def _body(args: argparse.Namespace) -> dict:
    try:
        body = json.loads(args.body) if args.body else {}
    except json.JSONDecodeError as e:
        raise CliError(f"body: not valid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(body, dict):
        raise CliError(f"body: must be a JSON object of request fields, not {type(body).__name__}")
    fields = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature,
              "top_p": args.top_p, "seed": args.seed, "priority": args.priority, "stop": args.stop or None}
    body.update({k: v for k, v in fields.items() if v is not None})
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.stream:
        body["stream"] = True
    if args.text is not None:
        if args.completion:
            body["prompt"] = args.text
        else:
            body["messages"] = [{"role": "user", "content": args.text}]
    return body


def cmd_submit(args: argparse.Namespace) -> int:
    body = _body(args)
    with _client(args) as client:
        job_id = client.submit(**body)
        with _waiting(job_id):  # from here on, Ctrl-C says how to follow the job
            # Waiting: the id goes first, to stderr, so stdout stays the result (JSON) for scripts.
            print(job_id, file=sys.stderr if args.wait or args.stream else sys.stdout, flush=True)
            if args.stream:
                for delta in client.stream(job_id, timeout=args.timeout):
                    print(delta, end="", file=sys.stderr, flush=True)
                print(file=sys.stderr)
            if args.wait or args.stream:
                print(json.dumps(client.result(job_id, args.timeout), indent=1))
    return 0


class _waiting:
    """Ctrl-C while waiting for a job: say how to follow or cancel it, exit 130.

    The SIGINT handler exits from the handler itself rather than raising KeyboardInterrupt into whatever redis
    call is in progress (a half-read reply or a lock taken mid-call could then hang the way out); the job lives
    in Redis, so there is nothing to clean up.  It is installed even where the shell started us with SIGINT
    ignored.
    """

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id

    def __enter__(self) -> None:
        import signal

        self._previous = signal.signal(signal.SIGINT, self._interrupted)

    def __exit__(self, *exc) -> bool:
        import signal

        signal.signal(signal.SIGINT, self._previous)
        return False

    def _interrupted(self, *_) -> None:
        print(f"\ninterrupted; job {self.job_id} goes on. Follow it with `pagedq status {self.job_id}` or "
              f"`pagedq result {self.job_id}`; stop it with `pagedq cancel {self.job_id}`", file=sys.stderr, flush=True)
        os._exit(130)


def _iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds")


def _readable(status) -> dict:
    d = asdict(status)
    for key in [k for k in d if k.endswith("_at")]:
        d[key] = _iso(d[key])
    return {k: v for k, v in d.items() if v is not None}


def cmd_status(args: argparse.Namespace) -> int:
    if args.job_id is None:  # no job: the whole deployment
        return cmd_deployment_status(args)
    if args.watch is not None:
        raise CliError("watch: only without a job id (the deployment view)")
    with _client(args) as client:
        status = client.status(args.job_id)
    # JSON either way (scripts pipe it to jq); times as ISO 8601 for people, unix seconds with --json.
    print(json.dumps(asdict(status) if args.json else _readable(status), indent=1))
    return 0


def cmd_deployment_status(args: argparse.Namespace) -> int:
    """``pagedq status`` without a job id: workers, queues, jobs on one screen, from Redis only."""
    import time

    import redis

    from pagedq.config.names import Names
    from pagedq.pipeline.status import connect, render, snapshot
    from pagedq.store.connection import BrokerUnavailable, mask_url

    if args.watch is not None and args.watch <= 0:
        raise CliError("watch: must be a number of seconds > 0")
    settings = _settings(args, flags=())
    r, url = connect(settings)
    names = Names.from_settings(settings)
    try:
        while True:
            try:
                snap = snapshot(r, names, mask_url(url))
            except (redis.RedisError, OSError) as e:
                if args.watch is None:
                    raise BrokerUnavailable(f"cannot read {mask_url(url)}: {_first_line(e)}") from None
                print(f"error: broker: cannot read {mask_url(url)}: {_first_line(e)} (retrying)",
                      file=sys.stderr)
            else:
                if args.json:
                    print(json.dumps(snap.as_dict(), indent=None if args.watch else 1), flush=True)
                else:
                    clear = "\x1b[H\x1b[2J" if args.watch and sys.stdout.isatty() else ""
                    print(clear + render(snap) + ("\n" if args.watch and not clear else ""), flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def cmd_exporter(args: argparse.Namespace) -> int:
    import signal

    from pagedq.config.names import Names
    from pagedq.pipeline.exporter import run_exporter
    from pagedq.pipeline.status import connect
    from pagedq.store.connection import mask_url

    if args.jobs_interval <= 0:
        raise CliError("jobs-interval: must be a number of seconds > 0")
    settings = _settings(args, flags=())
    r, url = connect(settings)
    signal.signal(signal.SIGTERM, _interrupt)
    print(f"pagedq exporter: broker {mask_url(url)}; metrics at http://{args.address}:{args.port}/metrics",
          file=sys.stderr, flush=True)
    try:
        run_exporter(r, Names.from_settings(settings), args.port, args.address, args.jobs_interval)
    except OSError as e:
        raise CliError(f"port: cannot listen on {args.address}:{args.port}: {e.strerror or e}",
                       code=1) from None
    except KeyboardInterrupt:
        return 0
    return 0


def cmd_result(args: argparse.Namespace) -> int:
    with _client(args) as client, _waiting(args.job_id):
        print(json.dumps(client.result(args.job_id, args.timeout), indent=1))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        before = client.status(args.job_id)
        if before.done:
            raise CliError(f"job_id: job {args.job_id} already {before.state}; nothing to cancel", code=1)
        print(client.cancel(args.job_id).state)
    return 0


def cmd_cache_invalidate(args: argparse.Namespace) -> int:
    with _client(args) as client:
        model = args.model or default_model(client.settings)
        served = client.served_models()
        if model not in served and model != default_model(client.settings):
            raise CliError(f"model: unknown model {model!r}; served: {served}")
        version_ = client.invalidate_cache(model)
    print(f"result cache of {model}: version {version_}; earlier entries unreachable")
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    with _client(args) as client:
        fingerprint = client.reload(args.model, args.timeout)
    print(f"reloaded; fingerprint {fingerprint}")
    return 0


# --- batches --------------------------------------------------------------------------------------------------
def cmd_batch_submit(args: argparse.Namespace) -> int:
    if not Path(args.input).is_file():
        raise CliError(f"input: no such file: {args.input}")
    with _client(args) as client:
        batch_id = client.submit_batch(Path(args.input), priority=args.priority)
        print(batch_id, flush=True)
        if args.wait:
            with _waiting(batch_id):
                client.wait_batch(batch_id, args.timeout)
            _write_lines(client.batch_results(batch_id), args.output)
    return 0


def cmd_batch_status(args: argparse.Namespace) -> int:
    with _client(args) as client:
        status = client.batch_status(args.batch_id)
    d = asdict(status) | {"created_at": _iso(status.created_at), "completed_at": _iso(status.completed_at)}
    print(json.dumps(d, indent=1))
    return 0


def cmd_batch_results(args: argparse.Namespace) -> int:
    with _client(args) as client, _waiting(args.batch_id):
        _write_lines(client.batch_results(args.batch_id, args.timeout), args.output)
    return 0


def cmd_batch_cancel(args: argparse.Namespace) -> int:
    with _client(args) as client:
        job_ids = client.r.lrange(client.names.batch_jobs(args.batch_id), 0, -1)
        if not job_ids:
            raise CliError(f"batch_id: no batch {args.batch_id}", code=1)
        states = [client.cancel(job_id).state for job_id in job_ids if not client.status(job_id).done]
    print(f"cancelling {len(states)} of {len(job_ids)} job(s); the others had ended")
    return 0


def _write_lines(lines: list[dict], output: str) -> None:
    text = "".join(json.dumps(line) + "\n" for line in lines)
    if output == "-":
        sys.stdout.write(text)
    else:
        Path(output).write_text(text)


# --- the parser -----------------------------------------------------------------------------------------------
def _engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model name or local Hugging Face folder (default: PAGEDQ_MODEL, the packaged "
                                   "SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", dest="served_model_name", action="extend", nargs="+", metavar="NAME",
                   help="a name requests call the model by (repeat, or give several): the first is the model's "
                        "name everywhere, the others aliases (default: PAGEDQ_SERVED_MODEL_NAME, else --model)")
    p.add_argument("--kv-cache-memory", dest="kv_cache_memory", help="KV cache size in bytes, e.g. 2GiB (default 2GiB)")
    p.add_argument("--max-num-seqs", type=int, help="sequences in the running batch at most (default 256)")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens computed in one step at most (default 1024)")
    p.add_argument("--block-size", type=int, help="tokens per KV cache block (default 16)")
    p.add_argument("--pipeline-stages", type=int, help="run the model as this many processes, layers split among "
                                                       "them (default 1)")
    p.add_argument("--tensor-parallel", type=int, help="split every layer across this many processes per stage "
                                                       "(default 1)")
    p.add_argument("--stage-master", help="HOST:PORT where separately started stages (pagedq stage) join "
                                          "(default: spawn them locally)")


def _worker_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hostname", help="Celery worker name (default <role>.<pid>@<host>)")
    p.add_argument("--loglevel", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default INFO)")


def _timeout(p: argparse.ArgumentParser, what: str = "the job") -> None:
    p.add_argument("--timeout", type=float, default=None,
                   help=f"seconds to wait for {what} before giving up (default: PAGEDQ_WAIT_TIMEOUT_S, 3600; "
                        "the job goes on)")


def _client_commands(sub) -> None:
    p = sub.add_parser("submit", help="enqueue one request; prints its job id (then, with --wait, the result)")
    p.add_argument("text", nargs="?", help="the user message (or, with --completion, the prompt)")
    p.add_argument("--completion", action="store_true", help="a text completion of TEXT, not a chat")
    p.add_argument("--body", help="OpenAI request fields as a JSON object, e.g. '{\"messages\": [...]}'; "
                                  "flags override its fields")
    p.add_argument("--model", help="the model to ask (default: PAGEDQ_MODEL)")
    p.add_argument("--max-tokens", type=int, help="tokens to generate at most (default 256)")
    p.add_argument("--temperature", type=float, help="0 = greedy, up to 2 (default 1)")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass, (0, 1] (default 1)")
    p.add_argument("--seed", type=int, help="a fixed sampling seed, 0 .. 2^63-1 (default: none)")
    p.add_argument("--stop", action="append", help="a stop string (repeat for several; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="generate past the end-of-sequence token")
    p.add_argument("--priority", type=int, help="0-9, 9 most urgent (default 5)")
    p.add_argument("--stream", action="store_true", help="print the text to stderr as it is generated, then the "
                                                         "result")
    p.add_argument("--wait", action="store_true", help="wait and print the result on stdout (the job id goes to stderr first)")
    _timeout(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("status", help="a job's state, timestamps (ISO 8601, UTC), attempts, tokens, error; "
                                      "without a job id: workers, queues by priority, jobs by state")
    p.add_argument("job_id", nargs="?", help="a job id (default: none, the whole deployment)")
    p.add_argument("--json", action="store_true", help="the job's raw record, or the deployment snapshot, as "
                                                       "JSON (times as unix seconds; --watch: one per line)")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, metavar="SECONDS",
                   help="redraw the deployment view every SECONDS until Ctrl-C (default: once; 2 s if no "
                        "value)")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("result", help="wait for a job's result and print it")
    p.add_argument("job_id")
    _timeout(p)
    p.set_defaults(func=cmd_result)
    p = sub.add_parser("cancel", help="cancel a queued or running job (exit 1 if it had already ended)")
    p.add_argument("job_id")
    p.set_defaults(func=cmd_cancel)

    p = sub.add_parser("batch", help="OpenAI Batch files through the queue: submit, status, results, cancel")
    batch = p.add_subparsers(dest="batch_command", required=True)
    p = batch.add_parser("submit", help="enqueue every line of a JSONL file; prints the batch id")
    p.add_argument("-i", "--input", required=True, help="OpenAI Batch input file (JSONL)")
    p.add_argument("--priority", type=int, help="0-9 for every line (default: each line's, else 5)")
    p.add_argument("--wait", action="store_true", help="wait, then write the output lines")
    p.add_argument("-o", "--output", default="-", help="where --wait writes output lines ('-' = stdout, default)")
    _timeout(p, "the batch")
    p.set_defaults(func=cmd_batch_submit)
    p = batch.add_parser("status", help="a batch's counts and times")
    p.add_argument("batch_id")
    p.set_defaults(func=cmd_batch_status)
    p = batch.add_parser("results", help="wait for a batch and write its output lines, in input order")
    p.add_argument("batch_id")
    p.add_argument("-o", "--output", default="-", help="output JSONL ('-' = stdout, default)")
    _timeout(p, "the batch")
    p.set_defaults(func=cmd_batch_results)
    p = batch.add_parser("cancel", help="cancel every job of a batch that has not ended")
    p.add_argument("batch_id")
    p.set_defaults(func=cmd_batch_cancel)

    p = sub.add_parser("cache", help="the result cache")
    cache_sub = p.add_subparsers(dest="cache_command", required=True)
    p = cache_sub.add_parser("invalidate", help="make every cached result of a model unreachable")
    p.add_argument("--model", help="a served model (default: PAGEDQ_MODEL)")
    p.set_defaults(func=cmd_cache_invalidate)
    p = sub.add_parser("reload", help="GPU workers reload a model's weights from its folder (prefix cache dropped)")
    p.add_argument("--model", help="a served model (default: PAGEDQ_MODEL)")
    p.add_argument("--timeout", type=float, default=120, help="seconds to wait for a worker to reload (default 120)")
    p.set_defaults(func=cmd_reload)


def _version() -> str:
    try:
        return version("pagedq")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedq", description="LLM serving behind a message queue")
    parser.add_argument("--version", action="version", version=f"pagedq {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO (default: warnings only)")
    parser.add_argument("--config", help="a TOML settings file (as PAGEDQ_CONFIG_FILE; default: none)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run-batch", help="run an OpenAI Batch JSONL file (through the queue, or --offline)")
    p.add_argument("-i", "--input", required=True, help="OpenAI Batch input file (JSONL)")
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
    p.add_argument("--tensor-parallel", type=int, default=1, help="shards per stage (default 1)")
    p.add_argument("--master", required=True, help="HOST:PORT of the driver's rendezvous (its --stage-master)")
    p.add_argument("--model", help="model name or local folder (default: what the driver serves)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto (default: PAGEDQ_DEVICE, auto)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: all cores)")
    p.set_defaults(func=cmd_stage)

    p = sub.add_parser("cpu-worker", help="a CPU worker: preprocess and postprocess tasks")
    _worker_options(p)
    p.set_defaults(func=cmd_cpu_worker)

    p = sub.add_parser("up", help="Redis (embedded unless PAGEDQ_BROKER_URL) + GPU + CPU workers; Ctrl-C stops")
    _engine_options(p)
    p.add_argument("--gpu-workers", type=int, default=1, help="GPU workers to start (default 1)")
    p.add_argument("--cpu-workers", type=int, default=1, help="CPU workers to start (default 1)")
    p.add_argument("--loglevel", default="INFO", help="the workers' log level (default INFO)")
    p.add_argument("--http", type=int, nargs="?", const=8000, metavar="PORT",
                   help="also serve the OpenAI-compatible HTTP API on 127.0.0.1:PORT (default port 8000)")
    p.add_argument("--replicas", type=int, default=0, help="with --sentinels: the embedded broker is a master, "
                   "this many replicas and the sentinels, all on 127.0.0.1 (default 0: one redis-server)")
    p.add_argument("--sentinels", type=int, default=0, help="with --replicas: Redis sentinels that fail over to a "
                   "replica when the master is down (3 is usual; default 0)")
    p.add_argument("--down-after-ms", type=int, default=2000, help="with --sentinels: milliseconds a master may "
                   "stay silent before the sentinels fail over (default 2000; kept in each sentinel's config "
                   "once it is written)")
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP gateway (FastAPI under uvicorn); see docs/http.md")
    p.add_argument("--host", default="127.0.0.1", help="without API keys only a loopback address is allowed")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000)")
    p.add_argument("--workers", type=int, default=1, help="uvicorn worker processes (the gateway is stateless)")
    p.add_argument("--api-keys-file", help="JSON or TOML file of hashed API keys (default: PAGEDQ_API_KEYS_FILE)")
    p.add_argument("--model", help="the default model (requests without one, /ready)")
    p.add_argument("--max-request-bytes", help="largest JSON request body, e.g. 4MiB (default; 413 beyond)")
    p.add_argument("--max-file-bytes", help="largest file upload, e.g. 64MiB (default; 413 beyond)")
    p.add_argument("--limit-concurrency", type=int, dest="gateway_limit_concurrency",
                   help="completion requests each worker process serves at once; beyond it 503 with Retry-After, "
                        "before any job is created (default: PAGEDQ_GATEWAY_LIMIT_CONCURRENCY, 2048)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    p.set_defaults(func=cmd_serve)

    _client_commands(sub)

    p = sub.add_parser("flower", help="Flower, pointed at the broker (workers send events)")
    p.add_argument("--port", type=int, default=5555, help="TCP port (default 5555)")
    p.add_argument("--address", default="127.0.0.1", help="listen address (default 127.0.0.1; any other needs "
                                                         "FLOWER_BASIC_AUTH)")
    p.add_argument("--basic-auth", help="user:password for the UI and API (prefer the FLOWER_BASIC_AUTH variable: "
                                        "a flag's value is visible in the process list)")
    p.add_argument("--unauthenticated-api", action="store_true",
                   help="serve /api/* without auth (sets FLOWER_UNAUTHENTICATED_API; loopback only)")
    p.add_argument("flower_args", nargs="*", help="more Flower options, after --")
    p.set_defaults(func=cmd_flower)

    p = sub.add_parser("exporter", help="deployment-level Prometheus metrics at /metrics (queues by "
                                        "priority, jobs by state, live workers), read from Redis; one per "
                                        "deployment")
    p.add_argument("--port", type=int, default=9300, help="TCP port (default 9300)")
    p.add_argument("--address", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--jobs-interval", type=float, default=10.0,
                   help="seconds between two reads of what needs a SCAN: job records, workers, models "
                        "(default 10; queue lengths are read at every scrape)")
    p.set_defaults(func=cmd_exporter)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a user sees one line; --verbose adds the traceback
        code, message = _user_error(e)
        if code is None:
            raise
        if args.verbose:
            logging.exception("pagedq %s", args.command)
        print(f"error: {message}", file=sys.stderr)
        return code


def _user_error(e: Exception) -> tuple[int | None, str]:
    """(exit code, one line) for errors a user can cause; (None, "") for a bug, which keeps its traceback."""
    from pagedq.pipeline.client import JobFailedError, JobNotFoundError
    from pagedq.pipeline.protocol import RequestError
    from pagedq.store.connection import BrokerNotFoundError, BrokerUnavailable
    from pagedq.store.redis_check import RedisUnsuitable

    if isinstance(e, RequestError):
        return 2, str(e) if e.param and str(e).startswith(e.param) else f"{e.param or 'request'}: {e}"
    if isinstance(e, JobNotFoundError):
        return 1, f"job_id: no job {e.args[0]} (unknown, or its record expired)"
    if isinstance(e, JobFailedError):
        return 1, f"job: {e}"
    if isinstance(e, (BrokerNotFoundError, BrokerUnavailable, RedisUnsuitable)):
        return 1, f"broker: {e}"
    if isinstance(e, TimeoutError):
        return 1, f"timeout: {e}"
    if isinstance(e, (FileNotFoundError, IsADirectoryError, PermissionError)):
        return 2, f"file: {e}"
    if isinstance(e, (ValueError, TypeError)):  # settings, arguments
        return 2, _first_line(e)
    return None, ""


if __name__ == "__main__":
    sys.exit(main())
