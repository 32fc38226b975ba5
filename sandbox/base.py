"""The sandbox contract: run untrusted code, get a result back as data.

Guarantees every backend keeps:
- what the untrusted code does (crash, hang, flood output, exhaust memory) comes back in an
  :class:`ExecResult`, never as an exception;
- a failure of the infrastructure itself (cannot create the sandbox, engine down) raises
  :class:`SandboxUnavailable`, which is retryable: the caller's message is retried later
  with a fresh sandbox;
- files are written whatever the code did to the permissions of the directories on the
  way (the owner's write permission is given back); a file the code's own doing still keeps
  from being written (a disk it filled) makes ``put_files`` raise :class:`WriteRefused`,
  and a ``run`` whose ``request.files`` it keeps out a result (``exit_code`` None, not
  timed out, nothing run, the reason on stderr), never ``SandboxUnavailable``; a request
  that cannot be expressed (a path that is absolute, has ``..``, a NUL or a character that
  is not UTF-8; an argument with a NUL or such a character: :func:`check_request`) raises
  ``ValueError`` before anything runs;
- a backend may give sessions a wall-clock budget: past it, every call on the session raises
  :class:`SessionExpired` (not retryable: what the session served ends);
- nothing the backend started for the code outlives the call (single runs) or the session
  (sessions); a backend with a warm pool keeps clean, reset sandboxes between calls;
- every backend says how strongly it isolates (``isolation``, one of :data:`ISOLATION_LEVELS`,
  weakest first) and what that does not isolate (:data:`NOT_ISOLATED`); a caller that needs
  at least some level checks it with :func:`require_isolation` before running anything.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

IsolationLevel = Literal["none", "unshare", "bwrap", "docker"]
ISOLATION_LEVELS: tuple[IsolationLevel, ...] = ("none", "unshare", "bwrap", "docker")
"""Isolation levels, weakest first: a plain process (uid switch + rlimits), util-linux
``unshare`` namespaces on the host's file system, a bubblewrap sandbox (its own read-only
root and tmpfs mounts), a hardened container (adds seccomp and cgroup limits)."""

NOT_ISOLATED: dict[str, str] = {
    "none": "NOT isolated: the host network, the host file system (every readable file; "
    "world-writable dirs such as /tmp writable), /proc and the host's processes; the kernel",
    "unshare": "NOT isolated: the host file system (every readable host file can be read, "
    "world-writable dirs such as /tmp, /dev/shm, /var/tmp written); nested user namespaces; "
    "the kernel; CPU time and memory only per process (no cgroups)",
    "bwrap": "not isolated: the kernel (shared, no seccomp filter); CPU time and memory only "
    "per process (no cgroups)",
    "docker": "not isolated: the kernel (shared, default seccomp; gVisor only with "
    "runtime='runsc')",
}
"""What each level does not isolate, as logged and printed when a backend is opened."""


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be provided (infrastructure failure, retryable)."""


class WriteRefused(Exception):
    """``put_files`` could not write a file because of what the code left in the work dir
    (a full disk). What the code did, as data for the caller: not retryable, the sandbox is
    fine. The message names the path and the reason; the files before it in the same call
    are written, none after it."""


class SessionExpired(RuntimeError):
    """A session is past its backend's wall-clock budget (the Docker backend's
    ``session_max_s``) and is refused from now on. Not retryable: whatever the session served
    ends (the executor ends the episode's member, ``"expired"``, with no final check)."""


class IsolationTooWeak(RuntimeError):
    """A backend isolates less than required (a configuration error: never retried)."""


def require_isolation(isolation: str, minimum: str, what: str = "the sandbox") -> None:
    """Raise :class:`IsolationTooWeak` when ``isolation`` is below ``minimum`` (a level not in
    :data:`ISOLATION_LEVELS` counts as ``none``)."""
    if minimum not in ISOLATION_LEVELS:
        raise ValueError(f"unknown isolation level {minimum!r}; known: {ISOLATION_LEVELS}")
    rank = ISOLATION_LEVELS.index(isolation) if isolation in ISOLATION_LEVELS else 0
    if rank < ISOLATION_LEVELS.index(minimum):
        raise IsolationTooWeak(
            f"{what} isolates only as {isolation!r}, below the required {minimum!r} "
            f"({NOT_ISOLATED.get(isolation, 'unknown isolation')})"
        )


