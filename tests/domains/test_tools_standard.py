"""domains/tools/standard.py: every standard tool against a real process sandbox session, and
the attacks (escaping the work dir, huge outputs, malformed calls, unknown tools), each
contained and answered with an error result."""

from __future__ import annotations

import json
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from streamrl.domains.tools.pytest_report import parse_junit, parse_summary
from streamrl.domains.tools.standard import TOOLS, StandardTools, ToolLimits
from streamrl.inference.chat import ToolCall, ToolResult, parse_tool_calls
from streamrl.sandbox import ProcessSandbox, opened
from streamrl.sandbox.base import ExecRequest, Limits, SandboxSession

LIMITS = Limits(timeout_s=20.0, memory_mb=512, cpu_s=20, max_file_mb=8, output_bytes=1 << 20)
SANDBOX_PYTEST = subprocess.run(["/usr/bin/python3", "-c", "import pytest"],
                                capture_output=True).returncode == 0
needs_pytest = pytest.mark.skipif(not SANDBOX_PYTEST, reason="the sandbox's python3 has no "
                                  "pytest (Debian: apt-get install python3-pytest; .ci/run does)")


@pytest.fixture(params=["resident", "per-command"])
async def session(request: pytest.FixtureRequest) -> AsyncIterator[SandboxSession]:
    """A real process sandbox session: a resident bwrap sandbox (files read and written by
    its runner, inside), or a bwrap sandbox per command on a host work dir (files read and
    written by this process, as root where the tests run as root)."""
    if request.param == "resident":
        box = ProcessSandbox()
    else:
        box = ProcessSandbox(resident=False)
        assert box.isolation == "bwrap" and not box.resident
    async with opened(box), box.session(LIMITS, label="tools") as s:
        yield s


async def use(tools: StandardTools, name: str, **arguments: Any) -> ToolResult:
    """Call ``name`` the way the model does: text, parsed strictly, answered."""
    text = "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    (result,) = await tools.answer(parse_tool_calls(text, TOOLS))
    return result


async def sh(session: SandboxSession, command: str) -> str:
    r = await session.run(ExecRequest(argv=["sh", "-c", command]))
    return r.stdout.decode()


# --------------------------------------------------------------------------- each tool


async def test_write_then_read_a_file_and_a_line_range(session: SandboxSession) -> None:
    tools = StandardTools(session)
    w = await use(tools, "write_file", path="src/calc.py", content="a = 1\nb = 2\nc = 3\n")
    assert not w.error and w.content == "wrote src/calc.py (18 bytes)"
    assert await sh(session, "cat src/calc.py") == "a = 1\nb = 2\nc = 3\n"
    assert (await use(tools, "read_file", path="src/calc.py")).content == "a = 1\nb = 2\nc = 3\n"
    part = await use(tools, "read_file", path="./src/calc.py", start_line=2, end_line=3)
    assert part.content == "b = 2\nc = 3\n"
    missing = await use(tools, "read_file", path="nope.py")
    assert missing.error and "not a regular file" in missing.content


async def test_list_files_shows_files_dirs_and_links_as_links(session: SandboxSession) -> None:
    tools = StandardTools(session)
    await sh(session, "mkdir -p pkg/sub && printf 12345 > pkg/sub/x.py && touch top.txt"
                      " && ln -s /etc pkg/etc && mkdir .git && touch .git/HEAD")
    listing = (await use(tools, "list_files")).content.splitlines()
    assert listing == ["pkg/", "pkg/etc (symbolic link, not followed)", "pkg/sub/",
                       "pkg/sub/x.py (5 bytes)", "top.txt (0 bytes)"]
    assert (await use(tools, "list_files", path="pkg/sub")).content == "pkg/sub/x.py (5 bytes)"
    assert "not a directory" in (await use(tools, "list_files", path="top.txt")).content


async def test_run_returns_exit_code_and_output_and_times_out(session: SandboxSession) -> None:
    tools = StandardTools(session, limits=ToolLimits(run_timeout_s=5.0))
    r = await use(tools, "run", command="echo out; echo err >&2; exit 3")
    assert r.content == "exit code 3\nstdout:\nout\nstderr:\nerr" and not r.error
    slow = await use(tools, "run", command="sleep 30", timeout_s=1)
    assert slow.content.startswith("timed out after 1 s")
    # a timeout larger than the tool's cap is cut to it (the session's own limit stays)
    assert (await use(tools, "run", command="true", timeout_s=500)).content == "exit code 0"


