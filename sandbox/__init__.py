"""Sandboxes for untrusted code: the contract (:mod:`sandbox.base`) and its backends.

``open_sandbox("process")`` gives the local process backend, ``open_sandbox("docker", image=...,
pool_size=...)`` the Docker backend (imported on first use: aiodocker stays out of processes
that do not need it). Each names its ``isolation`` level (:data:`ISOLATION_LEVELS`, weakest
first) and :data:`NOT_ISOLATED` says what each level does not isolate.
"""

from __future__ import annotations

from typing import Any

from streamrl.sandbox.base import (
    ISOLATION_LEVELS,
    NOT_ISOLATED,
    ExecRequest,
    ExecResult,
    IsolationTooWeak,
    Limits,
    Sandbox,
    SandboxUnavailable,
)
from streamrl.sandbox.process import ProcessSandbox

BACKENDS = ("process", "docker")


def open_sandbox(backend: str, **options: Any) -> Sandbox:
    """Create the sandbox backend named ``backend`` with its constructor ``options``."""
    if backend == "process":
        return ProcessSandbox(**options)
    if backend == "docker":
        from streamrl.sandbox.docker import DockerSandbox

        return DockerSandbox(**options)
    raise ValueError(f"unknown sandbox backend {backend!r}; known: {', '.join(BACKENDS)}")


__all__ = [
    "BACKENDS",
    "ISOLATION_LEVELS",
    "NOT_ISOLATED",
    "ExecRequest",
    "ExecResult",
    "IsolationTooWeak",
    "Limits",
    "ProcessSandbox",
    "Sandbox",
    "SandboxUnavailable",
    "open_sandbox",
]
