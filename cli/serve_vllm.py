"""``streamrl serve-vllm``: one vLLM server for a model spec, started the way the vLLM
client needs it (:mod:`inference.vllm_server`), and taken down with this process."""

from __future__ import annotations

import contextlib
import os
import sys

from streamrl.inference.vllm_server import vllm_command, vllm_environment

REAPER = """
import os, signal, sys
group = int(sys.argv[1])
while sys.stdin.buffer.read(1):
    pass
try:
    os.killpg(group, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def _die_with_parent() -> None:
    """In the vLLM child, before exec: SIGKILL when the process that started it dies."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main_serve_vllm(model: str, host: str, port: int, *, dtype: str = "auto", threads: int = 1,
                    kv_cache_gib: int = 2, enforce_eager: bool = False,
                    max_model_len: int = 0) -> int:
    """``streamrl serve-vllm``: one vLLM server for a model spec (built-in or a directory),
    in its own process group, taken down with this process however it ends: a signal is
    passed on (SIGKILL after 20 s), ``up``'s lifeline closing kills it, and if this process
    is killed the kernel kills the API server (``PR_SET_PDEATHSIG``) and a reaper process,
    which sees its pipe from this one close, kills the server's whole group."""
    import signal
    import subprocess
    import threading

    from streamrl.models import model_limits, resolve_model
    from streamrl.runtime.lifeline import ENV_LIFELINE_FD
    from streamrl.runtime.logs import get_logger

    log = get_logger()
    model_dir = resolve_model(model)
    positions = model_limits(model)[1]
    length = min(max_model_len or positions, positions)
    command = vllm_command(model_dir, port, dtype=dtype, max_model_len=length,
                           enforce_eager=enforce_eager, host=host)
    env = vllm_environment(dict(os.environ), threads=threads, kv_cache_gib=kv_cache_gib)
    lifeline = env.pop(ENV_LIFELINE_FD, "")
    log.info("starting vLLM", command=" ".join(command), model_dir=str(model_dir))
    child = subprocess.Popen(command, env=env, start_new_session=True,
                             preexec_fn=_die_with_parent)
    # the reaper outlives this process: when the pipe to it closes (this process gone, even
    # by SIGKILL), it kills the server's whole group (vLLM's engine and worker processes
    # are not the API server's PDEATHSIG's to take)
    reaper = subprocess.Popen([sys.executable, "-c", REAPER, str(child.pid)],
                              stdin=subprocess.PIPE, start_new_session=True)

    def down(sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)

    if lifeline.isdigit():  # a child of `up`: when up is gone, so is the server
        fd = int(lifeline)

        def watch() -> None:
            while os.read(fd, 64):
                pass
            log.warning("supervisor gone, stopping vLLM")
            down()
            os._exit(70)

        threading.Thread(target=watch, name="lifeline", daemon=True).start()
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()
        down(signal.SIGTERM)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        while True:
            try:
                code = child.wait(timeout=20 if stopping.is_set() else None)
                break
            except subprocess.TimeoutExpired:
                down()
    finally:
        down()
        if reaper.stdin is not None:
            reaper.stdin.close()
    return 0 if stopping.is_set() else (code or 1)
