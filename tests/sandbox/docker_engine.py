"""The real Docker engine the Docker tests talk to (its socket, the sandbox image), and the
one rule for when it is missing: skip with the reason, except under CI ($CI set), where the
tests fail instead."""

from __future__ import annotations

import http.client
import os
import socket
from urllib.parse import quote

import pytest

IMAGE = os.environ.get("STREAMRL_SANDBOX_IMAGE", "streamrl-sandbox:offline")
SOCKET = "/var/run/docker.sock"


class _UnixHTTP(http.client.HTTPConnection):
    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(5)
        self.sock.connect(SOCKET)


def engine_get(path: str) -> tuple[int, bytes]:
    """GET ``path`` of the engine's API: (status, body)."""
    conn = _UnixHTTP("localhost")
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def why_not_docker() -> str | None:
    """Why the engine or the sandbox image cannot be used here, or None when they can."""
    try:
        status, _ = engine_get("/_ping")
    except OSError as exc:
        return (
            f"no Docker engine at {SOCKET} ({exc}); start: dockerd --bridge=none --iptables=false"
        )
    if status != 200:
        return f"Docker engine at {SOCKET} answered {status}"
    if engine_get(f"/images/{quote(IMAGE)}/json")[0] != 200:
        return f"image {IMAGE} missing; build it with sandbox/images/build_offline.sh"
    return None


def require_docker(what: str) -> None:
    """Skip the calling test (fail it under CI: ``what`` must run there) without an engine
    and the sandbox image."""
    reason = why_not_docker()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"{what} must run in CI: {reason}")
        pytest.skip(reason)
