"""The shipped deployment files are safe by default (parsed: there is no Docker engine here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"
COMPOSE_FILES = sorted(DOCKER.glob("docker-compose*.yml"))


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
