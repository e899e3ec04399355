"""The container images build and their `pagedq` runs, where a Docker engine is at hand.

Without one (no `docker` on PATH, or a client whose engine does not answer, as on this development machine)
the test is skipped, saying which: the images' contents are still checked by parsing
(tests/unit/test_deploy_files.py: every folder of the package map is copied).
"""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(3600)
def test_the_cpu_image_builds_and_its_cli_runs():
    if shutil.which("docker") is None:
        pytest.skip("docker is not on PATH: the image is not built here (its COPY lines are checked by "
                    "tests/unit/test_deploy_files.py)")
    engine = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True,
                            text=True, timeout=60)
    if engine.returncode != 0:
        pytest.skip(f"docker is on PATH but no Docker engine answers: {engine.stderr.strip().splitlines()[-1:]}")
    tag = f"pagedq-test:{uuid.uuid4().hex[:12]}"
    build = subprocess.run(["docker", "build", "-f", "docker/Dockerfile", "-t", tag, "."], cwd=ROOT,
                           capture_output=True, text=True, timeout=3000)
    assert build.returncode == 0, build.stderr[-4000:]
    try:
        ran = subprocess.run(["docker", "run", "--rm", tag, "pagedq", "--help"], capture_output=True, text=True,
                             timeout=300)
        assert ran.returncode == 0, ran.stderr[-4000:]
        for verb in ("worker", "cpu-worker", "serve", "run-batch"):
            assert verb in ran.stdout
        # the fleet policy, which the first image lacked, imports inside it
        ran = subprocess.run(["docker", "run", "--rm", tag, "python", "-c",
                              "import pagedq.fleet, pagedq.store.dispatch, pagedq.workers.service; print('ok')"],
                             capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stderr[-4000:]
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=120)
