"""No model input holds the executor's event loop (issue 32, item 2): a patch whose hunk sits
far from its header on a large file, and a huge JUnit report, are worked on in a worker
thread, in linear time, against a deadline; the placement rules of ``apply_patch`` (nearest
exact match after the previous hunk) are unchanged. The timings themselves are
benchmarks/patch_apply.py's; here the longest single step of the event loop is watched."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from streamrl.domains.tools.diff import ToolRefused, apply_hunks, parse_patch
from streamrl.domains.tools.standard import TOOLS, StandardTools
from streamrl.inference.chat import ToolResult, parse_tool_calls
from streamrl.sandbox import ProcessSandbox, opened
from streamrl.sandbox.base import Limits, SandboxSession

LIMITS = Limits(timeout_s=60.0, memory_mb=1024, cpu_s=60, max_file_mb=48)
STALL_S = 0.5  # the longest the loop may be held by one step (before the fix: seconds)


@pytest.fixture
async def session() -> AsyncIterator[SandboxSession]:
    box = ProcessSandbox(work_mb=128)
    async with opened(box), box.session(LIMITS, label="patch") as s:
        yield s


async def use(tools: StandardTools, name: str, **arguments: Any) -> ToolResult:
    text = "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"
    (result,) = await tools.answer(parse_tool_calls(text, TOOLS))
    return result


class _LongestStep(trio.abc.Instrument):
    """The longest time one task step held the event loop."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._began = time.perf_counter()  # (added during a step: that step counts from here)

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.longest = max(self.longest, time.perf_counter() - self._began)


@asynccontextmanager
async def longest_step() -> AsyncIterator[_LongestStep]:
    """Watch the loop's steps for the ``async with`` (ending it with a checkpoint, so the
    body's last step is watched too)."""
    watch = _LongestStep()
    trio.lowlevel.add_instrument(watch)
    try:
        yield watch
        await trio.lowlevel.checkpoint()
    finally:
        trio.lowlevel.remove_instrument(watch)


async def test_a_patch_far_from_its_header_does_not_hold_the_event_loop(
        session: SandboxSession) -> None:
    # Given the sizes: an 80,000-line file, mostly one repeated line, and a 23 KiB
    # hunk of that line that applies near the end while its header says line 1
    same, other = "        return value\n", "        return other\n"
    lines = [same] * 79_000 + [other] + [f"tail_{i} = {i}\n" for i in range(999)]
    await session.put_files({"big.py": "".join(lines).encode()})
    patch = ("--- a/big.py\n+++ b/big.py\n@@ -1,1100 +1,1100 @@\n" + (" " + same) * 1099
             + "-" + other + "+        return fixed\n")
    assert 22_000 < len(patch) < 26_000
    tools = StandardTools(session)
    # When the model applies it
    async with longest_step() as watch:
        r = await use(tools, "apply_patch", patch=patch)
    # Then it applies where it matches, and no step held the loop for long
    assert r.content == "patched big.py", r
    assert watch.longest < STALL_S, watch.longest
    got = await use(tools, "read_file", path="big.py", start_line=79_000, end_line=79_002)
    assert got.content == same + "        return fixed\n" + "tail_0 = 0\n"


FAKE_PYTEST = b"""import sys
report = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--junitxml="))
case = ('<testcase file="t.py" classname="t" name="test_%d"><failure message="%s">%s'
        '</failure></testcase>')
with open(report, "w") as f:
    f.write('<?xml version="1.0"?><testsuites><testsuite name="s">')
    for i in range(100_000):
        f.write(case % (i, "m" * 150, "x" * 250))
    f.write("</testsuite></testsuites>")
sys.exit(1)
"""


async def test_a_huge_test_report_does_not_hold_the_event_loop(
        session: SandboxSession) -> None:
    # Given a test command that writes a 46 MB JUnit report (100,000 failing cases)
    await session.put_files({"fake_pytest.py": FAKE_PYTEST})
    tools = StandardTools(session, test_command=("python3", "fake_pytest.py"))
    # When the model runs the tests
    async with longest_step() as watch:
        r = await use(tools, "run_tests")
    # Then every case is read, and no step held the loop for long
    assert len(tools.last_tests) == 100_000 and r.content.startswith("tests exit code 1: 0 passed")
    assert watch.longest < STALL_S, watch.longest


# --------------------------------------------------------------------------- placement


def patched(text: str, patch: str) -> str:
    [f] = parse_patch(patch)
    return apply_hunks(f.path, text, f.hunks)


def test_a_pure_insertion_headed_far_past_the_end_goes_in_at_once() -> None:
    insert = "--- a/f\n+++ b/f\n@@ -1000000000,0 +1000000000,1 @@\n+end\n"
    started = time.process_time()
    assert patched("a\n", insert) == "a\nend\n"
    assert time.process_time() - started < 1  # (the old search: a billion steps)


def test_a_hunk_goes_to_the_nearest_exact_match_after_the_previous_one() -> None:
    text = "x\ny\nx\ny\nx\ny\nx\ny\n"  # "x" at lines 1, 3, 5, 7
    one = "--- a/f\n+++ b/f\n@@ -{} +{} @@\n-x\n+X\n"
    assert patched(text, one.format(4, 4)) == "x\ny\nX\ny\nx\ny\nx\ny\n"  # 3 and 5 tie: 3
    assert patched(text, one.format(6, 6)) == "x\ny\nx\ny\nX\ny\nx\ny\n"
    assert patched(text, one.format(99, 99)) == "x\ny\nx\ny\nx\ny\nX\ny\n"  # past the end
    two = "--- a/f\n+++ b/f\n@@ -7 +7 @@\n-x\n+A\n@@ -1 +1 @@\n-x\n+B\n"
    with pytest.raises(ToolRefused, match="hunk 2 does not apply"):
        patched(text, two)  # hunk 1 takes line 7: nothing after it is "x"


def test_hunks_of_common_lines_far_from_their_headers_cost_a_bounded_search() -> None:
    # Given 76,900 lines of only "a" and "b": 300 words of 23 lines at the top (a run of 12
    # "b", then the word's number in 9 bits, each found nowhere else), then "a b"
    # alternating; and 300 hunks, one per word, in order, each headed at the end of the file
    words = ["b\n" * 12 + "a\n" + "".join("ab"[int(bit)] + "\n" for bit in f"{i:09b}") + "a\n"
             for i in range(300)]
    text = "".join(words) + "a\nb\n" * 35_000
    hunks = "".join("@@ -76900,23 +76900,24 @@\n" + "".join(
        " " + line for line in word.splitlines(keepends=True)) + "+c\n" for word in words)
    # When they are applied: each hunk's one match is ~70,000 lines from its header, and
    # every "a" or "b" on the way is a place to try
    started = time.process_time()
    with pytest.raises(ToolRefused, match="too many places to try"):
        patched(text, "--- a/f\n+++ b/f\n" + hunks)
    # Then the search stopped at its budget (the old one: 300 x 70,000 slices of 23 lines)
    assert time.process_time() - started < 5
    # (and the same hunks headed where they apply go in at once)
    exact = "".join(f"@@ -{23 * i + 1},23 +{24 * i + 1},24 @@\n" + "".join(
        " " + line for line in word.splitlines(keepends=True)) + "+c\n"
        for i, word in enumerate(words))
    assert patched(text, "--- a/f\n+++ b/f\n" + exact).count("c\n") == 300
