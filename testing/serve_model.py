"""Real ``streamrl serve-model`` processes on loopback ports, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from streamrl.net import free_port, wait_healthy_sync

REPO = Path(__file__).resolve().parents[1]


@dataclass
class ServeModel:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)


def start_serve_model(log_dir: Path, model: str = "tiny", port: int | None = None,
                      weight_version: str = "default", *, dtype: str = "float32",
                      threads: int = 1, max_batch: int = 32) -> ServeModel:
    port = port or free_port()
    log = log_dir / f"serve-model-{port}.log"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "serve-model", "--model", model,
         "--host", "127.0.0.1", "--port", str(port), "--weight-version", weight_version,
         "--dtype", dtype, "--threads", str(threads), "--max-batch", str(max_batch)],
        cwd=REPO, env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )
    return ServeModel(f"http://127.0.0.1:{port}", port, process, log)


def wait_healthy(server: ServeModel, timeout_s: float = 180.0) -> None:
    """Until ``server`` answers ``/health`` (its log in the error if it exited first)."""
    try:
        wait_healthy_sync(server.url + "/health", timeout_s, alive=server.alive)
    except RuntimeError:
        raise RuntimeError(f"serve-model exited: {server.log.read_text()[-2000:]}") from None
