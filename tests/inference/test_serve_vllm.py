"""``streamrl serve-vllm``: a real vLLM server that goes down with the command however the
command ends: stopped by a signal, or killed outright (the server's processes get SIGKILL
from the kernel, ``PR_SET_PDEATHSIG``), so ``up`` never leaves a vLLM server behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.net import free_port, wait_healthy_sync
from streamrl.testing.wait import wait_until_sync
from tests.inference.conftest import require_vllm

REPO = Path(__file__).resolve().parents[2]


def vllm_processes(session: int) -> list[int]:
    """Processes of the session ``session`` (the command's) still alive."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session:
                    alive.append(int(entry.name))
            except ProcessLookupError:
                pass
    return alive


@pytest.mark.system
@pytest.mark.serial  # with the other vLLM tests, alone (test_engine_contract.py)
@pytest.mark.parametrize("ending", ["SIGTERM", "SIGKILL"])
def test_serve_vllm_takes_the_server_down_with_it(tmp_path: Path, ending: str) -> None:
    require_vllm()
    port = free_port()
    log = (tmp_path / "serve-vllm.log").open("wb")
    command = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "serve-vllm", "--model", "tiny", "--port",
         str(port), "--dtype", "float32", "--enforce-eager", "--kv-cache-gib", "1"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy_sync(f"http://127.0.0.1:{port}/health", 300, alive=lambda: command.poll()
                          is None)
        # the server runs in a session of its own, a child of the command
        [server] = vllm_processes_of_parent(command.pid)
        session = os.getsid(server)
        assert session != os.getsid(command.pid)
        # When the command ends
        command.send_signal(getattr(signal, ending))
        command.wait(60)
        # Then no process of the server is left
        try:
            wait_until_sync(lambda: not vllm_processes(session), 60)
        except TimeoutError:
            raise AssertionError(f"vLLM processes left after {ending}: "
                                 f"{vllm_processes(session)}") from None
    finally:
        if command.poll() is None:
            command.kill()


def vllm_processes_of_parent(parent: int) -> list[int]:
    """The ``vllm serve`` processes whose parent is ``parent``."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent and \
                    b"vllm serve" in (entry / "cmdline").read_bytes().replace(b"\0", b" "):
                children.append(int(entry.name))
    return children
