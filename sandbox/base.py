"""The sandbox contract: run untrusted code, get a result back as data.

Guarantees every backend keeps:
- what the untrusted code does (crash, hang, flood output, exhaust memory) comes back in an
  :class:`ExecResult`, never as an exception;
- a failure of the infrastructure itself (cannot create the sandbox, engine down) raises
  :class:`SandboxUnavailable`, which is retryable: the caller's message is retried later
  with a fresh sandbox;
- nothing the backend started outlives the call (single runs) or the session (sessions).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be provided (infrastructure failure, retryable)."""


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    memory_mb: int = 512
    cpu_s: int = 10
    max_processes: int = 64
    max_file_mb: int = 16
    max_open_files: int = 256
    output_bytes: int = 1 << 20  # per stream; the rest is drained and counted


@dataclass(frozen=True)
class ExecRequest:
    argv: list[str]
    files: dict[str, bytes] = field(default_factory=dict)  # relative path -> content
    stdin: bytes = b""
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class ExecResult:
    exit_code: int | None  # None when killed by the deadline before exiting
    stdout: bytes
    stderr: bytes
    timed_out: bool
    oom_killed: bool
    duration_s: float
    stdout_dropped: int = 0
    stderr_dropped: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed


class Sandbox(Protocol):
    """A backend. ``run`` is safe to call concurrently."""

    name: str

    async def run(self, request: ExecRequest) -> ExecResult: ...

    async def aclose(self) -> None: ...
