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
    for name in ("model", "kv_cache_memory", "max_num_seqs", "max_num_batched_tokens", "block_size"):
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

        summary = run_queued(Path(args.input), Path(args.output), settings)
    print(json.dumps({k: v for k, v in summary.items() if k != "stats"}), file=sys.stderr)
    return 0


def _engine_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model name or local Hugging Face folder (default: the packaged SmolLM2)")
    p.add_argument("--kv-cache-memory", dest="kv_cache_memory", help="KV cache size, e.g. 2GiB")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--block-size", type=int)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedq", description="LLM serving behind a message queue")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run-batch", help="run an OpenAI Batch JSONL file")
    p.add_argument("-i", "--input", required=True)
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--offline", action="store_true", help="run an engine in this process, no queue")
    _engine_options(p)
    p.set_defaults(func=cmd_run_batch)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
