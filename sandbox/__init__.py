"""Sandboxes for untrusted code: the contract (:mod:`sandbox.base`) and its backends.

``open_sandbox("process")`` gives the local process backend, ``open_sandbox("docker", image=...,
pool_size=...)`` the Docker backend (imported on first use: aiodocker stays out of processes
that do not need it).
"""

from __future__ import annotations

from typing import Any

from sandbox.base import ExecRequest, ExecResult, Limits, Sandbox, SandboxUnavailable
from sandbox.process import ProcessSandbox

BACKENDS = ("process", "docker")


def open_sandbox(backend: str, **options: Any) -> Sandbox:
    """Create the sandbox backend named ``backend`` with its constructor ``options``."""
    if backend == "process":
        return ProcessSandbox(**options)
    if backend == "docker":
        from sandbox.docker import DockerSandbox

        return DockerSandbox(**options)
    raise ValueError(f"unknown sandbox backend {backend!r}; known: {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "ExecRequest",
    "ExecResult",
    "Limits",
    "ProcessSandbox",
    "Sandbox",
    "SandboxUnavailable",
    "open_sandbox",
]