async def test_apply_patch_modifies_creates_and_deletes_files(session: SandboxSession) -> None:
    tools = StandardTools(session)
    lines = "".join(f"line {i}\n" for i in range(1, 21))
    await session.put_files({"a.txt": lines.encode(), "gone.txt": b"bye\n"})
    # the hunk's header says line 3, the text is at line 10: applied where it matches exactly
    patch = ("diff --git a/a.txt b/a.txt\n--- a/a.txt\n+++ b/a.txt\n@@ -3,3 +3,3 @@\n"
             " line 9\n-line 10\n+LINE TEN\n line 11\n"
             "--- /dev/null\n+++ b/new/hello.py\n@@ -0,0 +1,2 @@\n+print('hi')\n+x = 1\n"
             "--- a/gone.txt\n+++ /dev/null\n@@ -1 +0,0 @@\n-bye\n")
    r = await use(tools, "apply_patch", patch=patch)
    assert r.content == "patched a.txt\npatched new/hello.py\ndeleted gone.txt", r.content
    assert await sh(session, "sed -n 9,11p a.txt; cat new/hello.py; ls gone.txt 2>&1") == (
        "line 9\nLINE TEN\nline 11\nprint('hi')\nx = 1\n"
        "ls: cannot access 'gone.txt': No such file or directory\n")


async def test_apply_patch_is_all_or_nothing_and_refuses_fuzz(session: SandboxSession) -> None:
    tools = StandardTools(session)
    await session.put_files({"a.py": b"x = 1\ny = 2\n", "b.py": b"def f():\n    return 1\n"})
    good = "--- a/a.py\n+++ b/a.py\n@@ -1,2 +1,2 @@\n-x = 1\n+x = 10\n y = 2\n"
    # b.py's context differs by indentation only (fuzz): the whole patch is refused
    fuzzy = "--- a/b.py\n+++ b/b.py\n@@ -1,2 +1,2 @@\n def f():\n-  return 1\n+  return 2\n"
    r = await use(tools, "apply_patch", patch=good + fuzzy)
    assert r.error and "b.py: hunk 1 does not apply" in r.content
    assert await sh(session, "cat a.py b.py") == "x = 1\ny = 2\ndef f():\n    return 1\n"
    for bad, why in [
        ("--- a/a.py\n+++ b/c.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n", "renames are refused"),
        ("--- a/a.py\n+++ b/a.py\n@@ -1,5 +1,5 @@\n-x = 1\n+x = 2\n", "ends inside a hunk"),
        ("--- a/a.py\n+++ b/a.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n" * 2, "twice in one patch"),
        ("just text", "no file headers"),
        ("--- /dev/null\n+++ b/a.py\n@@ -0,0 +1 @@\n+z\n", "already exists"),
        ("--- a/a.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x = 1\n", "must remove every line"),
    ]:
        r = await use(tools, "apply_patch", patch=bad)
        assert r.error and why in r.content, (bad, r.content)
    assert await sh(session, "cat a.py; ls") == "x = 1\ny = 2\na.py\nb.py\n"


@needs_pytest
async def test_run_tests_reports_each_test_with_its_message(session: SandboxSession) -> None:
    # Given a module and its tests: one passes, one fails an assertion, one raises, one is
    # in a class, and a file that cannot be imported (collection error)
    await session.put_files({
        "calc.py": b"def add(a, b):\n    return a - b\n",
        "tests/test_calc.py": (b"from calc import add\n\ndef test_zero():\n"
                               b"    assert add(0, 0) == 0\n\n"
                               b"def test_add():\n    assert add(2, 3) == 5, 'add is wrong'\n\n"
                               b"def test_crash():\n    raise KeyError('boom')\n\nclass TestC:\n"
                               b"    def test_ok(self):\n        assert True\n"),
        "tests/test_broken.py": b"import nope_not_a_module\n",
        "pytest.ini": b"[pytest]\npythonpath = .\n",
    })
    tools = StandardTools(session)
    # When the model runs the tests
    r = await use(tools, "run_tests")
    # Then each test has its status and message, and the report file is gone
    by_name = {t.name: t for t in tools.last_tests}
    assert {n: t.status for n, t in by_name.items()} == {
        "tests/test_calc.py::test_zero": "pass", "tests/test_calc.py::test_add": "fail",
        "tests/test_calc.py::test_crash": "fail", "tests/test_calc.py::TestC::test_ok": "pass",
        "tests/test_broken.py": "error"}
    assert "add is wrong" in by_name["tests/test_calc.py::test_add"].message
    assert "assert -1 == 5" in by_name["tests/test_calc.py::test_add"].message
    assert "KeyError: 'boom'" in by_name["tests/test_calc.py::test_crash"].message
    assert "nope_not_a_module" in by_name["tests/test_broken.py"].message
    assert r.content.startswith("tests exit code 1: 2 passed, 2 failed, 1 errors, 0 skipped")
    assert "FAIL tests/test_calc.py::test_add" in r.content
    assert ".streamrl-junit" not in await sh(session, "ls -a")
    # And a selection runs only those tests
    await use(tools, "run_tests", tests=["tests/test_calc.py::test_zero"])
    assert [(t.name, t.status) for t in tools.last_tests] == [
        ("tests/test_calc.py::test_zero", "pass")]


