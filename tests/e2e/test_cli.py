"""The command line: validates like the Client, one-line errors, never a traceback (real redis-server, no workers)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pagedq.config import Settings
from pagedq.config.names import JobState
from pagedq.pipeline import Client

PREFIX = "pcl"


@pytest.fixture(scope="module")
def env(redis_url) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_")}
    return {**base, "PAGEDQ_BROKER_URL": redis_url, "PAGEDQ_KEY_PREFIX": f"{PREFIX}:",
            "PAGEDQ_QUEUE_PREFIX": f"{PREFIX}.", "PAGEDQ_RESULT_CACHE": "false"}


@pytest.fixture(scope="module")
def client(redis_url):
    settings = Settings(broker_url=redis_url, key_prefix=f"{PREFIX}:", queue_prefix=f"{PREFIX}.", result_cache=False)
    with Client(settings, redis_url) as c:
        yield c


def pagedq(env: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def keys(client: Client) -> set[str]:
    return set(client.r.scan_iter(match=f"{PREFIX}:*", count=1000))


def assert_one_line_error(done: subprocess.CompletedProcess, field: str) -> None:
    assert done.returncode != 0, done
    assert "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert lines and lines[-1].startswith(f"error: {field}"), done.stderr


BAD_INVOCATIONS = [
    (["submit", "--body", '{"messages": [oops'], "body: not valid JSON"),
    (["submit", "--body", "[1, 2]"], "body: must be a JSON object"),
    (["submit", "hi", "--model", "gpt-4"], "model: unknown model 'gpt-4'"),
    (["submit", "hi", "--temperature", "7"], "temperature"),
    (["submit", "hi", "--seed", "-1"], "seed"),
    (["submit", "--completion", "x" * 10, "--max-tokens", "0"], "max_tokens"),
    (["submit"], "messages"),
    (["run-batch", "-i", "missing.jsonl", "-o", "out.jsonl"], "input: no such file"),
    (["batch", "submit", "-i", "missing.jsonl"], "input: no such file"),
    (["cache", "invalidate", "--model", "gpt-4"], "model: unknown model 'gpt-4'"),
    (["status", "no-such-job"], "job_id: no job"),
    (["result", "no-such-job"], "job_id: no job"),
    (["--config", "/nonexistent.toml", "status", "x"], "config: no such file"),
]


@pytest.mark.parametrize("argv, message", BAD_INVOCATIONS, ids=[" ".join(a)[:40] for a, _ in BAD_INVOCATIONS])
def test_bad_invocations_print_one_error_line_and_enqueue_nothing(env, client, argv, message):
    before = keys(client)
    done = pagedq(env, *argv)
    assert_one_line_error(done, message)
    assert keys(client) == before, "nothing was written"


def test_an_unknown_setting_is_named_with_the_closest_one(env):
    done = pagedq({**env, "PAGEDQ_MAX_TOKENS": "5"}, "status", "x")
    assert_one_line_error(done, "unknown setting PAGEDQ_MAX_TOKENS")


def test_result_of_a_cancelled_job_and_cancel_of_a_finished_one(env, client):
    job = client.submit(prompt="never run", max_tokens=4)
    done = pagedq(env, "cancel", job)
    assert done.returncode == 0 and done.stdout.strip() == "cancelled"
    assert_one_line_error(pagedq(env, "result", job), "job: job")
    again = pagedq(env, "cancel", job)
    assert_one_line_error(again, "job_id: job")
    assert "already cancelled" in again.stderr


def test_status_prints_iso_times_and_json(env, client):
    job = client.submit(prompt="look at me", max_tokens=4, priority=7)
    client.store.finish(job, JobState.COMPLETED, result={"ok": True})
    done = pagedq(env, "status", job)
    assert done.returncode == 0
    fields = json.loads(done.stdout)
    assert fields["state"] == "completed" and fields["priority"] == 7
    assert fields["created_at"].endswith("+00:00") and "T" in fields["created_at"]
    record = json.loads(pagedq(env, "status", job, "--json").stdout)
    assert record["state"] == "completed" and isinstance(record["created_at"], float)
    assert_one_line_error(pagedq(env, "cancel", job), "job_id: job")


def test_ctrl_c_while_waiting_prints_the_job_id_and_how_to_follow_it(env, client):
    proc = subprocess.Popen([sys.executable, "-m", "pagedq.pipeline.cli", "submit", "no worker will answer",
                             "--wait"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:  # the job id is printed (to stderr) before the wait starts
        seen.append(line)
        if re.fullmatch(r"[0-9a-f]{32}", line.strip()):
            break
    job = seen[-1].strip()
    assert re.fullmatch(r"[0-9a-f]{32}", job), seen
    assert client.status(job).state == "queued"
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    out, rest = proc.communicate(timeout=30)
    err = "".join(seen) + rest
    assert proc.returncode == 130 and "Traceback" not in err
    assert f"pagedq cancel {job}" in err and f"pagedq status {job}" in err
    client.cancel(job)


def test_batch_commands(env, client, tmp_path):
    lines = [{"custom_id": f"c{i}", "url": "/v1/completions", "body": {"prompt": f"p{i}", "max_tokens": 2}}
             for i in range(3)]
    lines.append({"custom_id": "bad", "url": "/v1/completions", "body": {"prompt": "p", "top_p": 0}})
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    done = pagedq(env, "batch", "submit", "-i", str(src))
    assert done.returncode == 0, done.stderr
    batch = done.stdout.strip()
    status = json.loads(pagedq(env, "batch", "status", batch).stdout)
    assert status["total"] == 4 and status["failed"] == 1 and status["status"] == "in_progress"
    done = pagedq(env, "batch", "cancel", batch)
    assert done.returncode == 0 and "cancelling 3 of 4" in done.stdout
    out = pagedq(env, "batch", "results", batch, "--timeout", "30")
    results = [json.loads(x) for x in out.stdout.splitlines()]
    assert [r["custom_id"] for r in results] == ["c0", "c1", "c2", "bad"]
    assert [r["error"]["code"] for r in results] == ["cancelled"] * 3 + ["invalid_request_error"]


def test_version_and_help_text_on_every_option():
    done = subprocess.run([sys.executable, "-m", "pagedq.pipeline.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("pagedq ")
    from pagedq.pipeline.cli import build_parser

    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if action.choices and isinstance(action.choices, dict):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif action.option_strings and not action.help:
                missing.append(f"{path} {action.option_strings[0]}")
    walk(build_parser(), "pagedq")
    assert not missing, f"options without help text: {missing}"
