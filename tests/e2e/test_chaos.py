"""The chaos scenarios of ``scripts/chaos.py``, smaller: every fault ends with 0 lost and 0 published twice."""

from __future__ import annotations

import chaos
import pytest


def check(row: chaos.Row, min_completed: int) -> None:
    print(chaos.HEADER + "\n" + row.line())
    assert row.lost == 0, f"{row.lost} job(s) never ended"
    assert row.twice == 0, f"{row.twice} job(s) published twice"
    assert row.completed >= min_completed
    assert row.completed + row.failed == row.submitted


def test_kill_gpu_worker():
    row = chaos.gpu_kill(jobs=8, tokens=64)
    check(row, 8)
    assert row.recover_s is not None and row.recover_s <= 30


def test_kill_cpu_worker():
    check(chaos.cpu_kill(jobs=24, tokens=8), 24)


def test_kill_one_pipeline_stage():
    row = chaos.stage_kill(jobs=6, tokens=64)
    check(row, 6)
    assert f"exit code {3}" in row.notes[0]


def test_kill_and_restart_redis():
    check(chaos.redis_kill(jobs=8, tokens=64), 8)


def test_sigterm_drains():
    row = chaos.sigterm(jobs=6, tokens=48)
    check(row, 6)
    finished, running = row.notes[0].split(" running")[0].split("/")
    assert int(finished) == int(running) > 0, "running jobs finish during the drain, not after a requeue"


def test_redis_paused():
    row = chaos.redis_pause(jobs=6, tokens=48, pause_s=8)
    check(row, 6)
    assert "BrokerUnavailable after" in row.notes[0]


@pytest.mark.parametrize("bad", [120])
def test_generated_bad_requests_and_garbage(bad):
    row = chaos.garbage(bad=bad, good=10)
    check(row, 10)
    assert row.notes[-1] == "workers alive"


def test_backlog_of_short_jobs():
    check(chaos.backlog(jobs=100), 100)
