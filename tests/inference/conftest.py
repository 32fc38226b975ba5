"""Real ``streamrl serve-model`` processes on loopback ports, with the tiny random model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from streamrl.learner.model import resolve_model
from streamrl.net import free_port
from streamrl.testing.serve_model import ServeModel, start_serve_model, wait_healthy

__all__ = ["ServeModel", "free_port", "start_serve_model", "wait_healthy"]


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return resolve_model("tiny")


@pytest.fixture
def serve_models(tmp_path: Path, tiny_dir: Path) -> Iterator[Callable[[int], list[ServeModel]]]:
    """``serve_models(n)``: n healthy servers (started in parallel), killed after the test."""
    started: list[ServeModel] = []

    def start(n: int) -> list[ServeModel]:
        servers = [start_serve_model(tmp_path) for _ in range(n)]
        started.extend(servers)
        for s in servers:
            wait_healthy(s)
        return servers

    yield start
    for s in started:
        s.kill()


@pytest.fixture(scope="module")
def one_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeModel]:
    resolve_model("tiny")
    server = start_serve_model(tmp_path_factory.mktemp("serve"))
    try:
        wait_healthy(server)
        yield server
    finally:
        server.kill()
