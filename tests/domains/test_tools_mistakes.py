"""The standard tools answer a model's ordinary mistakes, in every sandbox mode they run in.

Reading or patching a directory, an odd character (a lone surrogate, a NUL byte) in a path,
a file's content, a patch or a command, writing where the model took the write permission
away or filled the disk, a command that ignores SIGTERM: each is an error observation (or
what the command did) that says what was wrong, never an exception out of the tool layer,
and the session, its runner and the turn carry on. Issue 32, item 1 and item 7's timeouts.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

from streamrl.domains.tools.standard import TOOLS, StandardTools, ToolLimits
from streamrl.inference.chat import ToolResult, parse_tool_calls
from streamrl.sandbox import opened
from streamrl.sandbox.base import ExecRequest, Limits, SandboxSession
from streamrl.sandbox.resident import ResidentSession
from streamrl.testing.processes import descendants
from tests.sandbox.conftest import open_backend, usable_backend
from tests.sandbox.docker_engine import require_docker

LIMITS = Limits(timeout_s=20.0, memory_mb=512, cpu_s=20, max_file_mb=8, output_bytes=1 << 20)
MODES = ("process", "process:bwrap-per-command", "process:unshare", "docker")
"""Resident bwrap sandboxes, a bwrap sandbox per command, unshare, and Docker containers."""


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """The sandbox mode; one that cannot run here skips (Docker fails under CI instead)."""
    if request.param == "docker":
        require_docker("the standard tools on the Docker backend")
        return "docker"
    return usable_backend(request.param, {})


@pytest.fixture
async def session(mode: str) -> AsyncIterator[SandboxSession]:
    async with opened(open_backend(mode)) as box, box.session(LIMITS, label="mistakes") as s:
        yield s


async def use(tools: StandardTools, name: str, **arguments: Any) -> ToolResult:
    """Call ``name`` the way the model does: JSON text (a lone surrogate travels as the valid
    JSON escape ``\\ud800``), parsed strictly, answered."""
    text = "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    (result,) = await tools.answer(parse_tool_calls(text, TOOLS))
    return result


async def sh(session: SandboxSession, command: str) -> str:
    r = await session.run(ExecRequest(argv=["sh", "-c", command]))
    return r.stdout.decode()


async def carries_on(tools: StandardTools) -> None:
    """The session and its runner still work: a write, a read and a command."""
    w = await use(tools, "write_file", path="after.txt", content="still here\n")
    assert not w.error, w
    assert (await use(tools, "read_file", path="after.txt")).content == "still here\n"
    assert (await use(tools, "run", command="cat after.txt")).content.endswith("still here")


async def test_reading_or_patching_a_directory_is_an_error_observation(
        session: SandboxSession) -> None:
    tools = StandardTools(session)
    await sh(session, "mkdir -p tests/unit && echo x > tests/unit/t.py")
    # When the model reads a directory, patches one, and creates a file where one is
    read = await use(tools, "read_file", path="tests")
    patch = await use(tools, "apply_patch", patch="--- a/tests\n+++ b/tests\n@@ -1 +1 @@\n-x\n"
                                                  "+y\n")
    create = await use(tools, "apply_patch", patch="--- /dev/null\n+++ b/tests\n@@ -0,0 +1 @@\n"
                                                   "+y\n")
    # Then each is an error that says what was wrong, and nothing changed
    assert read.error and "tests: not a regular file" in read.content, read
    assert patch.error and "tests: not a regular file" in patch.content, patch
    assert create.error and "tests: already exists" in create.content, create
    assert await sh(session, "cat tests/unit/t.py") == "x\n"
    await carries_on(tools)


async def test_reading_a_directory_leaks_no_descriptor(session: SandboxSession) -> None:
    # Given the process that opens the work dir's files: the resident runner, or this one
    if isinstance(session, ResidentSession):
        [runner] = [d.pid for d in descendants()
                    if d.cmdline.startswith("python3 -I -S -c ") and _in_tree(d.pid, session.pid)]
    elif hasattr(session, "workdir"):
        runner = os.getpid()
    else:
        pytest.skip("the runner is inside a container: its descriptors are not visible here")
    await sh(session, "mkdir d")
    tools = StandardTools(session)
    await use(tools, "read_file", path="d")  # (anything opened once for good)
    before = len(os.listdir(f"/proc/{runner}/fd"))
    # When the model reads the directory 50 times
    for _ in range(50):
        assert (await use(tools, "read_file", path="d")).error
    # Then no descriptor is left open
    assert len(os.listdir(f"/proc/{runner}/fd")) == before


def _in_tree(pid: int, top: int | None) -> bool:
    parents = {d.pid: d.parent for d in descendants()}
    while pid in parents and pid != top:
        pid = parents[pid]
    return pid == top


@pytest.mark.parametrize(("name", "arguments", "why"), [
    ("write_file", {"path": "a.py", "content": "x = '\ud800'\n"}, "content: not valid Unicode"),
    ("write_file", {"path": "b\ud800.py", "content": "x\n"}, "not valid Unicode"),
    ("read_file", {"path": "\ud800"}, "not valid Unicode"),
    ("list_files", {"path": "d\udc80"}, "not valid Unicode"),
    ("apply_patch", {"patch": "--- a/f.py\n+++ b/f.py\n@@ -1 +1 @@\n-x = 1\n+x = '\ud800'\n"},
     "patch: not valid Unicode"),
    ("apply_patch", {"patch": "--- /dev/null\n+++ b/g\ud800.py\n@@ -0,0 +1 @@\n+x\n"},
     "not valid Unicode"),
    ("run", {"command": "echo a\x00b"}, "command: a NUL character"),
    ("run", {"command": "echo \ud800"}, "command: not valid Unicode"),
    ("run_tests", {"tests": ["t\ud800.py"]}, "not valid Unicode"),
])
async def test_an_odd_character_is_an_error_observation(
        session: SandboxSession, name: str, arguments: dict[str, Any], why: str) -> None:
    tools = StandardTools(session)
    await session.put_files({"f.py": b"x = 1\n"})
    r = await use(tools, name, **arguments)
    assert r.error and why in r.content, r
    assert await sh(session, "cat f.py; ls") == "x = 1\nf.py\n"  # nothing was written
    await carries_on(tools)


async def test_writing_into_a_read_only_directory_works(session: SandboxSession) -> None:
    tools = StandardTools(session)
    await session.put_files({"sub/a.py": b"x = 1\n", "sub/deep/t.py": b"t\n"})
    # Given a work dir and directories the model made read-only (one with nothing for
    # anyone, and one it replaces with a file)
    r = await use(tools, "run", command="chmod 555 sub . && chmod 000 sub/deep && echo ok")
    assert r.content.endswith("ok")
    # When it writes and patches there, and a run brings files of its own
    results = [await use(tools, "write_file", path="new.py", content="x\n"),
               await use(tools, "write_file", path="sub/b.py", content="x\n"),
               await use(tools, "apply_patch", patch="--- a/sub/a.py\n+++ b/sub/a.py\n"
                                                     "@@ -1 +1 @@\n-x = 1\n+x = 2\n"),
               await use(tools, "write_file", path="sub/deep/u.py", content="u\n")]
    staged = await session.run(ExecRequest(argv=["cat", "sub/staged.txt"],
                                           files={"sub/staged.txt": b"s\n"}))
    # Then each worked, in every mode (the owner's write permission is given back on the
    # way, as the host writing as root ignores it in the per-command modes)
    assert [r.error for r in results] == [False] * 4, results
    assert (staged.exit_code, staged.stdout) == (0, b"s\n")
    assert await sh(session, "cat new.py sub/b.py sub/a.py sub/deep/u.py sub/staged.txt") == \
        "x\nx\nx = 2\nu\ns\n"
    await carries_on(tools)


async def test_a_deletion_the_models_permissions_keep_out_changes_nothing(
        session: SandboxSession) -> None:
    tools = StandardTools(session)
    await session.put_files({"sub/a.py": b"x = 1\n", "sub/b.py": b"y\n"})
    await use(tools, "run", command="chmod 555 sub")
    # When a patch deletes a file of the read-only directory (as the model: it cannot) and
    # changes another
    r = await use(tools, "apply_patch", patch="--- a/sub/a.py\n+++ /dev/null\n@@ -1 +0,0 @@\n"
                  "-x = 1\n--- a/sub/b.py\n+++ b/sub/b.py\n@@ -1 +1 @@\n-y\n+z\n")
    # Then it says so, and nothing changed
    assert r.error and "sub/a.py: cannot delete it" in r.content, r
    assert "Permission denied" in r.content, r
    assert await sh(session, "cat sub/a.py sub/b.py") == "x = 1\ny\n"


async def test_writing_into_a_full_work_dir_is_answered(session: SandboxSession) -> None:
    tools = StandardTools(session)
    # Given a work dir the model filled (a tmpfs of 64 MB where it is one, nine files of the
    # largest size the limits allow)
    await use(tools, "run", command="for i in $(seq 9); do head -c 8000000 /dev/zero > big$i;"
                                    " done; true")
    # When it writes a file
    w = await use(tools, "write_file", path="more.txt", content="y" * 100_000)
    # Then it worked, or it is an error that says the disk is full; a run whose files do
    # not fit runs nothing and says so
    assert not w.error or "No space left" in w.content, w
    r = await session.run(ExecRequest(argv=["touch", "ran"], files={"f.txt": b"y" * 100_000}))
    assert r.exit_code == 0 or (r.exit_code is None and not r.timed_out and
                                b"files could not be written" in r.stderr), r
    assert (r.exit_code == 0) == (w.error is False)
    assert (await use(tools, "run", command="rm big* && echo ok")).content.endswith("ok")
    await carries_on(tools)


async def test_a_command_past_its_timeout_is_reported_timed_out(session: SandboxSession) -> None:
    tools = StandardTools(session, limits=ToolLimits(run_timeout_s=5.0, test_timeout_s=2.0))
    # a command that ignores SIGTERM is killed a second later: still "timed out"
    stubborn = await use(tools, "run", command="trap '' TERM; sleep 30", timeout_s=1)
    assert stubborn.content.startswith("timed out after 1 s"), stubborn
    plain = await use(tools, "run", command="sleep 30", timeout_s=1)
    assert plain.content.startswith("timed out after 1 s"), plain
    # and the exit codes `timeout` uses, when the command itself exits with them, are not
    assert (await use(tools, "run", command="exit 124")).content == "exit code 124"
    killed = await use(tools, "run", command="kill -9 $$")
    assert killed.content.startswith("exit code 137"), killed
    has_pytest = await session.run(ExecRequest(argv=["python3", "-c", "import pytest"]))
    if has_pytest.ok:  # the tests, too (the sandbox image has no pytest)
        await session.put_files({"test_slow.py": b"import signal, time\nsignal.signal("
                                 b"signal.SIGTERM, signal.SIG_IGN)\n\ndef test_slow():\n"
                                 b"    time.sleep(30)\n"})
        tests = await use(tools, "run_tests")
        assert tests.content.startswith("tests timed out"), tests