@needs_pytest
async def test_run_tests_messages_and_output_fit_the_budget(session: SandboxSession) -> None:
    await session.put_files({"test_big.py": (
        b"def test_huge():\n    print('x' * 5_000_000)\n    assert 'a' * 100000 == 'b'\n")})
    tools = StandardTools(session, limits=ToolLimits(output_chars=3000, message_chars=400))
    r = await use(tools, "run_tests")
    assert len(r.content) <= 3100 and "FAIL test_big.py::test_huge" in r.content
    assert all(len(t.message) <= 450 for t in tools.last_tests)


async def test_finish_ends_the_episode_and_later_calls_are_not_run(
        session: SandboxSession) -> None:
    tools = StandardTools(session)
    text = ('<tool_call>{"name": "finish", "arguments": {"summary": "fixed"}}</tool_call>'
            '<tool_call>{"name": "run", "arguments": {"command": "touch late"}}</tool_call>')
    done, late = await tools.answer(parse_tool_calls(text, TOOLS))
    assert done.content == "finished" and tools.finished and tools.summary == "fixed"
    assert late.error and "finished" in late.content
    assert await sh(session, "ls") == ""


# --------------------------------------------------------------------------- attacks


@pytest.mark.parametrize("path", ["../outside.txt", "a/../../outside.txt", "/etc/passwd",
                                  "/work/x", "a\x00b", ""])
async def test_paths_outside_the_work_dir_are_refused(session: SandboxSession, path: str) -> None:
    tools = StandardTools(session)
    for name, extra in (("read_file", {}), ("write_file", {"content": "pwned"}),
                        ("list_files", {})):
        r = await use(tools, name, path=path, **extra)
        assert r.error and r.content.startswith("error: "), (name, path, r)
    patch = f"--- a/{path}\n+++ b/{path}\n@@ -0,0 +1 @@\n+pwned\n"
    assert (await use(tools, "apply_patch", patch=patch)).error
    run = await use(tools, "run_tests", tests=[path or "x", "../up.py"])
    assert run.error
    assert "pwned" not in await sh(session, "cat ../outside.txt /tmp/outside.txt 2>/dev/null")


async def test_a_symlink_planted_with_run_is_not_followed(session: SandboxSession,
                                                         tmp_path: Path) -> None:
    # Given a secret of the host (outside the sandbox; readable by this process) and links
    # the model planted with `run`: to it, to a file of the sandbox's own /tmp, to the root,
    # to a host directory, and one to a host path that does not exist yet
    secret = tmp_path / "host-secret"
    secret.write_text("HOST SECRET")
    target = tmp_path / "target"
    tools = StandardTools(session)
    planted = await use(tools, "run", command=(
        f"echo SANDBOX SECRET > /tmp/s; ln -s /tmp/s p && ln -s {secret} q && ln -s / root && "
        f"ln -s {tmp_path} d && ln -s {target} w && mkdir sub && ln -s / sub/up"))
    assert planted.content == "exit code 0", planted
    # When it reads, lists and patches through them
    for r in [await use(tools, "read_file", path="p"),
              await use(tools, "read_file", path="q"),
              await use(tools, "read_file", path="root/tmp/s"),
              await use(tools, "read_file", path=f"d/{secret.name}"),
              await use(tools, "read_file", path=f"root{secret}"),
              await use(tools, "read_file", path=f"sub/up{secret}"),
              await use(tools, "list_files", path="root"),
              await use(tools, "list_files", path="d"),
              await use(tools, "list_files", path="sub/up/tmp"),
              await use(tools, "apply_patch", patch="--- a/q\n+++ b/q\n@@ -1 +1 @@\n-x\n+y\n")]:
        # Then every call is refused, and nothing outside the work dir is shown
        assert r.error and "SECRET" not in r.content, r
    # And a write to a link replaces the link: the file outside is never created
    w = await use(tools, "write_file", path="w", content="pwned")
    assert not w.error
    assert not target.exists() and secret.read_text() == "HOST SECRET"
    assert await sh(session, "test -L w || cat w") == "pwned"
    # (through a linked directory too: the link is replaced by a directory)
    assert not (await use(tools, "write_file", path="d/x", content="pwned")).error
    assert not (tmp_path / "x").exists()


