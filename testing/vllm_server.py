"""Real vLLM servers on loopback ports, for tests and benchmarks (the environment
``make vllm`` builds; :mod:`inference.vllm_server` says how they are started)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from streamrl.inference.vllm_server import vllm_command, vllm_environment
from streamrl.net import free_port, wait_healthy_sync


@dataclass
class VLLMServer:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """The server and every process it started (its engine core and workers)."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)


def start_vllm(log_dir: Path, model_dir: Path, *, port: int | None = None,
               dtype: str = "float32", threads: int = 1, enforce_eager: bool = True,
               max_model_len: int = 2048, kv_cache_gib: int = 1) -> VLLMServer:
    """A server for ``model_dir`` (eager by default: it starts in about 25 s instead of
    compiling for a minute), in a session of its own so :meth:`VLLMServer.kill` takes its
    children too."""
    port = port or free_port()
    log = log_dir / f"vllm-{port}.log"
    process = subprocess.Popen(
        vllm_command(model_dir, port, dtype=dtype, enforce_eager=enforce_eager,
                     max_model_len=max_model_len),
        env=vllm_environment(dict(os.environ), threads=threads, kv_cache_gib=kv_cache_gib),
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    return VLLMServer(f"http://127.0.0.1:{port}", port, process, log)


def wait_vllm_healthy(server: VLLMServer, timeout_s: float = 300.0) -> None:
    """Until ``server`` answers ``/health`` (its log in the error if it exited first)."""
    try:
        wait_healthy_sync(server.url + "/health", timeout_s, alive=server.alive)
    except RuntimeError:
        raise RuntimeError(f"vLLM exited: {server.log.read_text()[-3000:]}") from None
