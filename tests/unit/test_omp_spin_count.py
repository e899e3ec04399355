"""``PAGEDQ_OMP_SPIN_COUNT``: a GPU worker sets GOMP_SPINCOUNT before torch loads libgomp; the user's own wins."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from pagedq.workers import cpu_budget


def run_fresh(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (torch not yet imported) with ``env`` on top of a clean OpenMP env."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


SET_THEN_IMPORT = (
    "import os, sys; from pagedq.workers.cpu_budget import set_omp_spin_count; "
    "did = set_omp_spin_count({count}); import torch; print(did, os.environ.get('GOMP_SPINCOUNT'))"
)


def test_the_spin_count_is_set_before_torch_loads():
    count = random.randint(1_000, 400_000)
    print("count", count)
    assert run_fresh(SET_THEN_IMPORT.format(count=count)) == f"True {count}"


@pytest.mark.parametrize("user", ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_the_users_own_openmp_setting_wins(user):
    value = "passive" if user == "OMP_WAIT_POLICY" else str(random.randint(1, 999))
    out = run_fresh(SET_THEN_IMPORT.format(count=50_000) + f"; print(os.environ['{user}'])", **{user: value})
    assert out.split("\n")[0].split()[0] == "False"
    assert out.split("\n")[-1] == value
    if user == "OMP_WAIT_POLICY":
        assert out.split("\n")[0] == "False None"


def test_after_torch_is_imported_it_refuses(monkeypatch):
    import torch  # noqa: F401 - the point: libgomp has read its settings

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(RuntimeError, match="torch is imported already"):
        cpu_budget.set_omp_spin_count(50_000)
    assert "GOMP_SPINCOUNT" not in os.environ


WORKER_COMMAND = """
import importlib.abc, importlib.util, os, sys, types
import pagedq.pipeline.cli as cli

class Probe(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    # stands in for the GPU worker module: notes GOMP_SPINCOUNT as it stands when the module is imported
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name == "pagedq.workers.gpu_worker" else None
    def create_module(self, spec):
        return types.ModuleType(spec.name)
    def exec_module(self, module):
        seen = os.environ.get("GOMP_SPINCOUNT")
        module.run_worker = lambda *a: print("imported with", seen, "torch loaded:", "torch" in sys.modules) or 0

sys.meta_path.insert(0, Probe())
sys.exit(cli.main(["worker", "--model", "x"]))
"""


def test_the_worker_command_sets_it_before_the_worker_module_loads(redis_url):
    """``pagedq worker``'s own path, with the setting from the environment: GOMP_SPINCOUNT is set by the time
    the worker module (which imports torch) is imported.  The command checks its broker first (a real one)."""
    count = random.randint(1_000, 400_000)
    out = run_fresh(WORKER_COMMAND, PAGEDQ_OMP_SPIN_COUNT=str(count), PAGEDQ_BROKER_URL=redis_url)
    assert out == f"imported with {count} torch loaded: False"
