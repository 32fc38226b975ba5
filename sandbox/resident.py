"""Resident runners for the process backend: one bubblewrap sandbox per session, kept warm.

A :class:`Runner` is one long-lived sandbox process (the caller builds its command line: a
bubblewrap sandbox whose pid 1 is :mod:`sandbox.runner`) and the framed conversation with it
over two pipes. Each command is then a fork/exec inside the sandbox, not a new sandbox: the
namespace setup (~20 ms) is paid once per runner, not once per command.

Guarantees:
- a reply counts only if it echoes the request's random nonce; a runner that sent anything else,
  sent nothing by the host deadline (``limits.timeout_s + grace_s``), exited, or was
  interrupted mid-request (cancellation) is killed and never used again;
- a :class:`RunnerPool` hands out ready runners (``pool_size`` kept started in the background;
  runners given back are reset in the background: every process killed, System V IPC removed,
  the writable mounts emptied), starts one on demand when none is ready, and kills idle runners
  beyond ``pool_size`` after ``idle_s``. A runner whose reset fails (including the runner
  detecting that the code changed its rlimits, priority or affinity) is killed, not reused;
- nothing outlives its owner: a pool lives inside one ``trio.run`` (a system task); when the pool
  is closed, or when that run ends, every runner is killed. Killing a runner SIGKILLs its
  bubblewrap monitor; the sandbox (``--die-with-parent``) and every process in it die with it,
  and the monitor itself dies with the thread that started it (``PR_SET_PDEATHSIG``), so an
  executor that dies leaves nothing behind either.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import struct
import subprocess
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from pathlib import PurePosixPath

import trio

from sandbox.base import ExecRequest, ExecResult, Limits, SandboxUnavailable

log = logging.getLogger(__name__)

_MAX_HEADER = 1 << 20
_CONTROL_TIMEOUT_S = 10.0
_OOM_MARKERS = (b"MemoryError", b"std::bad_alloc", b"Cannot allocate memory", b"out of memory")


class _RunnerGone(Exception):
    """The runner cannot be trusted any more (no reply, EOF, forged reply): kill it."""

    def __init__(self, reason: str, *, stuck: bool = False) -> None:
        super().__init__(reason)
        self.stuck = stuck


class Runner:
    """One resident sandbox process and the framed conversation with its runner."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        stdin: trio.lowlevel.FdStream,
        stdout: trio.lowlevel.FdStream,
        stderr_fd: int,
        release: AbstractAsyncContextManager[object],
    ) -> None:
        self.pid = popen.pid
        self.gone: str | None = None
        self.idle_since = 0.0
        self._popen = popen
        self._stdin = stdin
        self._stdout = stdout
        self._stderr_fd = stderr_fd
        self._release = release
        self._buf = bytearray()
        self._killed = False

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
        with trio.move_on_after(timeout_s):
            hello, _ = await self.read_frame()
            if hello.get("op") != "ready":
                raise _RunnerGone(f"unexpected first frame {hello!r}")
            return hello
        raise _RunnerGone(f"the runner was not ready after {timeout_s} s", stuck=True)

    async def run(self, request: ExecRequest, limits: Limits, grace_s: float) -> ExecResult:
        """Run ``request`` (files, argv, stdin) under ``limits``; the result is data."""
        if not request.argv:
            raise ValueError("ExecRequest.argv is empty")
        files = [(str(checked_path(name)), data) for name, data in request.files.items()]
        header = {
            "op": "run",
            "argv": list(request.argv),
            "files": [[name, len(data)] for name, data in files],
            "timeout": limits.timeout_s,
            "cpu_s": limits.cpu_s,
            "fsize_mb": limits.max_file_mb,
            "nofile": limits.max_open_files,
            "as_mb": limits.memory_mb,
            "nproc": limits.max_processes + 1,  # the runner counts too (same uid)
            "cap": limits.output_bytes,
        }
        payload = b"".join(data for _, data in files) + request.stdin
        start = time.monotonic()
        try:
            reply, out = await self.call(header, payload, limits.timeout_s + grace_s)
        except _RunnerGone as exc:
            await self.kill()
            return ExecResult(
                exit_code=None,
                stdout=b"",
                stderr=f"sandbox: {exc}; runner killed\n".encode(),
                timed_out=exc.stuck,
                oom_killed=False,
                duration_s=time.monotonic() - start,
            )
        if "error" in reply:
            raise SandboxUnavailable(f"sandbox runner: {reply['error']}")
        out_n, code = reply["out_n"], reply["exit_code"]
        stderr = out[out_n:]
        return ExecResult(
            exit_code=code,
            stdout=out[:out_n],
            stderr=stderr,
            timed_out=reply["timed_out"],
            oom_killed=reply["oom"] or (code not in (None, 0) and looks_oom(stderr)),
            duration_s=reply["duration_s"],
            stdout_dropped=reply["out_dropped"],
            stderr_dropped=reply["err_dropped"],
        )

    async def control(self, header: dict, payload: bytes = b"") -> tuple[dict, bytes]:
        """A put/get/reset call: any runner failure kills it (``SandboxUnavailable``)."""
        try:
            reply, out = await self.call(header, payload, _CONTROL_TIMEOUT_S)
        except _RunnerGone as exc:
            await self.kill()
            raise SandboxUnavailable(f"sandbox runner lost: {exc}") from exc
        if "error" in reply:
            raise SandboxUnavailable(f"sandbox runner: {reply['error']}")
        return reply, out

    async def call(self, header: dict, payload: bytes, timeout_s: float) -> tuple[dict, bytes]:
        """Send one request, wait for its reply; the reply must echo the request's nonce."""
        if self.gone is not None:
            raise _RunnerGone(self.gone)
        nonce = secrets.token_hex(16)
        raw = json.dumps({**header, "id": nonce, "n": len(payload)}).encode()
        try:
            with trio.move_on_after(timeout_s) as deadline:
                try:
                    await self._stdin.send_all(struct.pack(">I", len(raw)) + raw + payload)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    raise _RunnerGone(f"cannot write to the runner: {exc!r}") from exc
                reply, out = await self.read_frame()
        except _RunnerGone as exc:
            self.gone = str(exc)
            raise
        except BaseException:  # cancelled or broken mid-conversation: never reuse this runner
            self.gone = "interrupted mid-request"
            raise
        if deadline.cancelled_caught:
            self.gone = "no reply from the runner by the host deadline"
            raise _RunnerGone(self.gone, stuck=True)
        if reply.get("id") != nonce:
            self.gone = "the runner's reply was forged or out of order"
            raise _RunnerGone(self.gone)
        return reply, out

    async def read_frame(self) -> tuple[dict, bytes]:
        buf = self._buf
        while True:
            if len(buf) >= 4:
                (size,) = struct.unpack(">I", buf[:4])
                if size > _MAX_HEADER:
                    raise _RunnerGone("malformed frame from the runner")
                if len(buf) >= 4 + size:
                    try:
                        header = json.loads(buf[4 : 4 + size])
                        end = 4 + size + int(header["n"])
                    except (ValueError, KeyError, TypeError) as exc:
                        raise _RunnerGone(f"malformed frame from the runner: {exc}") from exc
                    if len(buf) >= end:
                        payload = bytes(buf[4 + size : end])
                        del buf[:end]
                        return header, payload
            try:
                chunk = await self._stdout.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise _RunnerGone(f"cannot read from the runner: {exc!r}") from exc
            if not chunk:
                diag = self._diagnostics()
                raise _RunnerGone("the runner exited" + (f": {diag}" if diag else ""))
            buf += chunk

    async def kill(self) -> None:
        """SIGKILL the sandbox, reap it and give its uid back (idempotent, shielded)."""
        if self._killed:
            return
        self._killed = True
        self.gone = self.gone or "killed"
        with trio.CancelScope(shield=True):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)  # the monitor's own session
            for stream in (self._stdin, self._stdout):
                await stream.aclose()
            os.close(self._stderr_fd)
            await _reap(self._popen)
            await self._release.__aexit__(None, None, None)

    def _diagnostics(self) -> str:
        try:
            return os.read(self._stderr_fd, 4096).decode(errors="replace").strip()[-500:]
        except OSError:
            return ""


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
    delay = 0.001
    while popen.poll() is None:  # no pidfd (old kernel), or a monitor slow to die
        await trio.sleep(delay)
        delay = min(delay * 2, 0.1)


