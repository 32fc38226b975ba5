"""The process backend is structured: its warm pool of resident sandboxes runs in its owner's
nursery (``serve``), a runner lost mid-call or a failed pool raises ``SandboxUnavailable``
into the callers (retryable, chained to the failure) instead of a result, and nothing it
started outlives the ``async with`` or the cancelled nursery."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
import trio

from streamrl.sandbox import ExecRequest, Limits, ProcessSandbox, SandboxUnavailable, opened
from streamrl.sandbox.runner_channel import RunnerGone
from streamrl.testing.wait import wait_until

from .conftest import processes_with

SANDBOX_DIR = Path(__file__).resolve().parents[2] / "sandbox"


def _resident(**options: int) -> ProcessSandbox:
    box = ProcessSandbox(isolation="bwrap", **options)  # type: ignore[arg-type]
    if not box.resident:
        pytest.skip(f"no resident bwrap sandbox here: {box.detail}")
    return box


def _sleeper(marker: str, seconds: int = 30) -> ExecRequest:
    code = f"import time; time.sleep({seconds})"
    return ExecRequest(["python3", "-c", code, marker], limits=Limits(timeout_s=seconds + 10))


async def _kill_runner_of(marker: str) -> None:
    """SIGKILL, from the host, the runner whose command carries ``marker``."""
    [pid] = await wait_until(lambda: processes_with(marker))
    os.kill(psutil.Process(pid).ppid(), signal.SIGKILL)


def _monitors() -> list[psutil.Process]:
    """This test process's bubblewrap monitors (one per resident sandbox)."""
    found = []
    for child in psutil.Process().children():
        try:
            if "bwrap" in os.path.basename(child.cmdline()[0]):
                found.append(child)
        except (psutil.NoSuchProcess, IndexError):
            continue
    return found


def _sandbox_processes() -> set[psutil.Process]:
    """The monitors and everything below them (the runners, their commands)."""
    found: set[psutil.Process] = set()
    for monitor in _monitors():
        with_children = {monitor}
        try:
            with_children |= set(monitor.children(recursive=True))
        except psutil.NoSuchProcess:
            continue
        found |= with_children
    return found


def _alive(procs: set[psutil.Process]) -> list[psutil.Process]:
    """Those still running (``is_running`` also checks the pid was not reused; a zombie is
    dead, waiting for its parent or its pid namespace to reap it)."""
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


@pytest.mark.parametrize("how", ["run", "session"])
async def test_a_runner_killed_mid_run_raises_unavailable(how: str, marker: str) -> None:
    # Given a served process sandbox, and a command running in a resident sandbox
    async with opened(_resident()) as box:
        async with trio.open_nursery() as nursery:
            # When its runner is killed from outside while the command runs
            nursery.start_soon(_kill_runner_of, marker)
            with pytest.raises(SandboxUnavailable) as caught:
                if how == "run":
                    await box.run(_sleeper(marker))
                else:
                    async with box.session(Limits(timeout_s=40), label=marker) as session:
                        await session.run(_sleeper(marker))
        # Then the call raises a retryable SandboxUnavailable chained to the lost runner,
        # not a result that would be published as what the code did
        assert isinstance(caught.value.__cause__, RunnerGone), caught.value
        # And the sandbox goes on: the next call gets a fresh runner
        assert (await box.run(ExecRequest(["echo", "next"]))).stdout == b"next\n"


