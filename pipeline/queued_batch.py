"""``pagedq run-batch`` (without --offline): an OpenAI Batch file through the full queue pipeline.

Starts what is missing (embedded Redis, a GPU worker, a CPU worker; workers
already serving the model are reused), submits every line with the Python
producer, polls the batch, writes the output lines in input order, and stops
what it started.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from pagedq.config import Settings
from pagedq.pipeline.client import Client
from pagedq.pipeline.local.stack import Stack
from pagedq.pipeline.protocol import read_batch_file


def _progress(client: Client, batch_id: str, show: bool) -> None:
    from tqdm import tqdm

    status = client.batch_status(batch_id)
    with tqdm(total=status.total, desc="requests", unit="req", file=sys.stderr, disable=not show) as bar:
        while not status.done:
            time.sleep(0.25)
            status = client.batch_status(batch_id)
            bar.update(_finished(status) - bar.n)


def _finished(status) -> int:
    return status.completed + status.failed + status.cancelled + status.expired


def run_queued(input_path: Path, output_path: Path, settings: Settings, model: str | None = None,
               progress: bool = True) -> dict:
    lines = read_batch_file(input_path)
    log_dir = settings.state_dir / "logs"
    with Stack(settings, model, log_dir=log_dir, reuse_workers=True, loglevel="WARNING") as stack:
        with Client(settings, stack.url) as client:
            batch_id = client.submit_batch(lines)
            _progress(client, batch_id, progress)
            out = client.batch_results(batch_id)
            status = client.batch_status(batch_id)
    text = "".join(json.dumps(item) + "\n" for item in out)
    if str(output_path) == "-":
        sys.stdout.write(text)
    else:
        Path(output_path).write_text(text)
    return {"lines": len(lines), "completed": status.completed, "failed": len(lines) - status.completed,
            "batch_id": batch_id}
