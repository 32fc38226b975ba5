"""The resident runner: the command of every Docker sandbox container and of every resident
bubblewrap sandbox of the process backend (stdlib only).

Both backends start it as ``python3 -I -S -c <this file's source>``, so any image with a
``python3`` works and nothing is installed into it. The runner then serves requests, one at a
time, over its stdin/stdout (the container's attached streams, or two pipes to the host; no
network), and starts each command with ``fork`` + ``exec``: a trivial command costs about what
a bare process does, not a ``docker exec`` or a new bubblewrap sandbox. Inside bubblewrap the
runner is pid 1 of the sandbox's pid namespace (``--as-pid-1``): the code cannot signal it, and
everything dies with it.

Guarantees, per ``run`` request:
- the command starts in /work with a scrubbed environment (``PATH`` is the runner's own), in
  its own session, with every signal at its default, the rlimits of the request (CPU seconds,
  file size, open files, no core dumps; address space ``as_mb`` and processes ``nproc`` when
  the request has them: the process backend, which has no cgroup) and only fds 0-2 (pipes to
  the runner);
- at the deadline (``timeout`` seconds) or as soon as the command exits, every other process of
  the container (except init and the runner) is SIGKILLed and every System V IPC object
  (shared memory, message queues, semaphores) is removed, so nothing outlives a command and
  a background child that holds stdout open cannot stall the reply;
- stdout/stderr are kept up to ``cap`` bytes each and drained to the end; the rest is counted;
- ``oom`` is true when the container's memory cgroup recorded an OOM kill during the command.

Protocol, both directions: a frame is a 4-byte big-endian header length, a JSON header, then
``header["n"]`` payload bytes. Each request carries a random ``id`` that the reply echoes: the
untrusted code runs as the same uid and could write into the container's stdout (through
/proc/1/fd/1), but it never sees the id, so a forged reply is detected by the host. The runner
makes itself non-dumpable so the code cannot read its memory or fds. Files are written
whatever the code did to the permissions of the directories on the way (the owner's write
permission is given back); a file the code's doing still keeps from being written (a full
disk) is answered ``{"refused": reason}`` by ``put`` and as a result by ``run`` (exit code
null, nothing ran, the reason on stderr); any other failure ``{"error": reason}``. Ops:
``run``, ``put`` (files), ``get`` (files), ``reset`` (kill everything, remove System V IPC,
empty the writable mounts, POSIX message queues included where /dev/mqueue is mounted, and
the user's kernel keyrings).

The code shares the runner's uid, so it can change some of the runner's own state from outside
(lower its rlimits with ``prlimit``, renice it, change its scheduling policy or CPU affinity),
which later commands would inherit. ``reset`` compares that state with the runner's state at
start and answers an error when it changed: the host then discards the runner instead of
handing it to another episode.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import stat
import struct
import sys
import time

WORK = "/work"
WIPE = ("/work", "/tmp", "/dev/shm", "/dev/mqueue")  # every writable place of the container
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": WORK,
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONHASHSEED": "0",
}
CHUNK = 1 << 16
_DEFAULT_SIGNALS = ("SIGPIPE", "SIGXFSZ", "SIGCHLD", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


# -- framing -----------------------------------------------------------------------------


def read_exact(n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(0, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def read_frame() -> tuple[dict, bytes]:
    (size,) = struct.unpack(">I", read_exact(4))
    header = json.loads(read_exact(size))
    return header, read_exact(header.get("n", 0))


def write_frame(header: dict, payload: bytes = b"") -> None:
    header["n"] = len(payload)
    raw = json.dumps(header).encode()
    view = memoryview(struct.pack(">I", len(raw)) + raw + payload)
    while view:
        view = view[os.write(1, view) :]


# -- files -------------------------------------------------------------------------------


def checked(rel: str) -> str:
    parts = rel.split("/")
    if not rel or rel.startswith("/") or ".." in parts or rel == ".":
        raise ValueError(f"bad path {rel!r}")
    return os.path.join(WORK, rel)


def _parents_ok(path: str, create: bool) -> bool:
    """Every directory on the way to ``path`` is a real directory (never a link the code
    planted); with ``create``, whatever is in the way is replaced by a directory. No code runs
    while the runner handles files (everything is killed after each command), so checking by
    path is race-free here."""
    parts = os.path.relpath(path, WORK).split("/")[:-1]
    current = WORK
    for part in parts:
        current = os.path.join(current, part)
        if os.path.isdir(current) and not os.path.islink(current):
            continue
        if not create:
            return False
        remove(current)
        os.mkdir(current, 0o755)
    return True


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)  # (the code may have made it read-only)
        wipe(path)
        os.rmdir(path)
    elif os.path.lexists(path):
        os.unlink(path)


class Refused(Exception):
    """A file the code's own doing keeps from being written (a directory it made read-only,
    a full disk): answered as ``{"refused": ...}``, not as a runner error."""


def _writable_way(path: str) -> None:
    """Give the owner write and search permission back on /work and every directory on the
    way to ``path`` (the code may have taken it; the runner owns them)."""
    current = WORK
    for part in ["", *os.path.relpath(path, WORK).split("/")[:-1]]:
        current = os.path.join(current, part) if part else current
        if not os.path.isdir(current) or os.path.islink(current):
            return
        mode = stat.S_IMODE(os.lstat(current).st_mode)
        if mode & 0o300 != 0o300:
            os.chmod(current, mode | 0o300)


def put_files(entries: list, payload: bytes) -> None:
    """Write files under /work, replacing links, fifos or directories the code left there,
    and the permissions it took from the directories on the way; :class:`Refused` at the
    first file the code's doing still keeps from being written (a full disk)."""
    offset = 0
    for rel, size in entries:
        path = checked(rel)
        try:
            _writable_way(path)
            _parents_ok(path, create=True)
            remove(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(payload[offset : offset + size])
        except OSError as exc:
            raise Refused(f"{rel}: cannot write it: {exc.strerror or exc}") from None
        offset += size


def read_regular(rel: str, cap: int) -> bytes | None:
    """A regular file's first ``cap`` bytes; None for a link, fifo, directory or nothing
    (every descriptor it opens is closed, whatever it found)."""
    try:
        path = checked(rel)
        if not _parents_ok(path, create=False):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(cap)
    except OSError:
        return None
    finally:
        os.close(fd)


def get_files(paths: list, cap: int) -> tuple[list, bytes]:
    sizes, chunks = [], []
    for rel in paths:
        data = read_regular(rel, cap)
        sizes.append(-1 if data is None else len(data))
        chunks.append(data or b"")
    return sizes, b"".join(chunks)


def wipe(top: str) -> None:
    for entry in list(os.scandir(top)):
        if entry.is_dir(follow_symlinks=False):
            os.chmod(entry.path, 0o700)
            wipe(entry.path)
            os.rmdir(entry.path)
        else:
            os.unlink(entry.path)


# -- processes ---------------------------------------------------------------------------


def kill_all() -> None:
    """SIGKILL every process of the container except init and the runner, until none is left."""
    me = os.getpid()
    for _ in range(200):
        found = False
        for name in os.listdir("/proc"):
            if not name.isdigit() or int(name) in (1, me):
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    state = f.read().rpartition(b")")[2].split()[0]
                if state in (b"Z", b"X"):
                    continue
                os.kill(int(name), signal.SIGKILL)
                found = True
            except (OSError, IndexError):
                continue
        reap()
        if not found:
            return


def reap() -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def oom_count() -> int | None:
    """The memory cgroup's OOM-kill counter (cgroup v2, then v1), None if unreadable."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


def remove_ipc() -> None:
    """Remove every System V IPC object of this IPC namespace (they outlive their creator)."""
    kinds = (("shm", "shmctl", ()), ("msg", "msgctl", ()), ("sem", "semctl", (0,)))
    for kind, call, extra in kinds:
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                ids = [int(line.split()[1]) for line in f.read().splitlines()[1:] if line.strip()]
        except (OSError, ValueError, IndexError):
            continue
        if ids:
            import ctypes

            ctl = getattr(ctypes.CDLL(None), call)
            for ipc_id in ids:
                ctl(ipc_id, *extra, 0, None)  # IPC_RMID


_KEYCTL = {"x86_64": 250, "aarch64": 219}  # the keyctl syscall (no libc wrapper)


def clear_keyrings() -> None:
    """Empty the kernel keyrings of the sandbox's user (they outlive every process)."""
    nr = _KEYCTL.get(os.uname().machine)
    if nr is None:
        return
    import ctypes

    syscall = ctypes.CDLL(None).syscall
    for keyring in (-4, -5):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
        syscall(nr, 7, keyring)  # KEYCTL_CLEAR (refused under Docker's seccomp: nothing to do)


def own_state() -> tuple:
    """What the code could change in the runner from outside and later commands inherit."""
    limits = tuple(resource.getrlimit(getattr(resource, name)) for name in dir(resource)
                   if name.startswith("RLIMIT_"))  # fmt: skip
    state: tuple = (limits, os.getpriority(os.PRIO_PROCESS, 0))
    with_sched = (getattr(os, "sched_getscheduler", None), getattr(os, "sched_getaffinity", None))
    for call in with_sched:
        if call is not None:
            try:
                state += (call(0),)
            except OSError:
                state += (None,)
    return state


def limits_of(req: dict) -> list[tuple[int, int, int]]:
    """(resource, soft, hard) for a request, clamped to the container's hard limits."""
    mb = 1 << 20
    wanted = [
        (resource.RLIMIT_CPU, req["cpu_s"], req["cpu_s"] + 1),
        (resource.RLIMIT_FSIZE, req["fsize_mb"] * mb, req["fsize_mb"] * mb),
        (resource.RLIMIT_NOFILE, req["nofile"], req["nofile"]),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    if "as_mb" in req:
        wanted.append((resource.RLIMIT_AS, req["as_mb"] * mb, req["as_mb"] * mb))
    if "nproc" in req:
        wanted.append((resource.RLIMIT_NPROC, req["nproc"], req["nproc"]))
    out = []
    for which, soft, hard in wanted:
        _, ceiling = resource.getrlimit(which)
        if ceiling != resource.RLIM_INFINITY:
            soft, hard = min(soft, ceiling), min(hard, ceiling)
        out.append((which, soft, hard))
    return out


def spawn(req: dict, stdin_r: int, out_w: int, err_w: int) -> int:
    """Start the command; returns its pid.

    Fast path (an image with /bin/sh, a request without ``as_mb``/``nproc``, whose ``ulimit``
    flags differ between shells): ``posix_spawn`` (vfork-like, no copy of the runner) of a shell
    stub that sets the rlimits (hard and soft) and then execs the command, so no instruction of
    the command runs without its limits. Otherwise fork, set up, exec.
    """
    if os.path.exists("/bin/sh") and "as_mb" not in req and "nproc" not in req:
        cpu, fsize, nofile, _ = limits_of(req)
        stub = (
            f"ulimit -c 0; ulimit -n {nofile[2]}; ulimit -f {fsize[2] // 512};"
            f' ulimit -S -t {cpu[1]}; ulimit -H -t {cpu[2]}; exec "$@"'
        )
        return os.posix_spawn(
            "/bin/sh",
            ["sh", "-c", stub, "sh", *req["argv"]],
            ENV,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, stdin_r, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ],
            setsid=True,
            setsigmask=(),
            setsigdef=[getattr(signal, name) for name in _DEFAULT_SIGNALS],
        )
    pid = os.fork()
    if pid == 0:
        child(req, stdin_r, out_w, err_w)
    return pid


def child(req: dict, stdin_r: int, out_w: int, err_w: int) -> None:
    """In the forked child: become the command. Never returns."""
    try:
        os.setsid()
        os.dup2(stdin_r, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        # (close_range may be outside the seccomp profile: close up to the fd limit only)
        os.closerange(3, min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 1 << 16))
        for name in _DEFAULT_SIGNALS:
            signal.signal(getattr(signal, name), signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        for which, soft, hard in limits_of(req):
            resource.setrlimit(which, (soft, hard))
        os.chdir(WORK)
        os.execvpe(req["argv"][0], req["argv"], ENV)
    except BaseException as exc:
        os.write(2, f"sandbox: cannot execute {req['argv'][0]!r}: {exc}\n".encode())
    os._exit(127)


class Capture:
    def __init__(self, cap: int) -> None:
        self.cap, self.kept, self.dropped = cap, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        room = max(self.cap - len(self.kept), 0)
        self.kept += chunk[:room]
        self.dropped += max(len(chunk) - room, 0)


def run(req: dict, payload: bytes, wake_r: int) -> tuple[dict, bytes]:
    files_n = sum(size for _, size in req["files"])
    try:
        put_files(req["files"], payload[:files_n])
    except Refused as exc:  # what the code left (a full disk): the run's result, not ours
        return not_written(str(exc))
    stdin = memoryview(payload[files_n:])
    oom_before = oom_count()
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    start = time.monotonic()
    pid = spawn(req, stdin_r, out_w, err_w)
    for fd in (stdin_r, out_w, err_w):
        os.close(fd)
    caps = {out_r: Capture(req["cap"]), err_r: Capture(req["cap"])}
    if not stdin:
        os.close(stdin_w)
    else:
        os.set_blocking(stdin_w, False)
    poller = select.poll()
    for fd in (out_r, err_r, wake_r):
        poller.register(fd, select.POLLIN)
    if stdin:
        poller.register(stdin_w, select.POLLOUT)
    deadline = start + req["timeout"]
    status, timed_out = None, False
    while status is None:
        left = deadline - time.monotonic()
        if left <= 0:  # out of time: the command first, to collect its status
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            status = os.waitpid(pid, 0)[1]
            break
        for fd, _ in poller.poll(left * 1000):
            if fd == wake_r:
                os.read(wake_r, CHUNK)
            elif fd == stdin_w:
                try:
                    stdin = stdin[os.write(stdin_w, stdin[:CHUNK]) :]
                except OSError:  # the command closed its stdin: fine
                    stdin = stdin[:0]
                if not stdin:
                    poller.unregister(stdin_w)
                    os.close(stdin_w)
            else:
                chunk = os.read(fd, CHUNK)
                if chunk:
                    caps[fd].add(chunk)
                else:
                    poller.unregister(fd)
        got, raw = os.waitpid(pid, os.WNOHANG)
        if got:
            status = raw
    # The command is done (or out of time): nothing else it started may live on.
    kill_all()
    remove_ipc()
    for fd, cap in caps.items():  # every writer is dead: read what is left up to EOF
        while chunk := os.read(fd, CHUNK):
            cap.add(chunk)
        os.close(fd)
    if stdin:
        os.close(stdin_w)
    code = os.waitstatus_to_exitcode(status)
    exit_code = 128 - code if code < 0 else code
    oom_after = oom_count()
    reply = {
        "exit_code": None if timed_out else exit_code,
        "timed_out": timed_out or exit_code == 128 + signal.SIGXCPU,
        "oom": oom_before is not None and oom_after is not None and oom_after > oom_before,
        "duration_s": time.monotonic() - start,
        "out_n": len(caps[out_r].kept),
        "out_dropped": caps[out_r].dropped,
        "err_dropped": caps[err_r].dropped,
    }
    return reply, bytes(caps[out_r].kept) + bytes(caps[err_r].kept)


def not_written(why: str) -> tuple[dict, bytes]:
    """The reply of a run whose files could not be written: nothing ran."""
    err = f"sandbox: the request's files could not be written: {why}\n".encode()
    reply = {"exit_code": None, "timed_out": False, "oom": False, "duration_s": 0.0,
             "out_n": 0, "out_dropped": 0, "err_dropped": 0}
    return reply, err


def reset(baseline: tuple) -> None:
    kill_all()
    remove_ipc()
    clear_keyrings()
    os.chmod(WORK, 0o700)
    for top in WIPE:
        if os.path.isdir(top) and os.access(top, os.W_OK):
            wipe(top)
    if own_state() != baseline:
        raise RuntimeError("the runner's rlimits, priority or affinity were changed: discard it")


def serve() -> None:
    try:  # non-dumpable: processes of the same uid cannot ptrace us or open /proc/<us>/fd
        import ctypes

        dumpable = ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0  # PR_SET_DUMPABLE
    except (ImportError, OSError, AttributeError):
        dumpable = True
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGXFSZ", "SIGPIPE"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    ENV["PATH"] = os.environ.get("PATH") or ENV["PATH"]
    baseline = own_state()
    os.makedirs(WORK, exist_ok=True)
    os.chdir(WORK)  # the cwd every command inherits
    write_frame({"op": "ready", "pid": os.getpid(), "oom": oom_count() is not None,
                 "dumpable": dumpable})  # fmt: skip
    while True:
        try:
            req, payload = read_frame()
        except EOFError:  # the host went away: end the container
            kill_all()
            return
        reply: dict = {}
        out = b""
        try:
            op = req["op"]
            if op == "run":
                reply, out = run(req, payload, wake_r)
            elif op == "put":
                put_files(req["files"], payload)
            elif op == "get":
                reply["sizes"], out = get_files(req["paths"], req.get("cap", 1 << 26))
            elif op == "reset":
                reset(baseline)
            else:
                raise ValueError(f"unknown op {op!r}")
        except Refused as exc:
            reply, out = {"refused": str(exc)}, b""
        except Exception as exc:
            reply, out = {"error": f"{type(exc).__name__}: {exc}"}, b""
        reply["id"] = req.get("id")
        write_frame(reply, out)


if __name__ == "__main__":
    serve()
    sys.exit(0)
