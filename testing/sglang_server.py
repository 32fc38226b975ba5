"""A real SGLang server on its CPU backend, for the engine contract suite where one is built
(``STREAMRL_SGLANG_PYTHON``: the Python of an environment with SGLang's CPU build; the
recipe and what it took are in docs/inference.md, "SGLang on this machine"). Not in CI."""

from __future__ import annotations

import os
import signal
import subprocess
from contextlib import suppress
from pathlib import Path

from streamrl.net import free_port, wait_healthy_sync
from streamrl.testing.vllm_server import VLLMServer

SGLangServer = VLLMServer  # the same handle: a URL, a process group, a log


def sglang_python() -> str:
    return os.environ.get("STREAMRL_SGLANG_PYTHON", "")


def start_sglang(log_dir: Path, model_dir: Path, *, port: int | None = None,
                 dtype: str = "float32") -> SGLangServer:
    """A server for ``model_dir`` in ``dtype`` (float32 by default, as the vLLM test server:
    SGLang's ``auto`` downcasts a float32 checkpoint to float16, and the tiny model with
    perturbed weights then misses its own teacher-forced logprobs by up to 0.5 nats, with
    no weight update involved; docs/inference.md, "SGLang on this machine")."""
    python = Path(sglang_python())
    port = port or free_port()
    log = log_dir / f"sglang-{port}.log"
    preload = [p for p in ("/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
                           "/usr/lib/x86_64-linux-gnu/libtbbmalloc.so",
                           str(python.parent.parent / "lib" / "libiomp5.so")) if Path(p).exists()]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0-1",
                "LD_PRELOAD": ":".join(preload), "HF_HUB_OFFLINE": "1"})
    process = subprocess.Popen(
        [str(python), "-m", "sglang.launch_server", "--model-path", str(model_dir),
         "--device", "cpu", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
         "--disable-overlap-schedule", "--max-total-tokens", "8192"],
        env=env, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    return SGLangServer(f"http://127.0.0.1:{port}", port, process, log)


def wait_sglang_healthy(server: SGLangServer, timeout_s: float = 300.0) -> None:
    try:
        wait_healthy_sync(server.url + "/health", timeout_s, alive=server.alive)
    except RuntimeError:
        with suppress(ProcessLookupError):
            os.killpg(server.process.pid, signal.SIGKILL)
        raise RuntimeError(f"SGLang exited: {server.log.read_text()[-3000:]}") from None