@dataclass(frozen=True)
class PoolStatistics:
    started: int
    reused: int
    killed: int
    ready: int
    busy: int


class RunnerPool:
    """Ready runners for one sandbox within one ``trio.run`` (see the module docstring).

    ``start`` starts one runner and waits until it is ready (raising ``SandboxUnavailable``).
    """

    def __init__(
        self, start: Callable[[], Awaitable[Runner]], pool_size: int, idle_s: float
    ) -> None:
        self.token = trio.lowlevel.current_trio_token()
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
        self._up = trio.Event()
        self._closing = trio.Event()
        self._stopped = trio.Event()
        self._nursery: trio.Nursery | None = None
        trio.lowlevel.spawn_system_task(self._serve, name="sandbox-runner-pool")

    def statistics(self) -> PoolStatistics:
        ready = len(self._ready)
        return PoolStatistics(**self._counts, ready=ready, busy=len(self._live) - ready)

    async def acquire(self) -> Runner:
        """A ready runner: from the pool, else one about to be ready, else a new one."""
        await self._up.wait()
        while True:
            if self._closing.is_set():
                raise SandboxUnavailable("the sandbox is closed")
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
        self._closing.set()
        self._notify()
        with trio.CancelScope(shield=True):
            await self._stopped.wait()

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
            await runner.control({"op": "reset"})
        except SandboxUnavailable as exc:
            log.warning("sandbox runner not reused: %s", exc)
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

    async def _serve(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self._up.set()
                nursery.start_soon(self._fill)
                nursery.start_soon(self._trim)
                await self._closing.wait()
                nursery.cancel_scope.cancel()
        except Exception as exc:  # a system task must not crash the run
            log.error("sandbox runner pool failed: %r", exc)
        finally:
            self._closing.set()
            self._up.set()
            with trio.CancelScope(shield=True):
                for runner in list(self._live):
                    await self._kill(runner)
                self._ready.clear()
            self._stopped.set()

    async def _fill(self) -> None:
        """Keep ``pool_size`` runners ready; back off while they cannot start."""
        delay = 0.5
        while True:
            while len(self._ready) + self._filling < self._size:
                self._filling += 1
                try:
                    runner = await self._start()
                except SandboxUnavailable as exc:
                    log.warning("sandbox runner pool cannot start a runner: %s", exc)
                    await trio.sleep(delay)
                    delay = min(delay * 2, 30.0)
                    continue
                finally:
                    self._filling -= 1
                    self._notify()
                delay = 0.5
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
        self._runner = await self._pool.acquire()

    async def run(self, request: ExecRequest) -> ExecResult:
        """Write ``request.files``, run ``request.argv`` under the session's limits."""
        async with self._lock:
            runner = self._live()
            return await runner.run(replace(request, limits=self.limits), self.limits, self._grace)

    async def put_files(self, files: dict[str, bytes]) -> None:
        checked = [(str(checked_path(name)), data) for name, data in files.items()]
        async with self._lock:
            header = {"op": "put", "files": [[name, len(data)] for name, data in checked]}
            await self._live().control(header, b"".join(data for _, data in checked))

    async def get_files(self, paths: list[str]) -> dict[str, bytes | None]:
        names = [str(checked_path(p)) for p in paths]
        async with self._lock:
            header = {"op": "get", "paths": names, "cap": self.limits.max_file_mb << 20}
            reply, payload = await self._live().control(header)
        out: dict[str, bytes | None] = {}
        offset = 0
        for path, size in zip(paths, reply["sizes"], strict=True):
            out[path] = None if size < 0 else payload[offset : offset + size]
            offset += max(size, 0)
        return out

    async def reset(self) -> None:
        """Back to a clean state: the same runner reset, or a fresh one if that fails."""
        async with self._lock:
            runner = self._live(allow_gone=True)
            if runner.gone is None:
                try:
                    await runner.control({"op": "reset"})
                    return
                except SandboxUnavailable as exc:
                    log.warning("sandbox session reset failed, replacing its runner: %s", exc)
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


def checked_path(name: str) -> PurePosixPath:
    rel = PurePosixPath(name)
    if not name or rel.is_absolute() or ".." in rel.parts or rel == PurePosixPath("."):
        raise ValueError(f"ExecRequest.files: {name!r} must be a relative path without '..'")
    return rel


def looks_oom(stderr: bytes | bytearray) -> bool:
    """Best effort: an allocation failure reported near the end of stderr."""
    tail = bytes(stderr[-4096:])
    return any(marker in tail for marker in _OOM_MARKERS)