async def test_a_hard_link_gives_nothing_the_sandbox_cannot_already_read(
        session: SandboxSession, tmp_path: Path) -> None:
    # Given hard links the model tries to a host secret (invisible in the sandbox) and to a
    # file the sandbox shows (across mounts: the kernel refuses, EXDEV)
    secret = tmp_path / "host-secret"
    secret.write_text("HOST SECRET")
    tools = StandardTools(session)
    r = await use(tools, "run", command=f"ln {secret} h; ln /usr/bin/env e; ls")
    # Then neither link exists, and reading them is refused
    assert r.content.endswith("ln: failed to create hard link 'e' => '/usr/bin/env': "
                              "Invalid cross-device link"), r
    assert await sh(session, "ls") == ""
    for name in ("h", "e"):
        read = await use(tools, "read_file", path=name)
        assert read.error and "SECRET" not in read.content


async def test_huge_outputs_are_capped_and_the_session_goes_on(session: SandboxSession) -> None:
    tools = StandardTools(session, limits=ToolLimits(output_chars=4000))
    # a command that prints 50 MB on each stream
    flood = await use(tools, "run", command="head -c 50000000 /dev/zero | tr '\\0' a; "
                                            "head -c 50000000 /dev/zero | tr '\\0' b >&2")
    assert len(flood.content) <= 4100 and flood.content.startswith("exit code 0")
    assert "more bytes dropped" in flood.content and "characters cut" in flood.content
    # a 6 MB file read back, and a listing of 5,000 files
    await use(tools, "run", command="head -c 6000000 /dev/zero | tr '\\0' z > big.txt; "
                                    "mkdir many; cd many; seq 5000 | xargs touch")
    big = await use(tools, "read_file", path="big.txt")
    assert len(big.content) <= 4100 and "characters cut" in big.content
    listing = await use(tools, "list_files", path="many")
    assert len(listing.content) <= 4100
    assert (await use(tools, "run", command="echo still here")).content.endswith("still here")


async def test_malformed_json_and_unknown_tools_are_answered_with_errors(
        session: SandboxSession) -> None:
    tools = StandardTools(session)
    text = ('<tool_call>{"name": "run", "arguments": {"command": "touch x"</tool_call>'
            '<tool_call>{"name": "sudo", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "run", "arguments": {"command": 7}}</tool_call>'
            '<tool_call>{"name": "run_tests", "arguments": {"tests": ["-p", "evil"]}}</tool_call>'
            '<tool_call>{"name": "run", "arguments": {"command": "echo ok"}}</tool_call>'
            '<tool_call>{"name": "run", "arguments"')
    results = await tools.answer(parse_tool_calls(text, TOOLS))
    assert [r.error for r in results] == [True, True, True, True, False, True]
    assert "malformed JSON" in results[0].content and "unknown tool 'sudo'" in results[1].content
    assert "7 is not of type 'string'" in results[2].content
    assert "does not match" in results[3].content and results[4].content.endswith("ok")
    assert "unclosed" in results[5].content
    assert await sh(session, "ls") == ""  # the malformed call ran nothing


async def test_a_call_built_elsewhere_is_validated_too(session: SandboxSession) -> None:
    # the OpenAI endpoint hands calls in directly: bad arguments are refused, not a TypeError
    tools = StandardTools(session)
    r = await tools.call(ToolCall(id="c", name="read_file", arguments={"path": 1, "x": 2}))
    assert r.error and "bad arguments for read_file" in r.content
    assert (await tools.call(ToolCall(id="c", name="nope"))).error


# --------------------------------------------------------------------------- report parsing


def test_garbage_reports_give_no_results() -> None:
    assert parse_junit(b"not xml") is None and parse_junit(b"<html/>") is None
    bomb = (b'<?xml version="1.0"?><!DOCTYPE l [<!ENTITY a "aaaaaaaaaa">'
            + b"".join(b'<!ENTITY %c "&%c;&%c;&%c;&%c;&%c;&%c;&%c;&%c;&%c;&%c;">'
                       % ((98 + i,) + (97 + i,) * 10) for i in range(8))
            + b']><testsuites><testcase name="&i;"/></testsuites>')
    assert parse_junit(bomb) is None  # expat refuses the amplification
    assert parse_summary("PASSED a.py::t\nFAILED a.py::u - assert 1 == 2\nnoise") == [
        parse_summary("PASSED a.py::t")[0],
        *[t for t in parse_summary("FAILED a.py::u - assert 1 == 2")]]
