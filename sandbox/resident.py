"""Resident runners for the process backend: one bubblewrap sandbox per session, kept warm.

A :class:`Runner` is one long-lived sandbox process (the caller builds its command line: a
bubblewrap sandbox whose pid 1 is :mod:`sandbox.runner`) and the framed conversation with it
over two pipes (:mod:`sandbox.runner_channel`, shared with the Docker backend). Each command
is then a fork/exec inside the sandbox, not a new sandbox: the namespace setup (~20 ms) is
paid once per runner, not once per command.

Guarantees:
- a reply counts only if it echoes the request's random nonce; a runner that sent anything else,
  sent nothing by the host deadline (``limits.timeout_s + grace_s``), exited, or was
  interrupted mid-request (cancellation) is killed and never used again;
- a :class:`RunnerPool` hands out ready runners (``pool_size`` kept started in the background;
  runners given back are reset in the background: every process killed, System V IPC removed,
  the writable mounts emptied), starts one on demand when none is ready, and kills idle runners
  beyond ``pool_size`` after ``idle_s``. A runner whose reset fails (including the runner
  detecting that the code changed its rlimits, priority or affinity) is killed, not reused;
- a runner lost mid-run (it exited, its pipes broke: killed from outside, or crashed) raises
  ``SandboxUnavailable`` chained to the loss, so the caller's message is retried with a fresh
  runner; a runner that did not answer by the host deadline is what the code did (``timed_out``),
  and a forged or malformed reply is reported as the run's result (the code wrote it);
- structured: a pool is served by its owner (``await nursery.start(pool.serve)``), in the
  owner's nursery; its tasks (fill, trim, resets) run in ``serve``'s nursery and an error in
  one of them propagates out of ``serve``. Nothing outlives it: when ``serve`` ends (``aclose``,
  cancellation, a failure) every runner is killed. Killing a runner SIGKILLs its bubblewrap
  monitor; the sandbox (``--die-with-parent``) and every process in it die with it, and the
  monitor itself dies with the thread that started it (``PR_SET_PDEATHSIG``), so an executor
  that dies leaves nothing behind either.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import structlog
import trio

from streamrl.backoff import Backoff, Retrying
from streamrl.sandbox.base import ExecRequest, ExecResult, Limits, SandboxUnavailable
from streamrl.sandbox.runner_channel import RunnerChannel, RunnerGone, lost_result

log = structlog.get_logger()

_OOM_MARKERS = (b"MemoryError", b"std::bad_alloc", b"Cannot allocate memory", b"out of memory")


class Runner:
    """One resident sandbox process; the conversation with its runner is ``channel``."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdin: trio.lowlevel.FdStream,
        stdout: trio.lowlevel.FdStream,
        stderr_fd: int,
        release: AbstractAsyncContextManager[object],
    ) -> None:
        self.pid = popen.pid
        self.idle_since = 0.0
        self._popen = popen
        self._pipes = _Pipes(stdin, stdout, stderr_fd)
        self._release = release
        self._killed = False
        self.channel = RunnerChannel(self._pipes, discard=self.kill)

    @property
    def gone(self) -> str | None:
        """Why the runner cannot be used any more, or None while it can."""
        return self.channel.gone

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str],
        env: dict[str, str],
        setup: Callable[[], None],
        release: AbstractAsyncContextManager[object],
    ) -> Runner:
        """Start ``argv`` from the calling thread (the trio thread, which lives as long as the
        run: ``PR_SET_PDEATHSIG`` in ``setup`` is tied to the thread that forks)."""
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            popen = subprocess.Popen(
                list(argv), stdin=in_r, stdout=out_w, stderr=err_w, env=env, cwd="/",
                start_new_session=True, preexec_fn=setup,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            for fd in (in_w, out_r, err_r):
                os.close(fd)
            raise SandboxUnavailable(f"cannot start a resident sandbox: {exc}") from exc
        finally:
            for fd in (in_r, out_w, err_w):
                os.close(fd)
        os.set_blocking(err_r, False)
        stdin, stdout = trio.lowlevel.FdStream(in_w), trio.lowlevel.FdStream(out_r)
        return cls(popen, stdin, stdout, err_r, release)

    async def wait_ready(self, timeout_s: float) -> dict:
        return await self.channel.wait_ready(timeout_s)

    async def run(self, request: ExecRequest, limits: Limits, grace_s: float) -> ExecResult:
        """Run ``request`` (files, argv, stdin) under ``limits``; the result is data."""
        extra = {
            "as_mb": limits.memory_mb,
            "nproc": limits.max_processes + 1,  # the runner counts too (same uid)
        }
        start = time.monotonic()
        try:
            result = await self.channel.run(request, limits, limits.timeout_s + grace_s, extra)
        except RunnerGone as exc:
            await self.kill()
            if not exc.ended:  # no reply in time, or a forged one: what the code did
                return lost_result(exc, "runner killed", False, start)
            raise SandboxUnavailable(f"sandbox runner lost mid-run: {exc}") from exc
        code = result.exit_code
        if not result.oom_killed and code not in (None, 0) and looks_oom(result.stderr):
            result = replace(result, oom_killed=True)
        return result

    async def control(self, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        """A put/get/reset call: any runner failure kills it (``SandboxUnavailable``)."""
        return await self.channel.control(header, payload)

    async def kill(self) -> None:
        """SIGKILL the sandbox, reap it and give its uid back (idempotent, shielded)."""
        if self._killed:
            return
        self._killed = True
        self.channel.gone = self.channel.gone or "killed"
        with trio.CancelScope(shield=True):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)  # the monitor's own session
            await self._pipes.aclose()
            await _reap(self._popen)
            await self._release.__aexit__(None, None, None)


class _Pipes:
    """The runner's stdin, stdout and stderr: a :class:`RunnerTransport` over three pipes."""

    def __init__(
        self, stdin: trio.lowlevel.FdStream, stdout: trio.lowlevel.FdStream, stderr_fd: int
    ) -> None:
        self._stdin = stdin
        self._stdout = stdout
        self._stderr_fd = stderr_fd

    async def send(self, data: bytes) -> None:
        try:
            await self._stdin.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise RunnerGone(f"cannot write to the runner: {exc!r}", ended=True) from exc

    async def receive(self) -> bytes:
        try:
            return await self._stdout.receive_some(1 << 16)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise RunnerGone(f"cannot read from the runner: {exc!r}", ended=True) from exc

    def diagnostics(self) -> str:
        try:
            return os.read(self._stderr_fd, 4096).decode(errors="replace").strip()[-500:]
        except OSError:
            return ""

    async def aclose(self) -> None:
        for stream in (self._stdin, self._stdout):
            await stream.aclose()
        os.close(self._stderr_fd)


async def _reap(popen: subprocess.Popen[bytes]) -> None:
    """Wait (without blocking trio) for a killed child to exit, then reap it."""
    if popen.poll() is not None:
        return
    try:
        pidfd = os.pidfd_open(popen.pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            with trio.move_on_after(10):
                await trio.lowlevel.wait_readable(pidfd)
        finally:
            trio.lowlevel.notify_closing(pidfd)
            os.close(pidfd)
    retrying = Retrying(Backoff(0.001, 0.1))
    while popen.poll() is None:  # no pidfd (old kernel), or a monitor slow to die
        await retrying.wait()


@dataclass(frozen=True)
class PoolStatistics:
    started: int
    reused: int
    killed: int
    ready: int
    busy: int


class RunnerPool:
    """Ready runners for one sandbox, served by its owner (see the module docstring).

    ``start`` starts one runner and waits until it is ready (raising ``SandboxUnavailable``).
    The pool hands out runners only while :meth:`serve` runs (``RuntimeError`` before). When
    one of its tasks fails, ``error`` keeps the failure, the calls in flight (:meth:`call`)
    are cut short and they and every later one raise ``SandboxUnavailable`` chained to it.
    """

    def __init__(
        self, start: Callable[[], Awaitable[Runner]], pool_size: int, idle_s: float
    ) -> None:
        self._start_one = start
        self._size = pool_size
        self._idle_s = idle_s
        self._ready: list[Runner] = []  # most recently idle last
        self._live: set[Runner] = set()
        self._filling = 0
        self._resetting = 0
        self._waiting = 0
        self._counts = dict.fromkeys(("started", "reused", "killed"), 0)
        self._changed = trio.Event()
        self._closing = trio.Event()
        self._stopped = trio.Event()
        self._served = False
        self._nursery: trio.Nursery | None = None
        self._calls: set[trio.CancelScope] = set()
        self.error: BaseException | None = None

    def statistics(self) -> PoolStatistics:
        ready = len(self._ready)
        return PoolStatistics(**self._counts, ready=ready, busy=len(self._live) - ready)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Keep ``pool_size`` runners ready, reset given-back ones, trim idle ones, until
        :meth:`aclose` or cancellation; an error of those tasks propagates. Every runner is
        killed before it returns, however it ends."""
        if self._served:
            raise RuntimeError("a RunnerPool is served once")
        self._served = True
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._fill)
                nursery.start_soon(self._trim)
                task_status.started()
                await self._closing.wait()
                nursery.cancel_scope.cancel()
        except Exception as exc:
            while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
                exc = exc.exceptions[0]  # (the nursery's group of one task's error)
            self.error = exc  # before the runners die: the calls in flight learn why
            log.error("sandbox runner pool failed", error=repr(exc))
            for scope in self._calls:
                scope.cancel()
            raise
        finally:
            self._nursery = None
            self._closing.set()
            self._notify()
            with trio.CancelScope(shield=True):
                for runner in list(self._live):
                    await self._kill(runner)
                self._ready.clear()
            self._stopped.set()

    async def acquire(self) -> Runner:
        """A ready runner: from the pool, else one about to be ready, else a new one."""
        while True:
            self._check_open()
            while self._ready:
                runner = self._ready.pop()
                self._notify()
                if runner.gone is None:
                    self._counts["reused"] += 1
                    return runner
                await self._kill(runner)
            if self._filling + self._resetting <= self._waiting:
                break
            self._waiting += 1
            try:
                await self._changed.wait()
            finally:
                self._waiting -= 1
        return await self._start()

    async def release(self, runner: Runner) -> None:
        """Give a runner back: reset in the background and back to the pool, or killed."""
        if runner.gone is not None or self._nursery is None or self._closing.is_set():
            await self._kill(runner)
            return
        self._resetting += 1
        self._nursery.start_soon(self._recycle, runner)

    async def aclose(self) -> None:
        """Stop :meth:`serve` (every runner killed) and wait until it has."""
        self._closing.set()
        self._notify()
        if self._served:
            with trio.CancelScope(shield=True):
                await self._stopped.wait()

    @contextmanager
    def call(self) -> Iterator[None]:
        """One call in flight: cut short (``SandboxUnavailable`` chained to the failure) when
        the pool fails while it runs."""
        scope = trio.CancelScope()
        self._calls.add(scope)
        try:
            with scope:
                yield
        except SandboxUnavailable:
            if self.error is None:
                raise
            raise self._unavailable() from self.error
        finally:
            self._calls.discard(scope)
        if scope.cancelled_caught:
            raise self._unavailable()

    def _unavailable(self) -> SandboxUnavailable:
        """What a call raises once the pool stopped, chained to its failure (if any)."""
        if self.error is None:
            return SandboxUnavailable("the sandbox is closed")
        unavailable = SandboxUnavailable(f"the sandbox runner pool failed: {self.error!r}")
        unavailable.__cause__ = self.error
        return unavailable

    def _check_open(self) -> None:
        if self._closing.is_set():
            raise self._unavailable()
        if self._nursery is None:
            raise RuntimeError("the runner pool is not served: `await nursery.start(pool.serve)`")

    async def _start(self) -> Runner:
        runner = await self._start_one()
        self._live.add(runner)
        self._counts["started"] += 1
        if self._closing.is_set():  # closed while it started
            await self._kill(runner)
            raise SandboxUnavailable("the sandbox is closed")
        return runner

    async def _kill(self, runner: Runner) -> None:
        if runner in self._live:
            self._live.discard(runner)
            self._counts["killed"] += 1
        await runner.kill()

    async def _recycle(self, runner: Runner) -> None:
        try:
            await runner.channel.reset()
        except SandboxUnavailable as exc:
            log.warning("sandbox runner not reused", error=str(exc))
            await self._kill(runner)
        else:
            runner.idle_since = trio.current_time()
            self._ready.append(runner)
        finally:
            self._resetting -= 1
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _fill(self) -> None:
        """Keep ``pool_size`` runners ready; back off while they cannot start."""
        retrying = Retrying(Backoff(0.5, 30.0))
        while True:
            while len(self._ready) + self._filling < self._size:
                self._filling += 1
                try:
                    runner = await self._start()
                except SandboxUnavailable as exc:
                    log.warning("sandbox runner pool cannot start a runner", error=str(exc))
                    await retrying.wait()
                    continue
                finally:
                    self._filling -= 1
                    self._notify()
                retrying.reset()
                runner.idle_since = trio.current_time()
                self._ready.append(runner)
                self._notify()
            await self._changed.wait()

    async def _trim(self) -> None:
        """Kill idle runners beyond ``pool_size`` once idle for ``idle_s``."""
        while True:
            await trio.sleep(max(min(self._idle_s / 2, 5.0), 0.05))
            now = trio.current_time()
            while len(self._ready) > self._size and now - self._ready[0].idle_since > self._idle_s:
                await self._kill(self._ready.pop(0))


class ResidentSession:
    """One episode's resident sandbox: files persist across ``run`` until ``reset`` (see base).

    Every ``run`` uses the session's limits. Host-side file access goes through the runner,
    which never follows what the code planted: ``get_files`` reads regular files only,
    ``put_files`` replaces links and other things in the way of its paths.
    """

    def __init__(self, pool: RunnerPool, limits: Limits, grace_s: float, label: str) -> None:
        self.limits = limits
        self.label = label
        self._pool = pool
        self._grace = grace_s
        self._runner: Runner | None = None
        self._closed = False
        self._lock = trio.Lock()

    @property
    def pid(self) -> int | None:
        """The host pid of the session's bubblewrap monitor (None when closed)."""
        return None if self._runner is None else self._runner.pid

    async def open(self) -> None:
        with self._pool.call():
            self._runner = await self._pool.acquire()

    async def run(self, request: ExecRequest) -> ExecResult:
        """Write ``request.files``, run ``request.argv`` under the session's limits."""
        async with self._lock:
            runner = self._live()
            with self._pool.call():
                limited = replace(request, limits=self.limits)
                return await runner.run(limited, self.limits, self._grace)

    async def put_files(self, files: dict[str, bytes]) -> None:
        async with self._lock:
            with self._pool.call():
                await self._live().channel.put_files(files)

    async def get_files(self, paths: list[str]) -> dict[str, bytes | None]:
        async with self._lock:
            with self._pool.call():
                cap = self.limits.max_file_mb << 20
                return await self._live().channel.get_files(paths, cap)

    async def reset(self) -> None:
        """Back to a clean state: the same runner reset, or a fresh one if that fails."""
        async with self._lock:
            with self._pool.call():
                await self._reset()

    async def _reset(self) -> None:
        runner = self._live(allow_gone=True)
        if runner.gone is None:
            try:
                await runner.channel.reset()
                return
            except SandboxUnavailable as exc:
                log.warning("sandbox session reset failed, runner replaced", error=str(exc))
        self._runner = None
        await self._pool.release(runner)
        self._runner = await self._pool.acquire()

    async def aclose(self) -> None:
        self._closed = True
        runner, self._runner = self._runner, None
        if runner is not None:
            with trio.CancelScope(shield=True):
                await self._pool.release(runner)

    def _live(self, allow_gone: bool = False) -> Runner:
        if self._closed or self._runner is None:
            raise SandboxUnavailable("sandbox session is closed")
        if self._runner.gone is not None and not allow_gone:
            raise SandboxUnavailable(f"the session's sandbox is gone ({self._runner.gone})")
        return self._runner


def looks_oom(stderr: bytes | bytearray) -> bool:
    """Best effort: an allocation failure reported near the end of stderr."""
    tail = bytes(stderr[-4096:])
    return any(marker in tail for marker in _OOM_MARKERS)
