"""Claim: the standard tools' ``apply_patch`` places a hunk in time linear in the file and
the patch, and neither it nor ``run_tests``' JUnit parsing holds the executor's event loop
(issue 32, item 2), where the old search grew with file lines x hunk lines (about 4x per
doubling of both) and ran on the loop.

Patch rows: a file of ``n`` lines, nearly all one repeated line, and one hunk of ``m`` lines
of that line ending in the file's one distinct line, near its end, while the header says
line 1 (the issue's shape: each place tried compares nearly the whole hunk). ``n`` doubles
from 10,000 to 80,000 with ``m = n / 72.7`` (the issue's 23 KiB hunk on 80,000 lines at the
top). ``old_s``: the old search (kept below, verbatim), in this process; ``new_s``:
:func:`streamrl.domains.tools.diff.apply_hunks`; both must give the same text.

Report rows: a JUnit report of ``cases`` failing cases (about 495 bytes each: 49 MB at
100,000), parsed and rendered for the model (``standard._test_report``: the report fed in
64 KiB pieces) on the loop, as ``run_tests`` did, and in a worker thread, as it does now,
each inside a trio run; ``longest_step_s`` is the longest one task step held the loop
meanwhile (a trio instrument).

    .venv/bin/python benchmarks/patch_apply.py [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from streamrl.domains.tools.diff import Hunk, apply_hunks, parse_patch
from streamrl.domains.tools.standard import ToolLimits, _test_report
from streamrl.sandbox.base import ExecResult

SAME, OTHER = "        return value\n", "        return other\n"


def old_apply(text: str, hunks: list[Hunk]) -> str:
    """The search ``apply_patch`` used before (domains/tools/standard.py at 25f5fc6^)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0
    for hunk in hunks:
        old = [body for tag, body in hunk.lines if tag != "+"]
        new = [body for tag, body in hunk.lines if tag != "-"]
        want = max(hunk.old_start - 1 if old else hunk.old_start, pos)
        span = len(lines) - len(old)
        at = None
        for d in range(0, max(span - pos, 0) + abs(want - pos) + 1):
            found = [a for a in (want - d, want + d)
                     if pos <= a <= span and lines[a:a + len(old)] == old]
            if found:
                at = found[0]
                break
        if at is None:
            raise ValueError("does not apply")
        out += lines[pos:at] + new
        pos = at + len(old)
    return "".join(out + lines[pos:])


def patch_row(n: int) -> dict[str, Any]:
    m = max(2, round(n / 72.7))
    lines = [SAME] * (n - 1000) + [OTHER] + [f"tail_{i} = {i}\n" for i in range(999)]
    text = "".join(lines)
    patch = (f"--- a/f\n+++ b/f\n@@ -1,{m} +1,{m} @@\n" + (" " + SAME) * (m - 1)
             + "-" + OTHER + "+        return fixed\n")
    [f] = parse_patch(patch)
    started = time.perf_counter()
    old = old_apply(text, f.hunks)
    old_s = time.perf_counter() - started
    started = time.perf_counter()
    new = apply_hunks("f", text, f.hunks)
    new_s = time.perf_counter() - started
    return {"file_lines": n, "hunk_lines": m, "patch_bytes": len(patch), "old_s": round(old_s, 4),
            "new_s": round(new_s, 4), "same_text": old == new}


def report(cases: int) -> bytes:
    case = ('<testcase file="t.py" classname="t" name="test_%d"><failure message="%s">%s'
            '</failure></testcase>')
    body = "".join(case % (i, "m" * 150, "x" * 250) for i in range(cases))
    return f'<?xml version="1.0"?><testsuites><testsuite name="s">{body}</testsuite></testsuites>'\
        .encode()


class _LongestStep(trio.abc.Instrument):
    def __init__(self) -> None:
        self.longest, self._began = 0.0, time.perf_counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._began = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self.longest = max(self.longest, time.perf_counter() - self._began)


async def _watched(work: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """(seconds, the longest step of the loop) of ``await work()``."""
    watch = _LongestStep()
    trio.lowlevel.add_instrument(watch)
    started = time.perf_counter()
    await trio.lowlevel.checkpoint()
    await work()
    await trio.lowlevel.checkpoint()
    trio.lowlevel.remove_instrument(watch)
    return time.perf_counter() - started, watch.longest


def report_row(cases: int) -> dict[str, Any]:
    xml = report(cases)
    result = ExecResult(exit_code=1, stdout=b"", stderr=b"", timed_out=False, oom_killed=False,
                        duration_s=1.0)

    async def old() -> None:  # the same work, on the loop (as run_tests did)
        _test_report(xml, result, False, ToolLimits(), math.inf)

    async def new() -> None:
        await trio.to_thread.run_sync(_test_report, xml, result, False, ToolLimits(),
                                      math.inf)

    old_s, old_step = trio.run(_watched, old)
    new_s, new_step = trio.run(_watched, new)
    return {"cases": cases, "report_mb": round(len(xml) / 1e6, 1), "old_s": round(old_s, 3),
            "old_longest_step_s": round(old_step, 3), "new_s": round(new_s, 3),
            "new_longest_step_s": round(new_step, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args()
    out = {"patch": [patch_row(n) for n in (10_000, 20_000, 40_000, 80_000)],
           "report": [report_row(c) for c in (25_000, 100_000)]}
    if args.json:
        print(json.dumps(out))
        return
    for row in out["patch"] + out["report"]:
        print(row)


if __name__ == "__main__":
    main()