async def test_a_failed_pool_cuts_calls_short_and_stops_the_backend(marker: str) -> None:
    # Given a served sandbox whose pool (one ready runner) will fail to start the next runner
    failure = OSError(24, "Too many open files (planted)")
    go = trio.Event()

    async def failing_start() -> None:
        await go.wait()
        raise failure

    box = _resident(pool_size=1)
    async with opened(box):
        await wait_until(lambda: box.statistics().ready == 1)
        box._pool._start_one = failing_start  # type: ignore[union-attr, assignment]
        errors: list[BaseException] = []

        async def run_in_session() -> None:
            async with box.session(Limits(timeout_s=40), label=marker) as session:
                try:
                    await session.run(_sleeper(marker))
                except SandboxUnavailable as exc:
                    errors.append(exc)

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_in_session)
                await wait_until(lambda: processes_with(marker))
                # When the pool fails while a command runs
                go.set()
        # Then the call in flight is cut short, chained to the pool's failure
        [error] = errors
        assert error.__cause__ is failure, error
        # And the backend is stopped: every later call says why (the owner opens a fresh one)
        assert box.stopped
        with pytest.raises(SandboxUnavailable) as later:
            await box.run(ExecRequest(["true"]))
        assert later.value.__cause__ is failure
    # And the owner's nursery closed normally: the failure went to the callers, not into it


async def test_closing_leaves_no_runner_process(marker: str) -> None:
    # Given a served sandbox with a warm pool and a session running a command
    async with opened(_resident(pool_size=2)) as box:
        session_cm = box.session(Limits(timeout_s=40), label=marker)
        async with session_cm as session, trio.open_nursery() as nursery:
            nursery.start_soon(session.run, _sleeper(marker))
            await wait_until(lambda: processes_with(marker))
            await wait_until(lambda: box.statistics().ready == 2)
            assert len(_monitors()) == 3  # the session's sandbox and two ready ones
            runners = _sandbox_processes()
            nursery.cancel_scope.cancel()
    # When the async with ends, Then no monitor or runner of it is left
    await wait_until(lambda: not _alive(runners), timeout=5)


async def test_a_cancelled_serve_kills_every_runner(marker: str) -> None:
    # Given a sandbox served by its owner's nursery (no aclose), its pool warm, a command running
    box = _resident(pool_size=1)
    async with trio.open_nursery() as owner:
        await owner.start(box.serve)
        owner.start_soon(box.run, _sleeper(marker))
        await wait_until(lambda: processes_with(marker))
        await wait_until(lambda: box.statistics().ready == 1)
        assert len(_monitors()) == 2  # the command's sandbox and a ready one
        runners = _sandbox_processes()
        # When the owner's nursery is cancelled
        owner.cancel_scope.cancel()
    # Then serve killed every runner before it returned (SIGKILLed: gone a moment later)
    assert box.stopped
    await wait_until(lambda: not _alive(runners), timeout=5)


async def test_a_resident_sandbox_must_be_served_a_one_shot_one_need_not() -> None:
    # A resident sandbox nobody serves is a programming error, said plainly
    with pytest.raises(RuntimeError, match="not served"):
        await _resident().run(ExecRequest(["true"]))
    # A sandbox without resident sandboxes runs each command on its own: no serving needed
    one_shot = ProcessSandbox(resident=False)
    assert (await one_shot.run(ExecRequest(["echo", "hi"]))).stdout == b"hi\n"


def test_no_system_task_in_the_sandbox_package() -> None:
    # Every background task of a backend runs in its owner's nursery
    for source in SANDBOX_DIR.glob("*.py"):
        assert "spawn_system_task" not in source.read_text(), source


async def test_an_exception_leaves_opened_as_itself() -> None:
    # Given a served sandbox, and a body that raises SandboxUnavailable
    box = _resident(pool_size=1)
    cause = RunnerGone("planted")
    # When it leaves the block
    with pytest.raises(SandboxUnavailable, match="planted") as raised:
        async with opened(box):
            raise SandboxUnavailable("planted") from cause
    # Then it is the exception itself (not inside the nursery's ExceptionGroup), cause kept,
    # and the backend is closed
    assert type(raised.value) is SandboxUnavailable and raised.value.__cause__ is cause
    assert box._closed  # type: ignore[attr-defined]
    # And a failure to start serving comes out as itself too
    failing = _resident(pool_size=1)

    async def serve(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        raise SandboxUnavailable("cannot start (planted)")

    failing.serve = serve  # type: ignore[method-assign]
    with pytest.raises(SandboxUnavailable, match="cannot start"):
        async with opened(failing):
            pytest.fail("the block ran without its backend")
