"""Real ``streamrl serve-model`` processes on loopback ports, with the tiny random model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from learner.model import resolve_model

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServeModel:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


def start_serve_model(log_dir: Path, model: str = "tiny", port: int | None = None,
                      weight_version: str = "default") -> ServeModel:
    port = port or free_port()
    log = log_dir / f"serve-model-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "actors.cli", "serve-model", "--model", model,
         "--host", "127.0.0.1", "--port", str(port), "--weight-version", weight_version],
        cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    return ServeModel(f"http://127.0.0.1:{port}", port, process, log)


def wait_healthy(server: ServeModel, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"serve-model exited: {server.log.read_text()[-2000:]}")
        try:
            if httpx.get(server.url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"serve-model not healthy after {timeout_s}s")


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
