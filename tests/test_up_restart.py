"""``up`` restarts a child that dies (after a backoff, ``streamrl.backoff``), gives up on one in
a crash loop, and leaves one that exits 0 (its work done: the learner at ``learner.max_steps``)
alone. ``cli.up.Child`` on real processes: a Python one-liner that prints and exits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import trio

from streamrl.backoff import Backoff
from streamrl.cli.up import CRASH_LOOP_EXITS, Child, _serve_embedded
from streamrl.queues.server import ServerProcess, running_url
from streamrl.testing.wait import wait_until


def _child(tmp_path: Path, code: int) -> Child:
    return Child(
        actor="learner",
        index=0,
        argv=[sys.executable, "-c", f"print('started', flush=True); raise SystemExit({code})"],
        env={},
        log_path=tmp_path / "learner-0.log",
        backoff=Backoff(first_s=0.01, max_s=0.05),
    )


def _starts(child: Child) -> int:
    return child.log_path.read_text().count("started")


async def test_a_child_that_exits_0_is_not_restarted(tmp_path: Path) -> None:
    # Given a child whose process ends by itself with exit code 0 (its work is done)
    child = _child(tmp_path, 0)
    # When `up` serves it
    with trio.fail_after(30):
        await child.serve()
    # Then it ran once, is finished, and was neither restarted nor given up on
    assert _starts(child) == 1
    assert child.finished and child.restarts == 0 and not child.gave_up


async def test_a_child_that_keeps_failing_is_restarted_then_given_up(tmp_path: Path) -> None:
    # Given a child whose process fails at every start
    child = _child(tmp_path, 3)
    # When `up` serves it
    with trio.fail_after(30):
        await child.serve()
    # Then it was restarted (after the backoff) until the crash-loop limit, then given up on
    assert _starts(child) == CRASH_LOOP_EXITS
    assert child.restarts == CRASH_LOOP_EXITS - 1 and not child.finished
    assert f"exited {CRASH_LOOP_EXITS} times in a row" in child.gave_up
    assert "last exit code 3" in child.gave_up


def _serving(server: ServerProcess, killed: set[int]) -> subprocess.Popen[bytes] | None:
    """The server's process once it answers, unless it is one killed already."""
    process = server.process
    if process is None or process.pid in killed or not server.running:
        return None
    return process if running_url(server.data_dir) is not None else None


async def test_an_embedded_server_that_keeps_dying_ends_the_run(tmp_path: Path) -> None:
    # Given the embedded server served by `up`, killed again each time it is back
    server = ServerProcess(tmp_path / "redis").start()
    killed: set[int] = set()
    try:
        with trio.fail_after(60):
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_serve_embedded, server, Backoff(first_s=0.01, max_s=0.05))
                    for _ in range(CRASH_LOOP_EXITS):
                        process = await wait_until(lambda: _serving(server, killed), timeout=30)
                        killed.add(process.pid)
                        process.kill()
            except BaseExceptionGroup as group:
                ended = group
    finally:
        server.stop()
    # Then it was restarted after each death until the crash-loop limit, then ended the run
    assert len(killed) == CRASH_LOOP_EXITS, repr(ended.exceptions)
    (exit_,) = ended.exceptions
    assert isinstance(exit_, SystemExit)
    assert f"exited {CRASH_LOOP_EXITS} times in a row" in str(exit_)
    assert str(tmp_path / "redis" / "server.log") in str(exit_)


async def test_an_embedded_server_that_cannot_be_started_again_ends_the_run(
    tmp_path: Path,
) -> None:
    # Given the embedded server served by `up`, whose binary is gone once it runs
    server = ServerProcess(tmp_path / "redis").start()
    server.binary = str(tmp_path / "no-redis-server")
    ended: BaseExceptionGroup | None = None
    try:
        with trio.fail_after(60):
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_serve_embedded, server, Backoff(first_s=0.01, max_s=0.05))
                    # When it dies (and every start after fails: no such file)
                    assert server.process is not None
                    server.process.kill()
            except BaseExceptionGroup as group:
                ended = group
    finally:
        server.stop()
    # Then each failed start counts as an exit, and the crash loop ends the run in its words
    assert ended is not None
    (exit_,) = ended.exceptions
    assert isinstance(exit_, SystemExit), repr(exit_)
    assert f"exited {CRASH_LOOP_EXITS} times in a row" in str(exit_)