def check_text(what: str, text: str) -> None:
    """``ValueError`` when ``text`` (an argument, a path) cannot reach the kernel: a NUL,
    or a character UTF-8 cannot encode (a lone surrogate)."""
    if "\x00" in text:
        raise ValueError(f"{what}: a NUL character at {text.index(chr(0))}")
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what}: not valid Unicode (a lone surrogate "
                         f"U+{ord(text[exc.start]):04X} at {exc.start})") from None


def check_request(argv: list[str], files: Iterable[str] = ()) -> None:
    """``ValueError`` for an argument or a file name :func:`check_text` refuses (every
    backend checks before it runs anything)."""
    if not argv:
        raise ValueError("ExecRequest.argv is empty")
    for i, arg in enumerate(argv):
        check_text(f"argument {i}", arg)
    for name in files:
        check_text(f"file {name[:80]!r}", name)


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0
    memory_mb: int = 512
    cpu_s: int = 10
    max_processes: int = 64
    max_file_mb: int = 16
    max_open_files: int = 256
    output_bytes: int = 1 << 20  # per stream; the rest is drained and counted

    def with_overrides(self, timeout_s: float = 0.0, memory_mb: int = 0) -> Limits:
        """These limits with a configured time and memory (0: keep this one's); a new time
        limit brings the CPU-seconds limit along (whole seconds, at least 1)."""
        limits = self
        if timeout_s > 0:
            limits = replace(limits, timeout_s=timeout_s, cpu_s=max(1, math.ceil(timeout_s)))
        if memory_mb:
            limits = replace(limits, memory_mb=memory_mb)
        return limits


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


class SandboxSession(Protocol):
    """One episode's sandbox: files persist across ``run`` calls until ``reset``.

    Multi-turn episodes hold one session for their whole life; ``reset`` returns it to the
    clean state (empty work dir, no processes) so a pool can hand it to the next episode.
    Every ``run`` of a session uses the session's limits (``request.limits`` is ignored).
    ``run`` results follow the same rules as :meth:`Sandbox.run` (data, never exceptions for
    what the code did); infrastructure failures raise :class:`SandboxUnavailable`.
    """

    async def run(self, request: ExecRequest) -> ExecResult:
        """Run ``request.argv`` in the session's work dir after writing ``request.files``."""
        ...

    async def put_files(self, files: dict[str, bytes]) -> None:
        """Write files into the work dir, replacing whatever the code left at those paths
        (links included: a planted link never redirects the write). :class:`WriteRefused`
        when what the code did keeps a file from being written (a read-only directory, a
        full disk)."""
        ...

    async def get_files(self, paths: list[str]) -> dict[str, bytes | None]:
        """Read regular files (relative to the work dir). A missing path, a symlink, a fifo or
        a directory maps to None: what the code planted can neither leak a file nor block."""
        ...

    async def reset(self) -> None: ...

    async def aclose(self) -> None: ...


class Sandbox(Protocol):
    """A backend. ``run`` is safe to call concurrently.

    ``run`` is a one-shot session: a fresh work dir, one command, everything torn down.
    ``session(limits, label)`` opens a :class:`SandboxSession` (``label`` names/labels what the
    backend creates, e.g. the message id, so leftovers of a dead executor can be reaped); it is
    released on every exit path of the ``async with``. ``run``'s ``label`` does the same for
    what a one-shot run uses, while it runs.
    """

    name: str
    isolation: IsolationLevel

    async def run(self, request: ExecRequest, label: str = "") -> ExecResult: ...

    def session(
        self, limits: Limits, label: str = ""
    ) -> AbstractAsyncContextManager[SandboxSession]: ...

    async def aclose(self) -> None: ...
