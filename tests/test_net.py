"""streamrl.net: free ports, and waiting for an HTTP endpoint to be healthy."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import trio

from streamrl.net import distinct_free_ports, free_port, free_ports, wait_healthy, wait_healthy_sync
from streamrl.testing.wait import wait_until

SERVER = "import http.server as h; h.test(HandlerClass=h.SimpleHTTPRequestHandler, port={port}, bind='127.0.0.1')"  # noqa: E501


def test_free_ports_can_be_bound() -> None:
    ports = [free_port(), *distinct_free_ports(3), *free_ports("127.0.0.1", 2)]
    assert len(set(ports[1:4])) == 3 and all(9400 <= p < 32768 for p in ports[4:])
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


async def test_wait_healthy_returns_once_the_server_answers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # Given a server that starts listening a little later
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER.format(port=port)], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # When we wait for it, Then it is healthy (trio and blocking variants)
        await wait_healthy(f"http://127.0.0.1:{port}/", 30.0, alive=lambda: server.poll() is None,
                           interval_s=0.05)
        wait_healthy_sync(f"http://127.0.0.1:{port}/", 5.0)
    finally:
        server.kill()
        server.wait()


async def test_wait_healthy_fails_fast_when_the_process_exited() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    await wait_until(lambda: dead.poll() is not None, timeout=10)
    url = f"http://127.0.0.1:{free_port()}/health"
    with trio.fail_after(5), pytest.raises(RuntimeError, match="exited"):
        await wait_healthy(url, 60.0, alive=lambda: dead.poll() is None)
    with pytest.raises(RuntimeError, match="exited"):
        wait_healthy_sync(url, 60.0, alive=lambda: dead.poll() is None)
    with pytest.raises(TimeoutError):
        await wait_healthy(url, 0.3, interval_s=0.05)
