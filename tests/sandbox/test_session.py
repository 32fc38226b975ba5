"""Sessions (one episode's sandbox) on every backend: files persist across runs, ``reset``
cleans, the session is released on every exit path, and host-side file access cannot be
turned against the host by what the code left in the work dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from streamrl.sandbox import ExecRequest, Limits, Sandbox, SandboxUnavailable

from .conftest import processes_with


def py(code: str, marker: str) -> ExecRequest:
    return ExecRequest(["python3", "-c", code, marker])


async def test_files_persist_across_runs_until_reset(backend: Sandbox, marker: str) -> None:
    async with backend.session(Limits(), label=marker) as s:
        # Given a file written by one run and one put from the host
        first = await s.run(py("open('state.txt', 'w').write('turn1')", marker))
        await s.put_files({"dir/given.txt": b"from host"})
        # When the next run reads both
        second = await s.run(py("print(open('state.txt').read(), open('dir/given.txt').read())",
                                marker))  # fmt: skip
        # Then they were there, and the host reads what the code wrote
        assert first.ok and second.ok and second.stdout == b"turn1 from host\n"
        assert await s.get_files(["state.txt", "missing"]) == {"state.txt": b"turn1",
                                                               "missing": None}  # fmt: skip
        # And after a reset the work dir is empty again
        await s.reset()
        assert await s.get_files(["state.txt", "dir/given.txt"]) == {
            "state.txt": None, "dir/given.txt": None,
        }  # fmt: skip
        after = await s.run(py("import os; print(sorted(os.listdir('.')))", marker))
        assert after.ok and after.stdout == b"[]\n"


async def test_session_limits_apply_to_every_run(backend: Sandbox, marker: str) -> None:
    async with backend.session(Limits(timeout_s=0.5), label=marker) as s:
        result = await s.run(py("import time; time.sleep(30)", marker))
    assert result.timed_out and result.duration_s < 3


async def test_session_released_when_the_body_raises(backend: Sandbox, marker: str) -> None:
    with pytest.raises(RuntimeError, match="episode failed"):
        async with backend.session(Limits(), label=marker) as s:
            await s.run(py("open('x', 'w').write('x')", marker))
            raise RuntimeError("episode failed")
    with pytest.raises(SandboxUnavailable):
        await s.run(py("print(1)", marker))
    assert not processes_with(marker)


async def test_get_files_does_not_follow_planted_links(backend: Sandbox, marker: str) -> None:
    # Given a run that plants a symlink to a host secret and a fifo where outputs are read
    code = "import os; os.symlink('/etc/shadow', 'out.txt'); os.mkfifo('pipe.txt')"
    async with backend.session(Limits(), label=marker) as s:
        assert (await s.run(py(code, marker))).ok
        # When the host collects the outputs, Then it gets nothing (and does not block)
        assert await s.get_files(["out.txt", "pipe.txt"]) == {"out.txt": None, "pipe.txt": None}


async def test_put_files_do_not_follow_planted_links(
    backend: Sandbox, marker: str, tmp_path: Path
) -> None:
    # Given a run that turns a directory and a file name into links to a host directory
    os.chmod(tmp_path, 0o777)
    host = str(tmp_path)
    code = f"import os; os.symlink({host!r}, 'd'); os.symlink({host!r} + '/f', 'f')"
    async with backend.session(Limits(), label=marker) as s:
        assert (await s.run(py(code, marker))).ok
        # When the host puts files through those names
        await s.put_files({"d/planted.txt": b"x", "f": b"y"})
        # Then they land in the work dir, never in the host directory
        assert list(tmp_path.iterdir()) == []
        check = await s.run(py("print(open('d/planted.txt').read() + open('f').read())", marker))
        assert check.stdout == b"xy\n"


async def test_cancelled_run_leaves_nothing_behind(backend: Sandbox, marker: str) -> None:
    # Given a run (with a background child) that outlasts the caller's patience
    code = "import os, time; os.fork(); time.sleep(30)"
    with trio.move_on_after(1.5) as scope:
        async with backend.session(Limits(timeout_s=30), label=marker) as s:
            await s.run(ExecRequest(["python3", "-c", code, marker], limits=Limits(timeout_s=30)))
    # When the caller is cancelled, Then the call returns and (marker fixture) nothing is left
    assert scope.cancelled_caught
