"""pytest's results per test, for the model: pass / fail / error / skip with the assertion
message or the traceback, truncated to a budget.

Two sources, best first: the JUnit XML report pytest writes (``--junitxml``, xunit1 family so
each case names its file), and the ``-rA`` short test summary in its output
(``PASSED path::test``, ``FAILED path::test - message``). The report is written by code the
model controls (its tests, its conftest.py), so what it says is feedback to the model, never
a reward: the domain's hidden check decides that. Parsing never raises for what the report
holds (garbage, huge, not XML: no results); Python's expat refuses entity expansion bombs. A
report is parsed piece by piece against a deadline: the tools parse it in a worker thread,
never on the event loop.
"""

from __future__ import annotations

import math
import re
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence

from streamrl.domains.kinds import TestResult

JUNIT_ARGS = ("-rA", "-o", "junit_family=xunit1", "-p", "no:cacheprovider",
              "--continue-on-collection-errors")
"""Added to the test command in front of ``--junitxml=<path>`` and the selection (a file that
cannot be imported is one error; the other files' tests still run)."""

_PIECE = 1 << 16
_SUMMARY = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)(?: - (.*))?$")
_STATUS = {"PASSED": "pass", "XPASS": "pass", "FAILED": "fail", "ERROR": "error",
           "SKIPPED": "skip", "XFAIL": "skip"}


def parse_junit(report: bytes, message_chars: int = 600,
                deadline: float = math.inf) -> list[TestResult] | None:
    """Each ``<testcase>`` of a JUnit XML report; None when it is not one, or when parsing
    it runs past ``deadline`` (``time.monotonic()``). The report is fed to the parser in
    64 KiB pieces, so a thread that parses a huge one lets other threads run in between."""
    root = _parsed(report, deadline)
    if root is None or root.tag not in ("testsuites", "testsuite"):
        return None
    out = []
    for i, case in enumerate(root.iter("testcase")):
        if i % 1024 == 0 and time.monotonic() > deadline:
            return None
        name = _node_id(case.get("file") or "", case.get("classname") or "", case.get("name", ""))
        status, message = "pass", ""
        for child, kind in (("failure", "fail"), ("error", "error"), ("skipped", "skip")):
            found = case.find(child)
            if found is not None:
                status = kind
                message = _message(found.get("message") or "", found.text or "", message_chars)
                break
        out.append(TestResult(name=name, status=status, message=message))
    return out


def _parsed(report: bytes, deadline: float) -> ET.Element | None:
    parser = ET.XMLParser()
    try:
        for at in range(0, len(report), _PIECE):
            if time.monotonic() > deadline:
                return None
            parser.feed(report[at:at + _PIECE])
        return parser.close()
    except (ET.ParseError, ValueError):
        return None


def parse_summary(output: str, message_chars: int = 600) -> list[TestResult]:
    """The ``-rA`` short test summary lines of pytest's output."""
    out = []
    for line in output.splitlines():
        m = _SUMMARY.match(line.strip())
        if m:
            out.append(TestResult(name=m.group(2), status=_STATUS[m.group(1)],
                                  message=clip(m.group(3) or "", message_chars)))
    return out


def render(results: Sequence[TestResult], exit_code: int | None, timed_out: bool,
           output_tail: str, budget: int) -> str:
    """What the model reads: counts, each test that did not pass with its message, the
    names that passed; without any result the output's tail. At most ``budget`` chars."""
    if timed_out:
        head = "tests timed out"
    elif exit_code == 5:
        head = "no tests collected"
    else:
        head = f"tests exit code {exit_code}"
    if not results:
        return clip(f"{head}; no per-test results. Output:\n{output_tail}", budget, tail=True)
    counts = Counter(r.status for r in results)
    parts = [f"{head}: " + ", ".join(f"{counts[s]} {w}" for s, w in (
        ("pass", "passed"), ("fail", "failed"), ("error", "errors"), ("skip", "skipped")))]
    for r in results:
        if r.status in ("fail", "error"):
            parts.append(f"{r.status.upper()} {r.name}" + (f"\n{_indent(r.message)}"
                                                           if r.message else ""))
    passed = [r.name for r in results if r.status == "pass"]
    if passed:
        parts.append("passed: " + ", ".join(passed))
    return clip("\n".join(parts), budget)


def _node_id(file: str, classname: str, name: str) -> str:
    """``path/to/test_x.py::Class::test`` from xunit1's file and dotted classname."""
    if not file:
        return f"{classname}::{name}" if classname else name
    module = file.removesuffix(".py").replace("/", ".")
    if name == module:  # a collection error: the file itself
        return file
    cls = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return "::".join(p for p in (file, *cls.split("."), name) if p)


def _message(message: str, traceback: str, budget: int) -> str:
    message = message.strip()
    traceback = traceback.strip()
    if not traceback or traceback == message:
        return clip(message, budget)
    room = max(budget - len(message) - 1, budget // 2)
    return clip(f"{clip(message, budget // 2)}\n{clip(traceback, room, tail=True)}", budget)


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


def clip(text: str, budget: int, tail: bool = False) -> str:
    """``text`` in at most about ``budget`` characters: its start (or, with ``tail``, its end)
    with how much was cut."""
    if len(text) <= budget:
        return text
    cut = len(text) - budget
    if tail:
        return f"[... {cut} characters cut]\n" + text[-budget:]
    return text[:budget] + f"\n[... {cut} characters cut]"
