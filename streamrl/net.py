"""Local network helpers: free ports, and waiting for an HTTP endpoint to answer healthy.

``free_port()`` is a port the kernel gives now (bind port 0): free at the call, not reserved,
so take it just before the process that will bind it starts. ``free_ports(addr, n)`` picks
from a fixed range below the ephemeral one instead, so no outgoing connection takes one first.
``wait_healthy`` (trio) and ``wait_healthy_sync`` return once ``GET url`` answers 200, raise
``RuntimeError`` as soon as ``alive()`` says the server's process has exited, and
``TimeoutError`` after ``timeout_s``. Imports nothing of the package, so every folder may use it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import trio


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def distinct_free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` different ports from :func:`free_port`."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports


def free_ports(addr: str, n: int, start: int = 9400) -> list[int]:
    """The first ``n`` ports from ``start`` up that ``addr`` can bind now. Below the
    ephemeral range (32768 up), so no connection a process opens takes one before the process
    that is to serve it binds it (as a port picked by binding port 0 could be)."""
    ports: list[int] = []
    for port in range(start, 32768):
        with socket.socket() as s:
            try:
                s.bind((addr, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise OSError(f"fewer than {n} free ports on {addr} from {start} up")


async def wait_healthy(
    url: str,
    timeout_s: float,
    alive: Callable[[], bool] | None = None,
    interval_s: float = 0.5,
) -> None:
    """Until ``GET url`` answers 200 (see the module docstring)."""
    import httpx

    async with httpx.AsyncClient(timeout=2.0) as client:
        with trio.move_on_after(timeout_s):
            while alive is None or alive():
                try:
                    if (await client.get(url)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await trio.sleep(interval_s)
            raise RuntimeError(f"{url}: the process exited before it was healthy")
    raise TimeoutError(f"{url}: not healthy after {timeout_s} s")


def wait_healthy_sync(
    url: str,
    timeout_s: float,
    alive: Callable[[], bool] | None = None,
    interval_s: float = 0.2,
) -> None:
    """:func:`wait_healthy` for code outside trio (blocks the thread)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if alive is not None and not alive():
            raise RuntimeError(f"{url}: the process exited before it was healthy")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"{url}: not healthy after {timeout_s} s")
