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
