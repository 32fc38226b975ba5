"""Sandboxes for untrusted code: the contract (:mod:`sandbox.base`) and its backends.

``open_sandbox("process")`` gives the local process backend, ``open_sandbox("docker", image=...,
pool_size=...)`` the Docker backend (imported on first use: aiodocker stays out of processes
that do not need it). Both have a ``serve`` task (the process backend's warm pool of resident
bwrap sandboxes, Docker's engine connection and containers), served by their owner, in the
owner's nursery: ``async with opened(open_sandbox(...)) as box`` (or
``open_process_sandbox(...)``) does that and closes it on exit (the executor's ``Sandboxes``
hold their own nursery). Each names its ``isolation``
level (:data:`ISOLATION_LEVELS`, weakest first) and :data:`NOT_ISOLATED` says what each level
does not isolate.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

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
from streamrl.sandbox.process import ProcessSandbox, open_process_sandbox

BACKENDS = ("process", "docker")
S = TypeVar("S", bound=Sandbox)


def open_sandbox(backend: str, **options: Any) -> Sandbox:
    """Create the sandbox backend named ``backend`` with its constructor ``options``."""
    if backend == "process":
        return ProcessSandbox(**options)
    if backend == "docker":
        from streamrl.sandbox.docker import DockerSandbox

        return DockerSandbox(**options)
    raise ValueError(f"unknown sandbox backend {backend!r}; known: {', '.join(BACKENDS)}")


@asynccontextmanager
async def opened(box: S) -> AsyncIterator[S]:
    """``box`` for the ``async with``: its ``serve`` task (if it has one) started in a nursery
    of its own, and the backend closed on every exit path. A lone exception (from the body,
    or from starting ``serve``) comes out as itself, not inside the nursery's
    ExceptionGroup, so ``except SandboxUnavailable`` around the block catches it."""
    try:
        async with trio.open_nursery() as nursery:
            serve = getattr(box, "serve", None)
            try:
                if serve is not None:
                    await nursery.start(serve)
                yield box
            finally:
                with trio.CancelScope(shield=True):
                    await box.aclose()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from group.exceptions[0].__cause__
        raise


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
    "open_process_sandbox",
    "open_sandbox",
    "opened",
]
