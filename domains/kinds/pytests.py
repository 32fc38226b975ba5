"""The ``python_tests`` kind: Python function tests in the HumanEval / MBPP format, run in
the sandbox with a result per test.

An item: ``prompt`` (HumanEval: the signature and docstring the completion continues; MBPP:
the task text), ``tests`` (a test program: HumanEval's ``def check(candidate): assert ...``,
or MBPP's asserts, as one string or a list of strings), ``extra[entry_field]`` (the
function's name; default ``entry_point``; found in the first ``assert name(`` when absent)
and optionally ``extra["test_setup_code"]`` (MBPP).

The model's code is the first fenced block of the completion, else the whole completion. It
is a whole function (``def <entry>``: the prompt, when it is code, stays in front for its
imports and helpers) or the body that continues the prompt (HumanEval's completions). The
sandbox runs ``python3 -I pytests_harness.py`` (:mod:`domains.kinds.pytests_harness`: why
the code cannot forge a result is there); reward = the fraction of tests that passed,
counted only from the harness's one line ``<nonce> <json>`` with exit code 0 and no timeout.
:meth:`PythonTests.test_results` gives each test's :class:`TestResult`.

The nonce is an HMAC of the item id and the completion under ``$STREAMRL_VERIFY_KEY`` (one
per deployment) or else a digest of the item's hidden tests; executor and verifier compute
it alike, the model's code never sees it.

Options: ``per_test_timeout_s`` (2.0), ``timeout_s`` (the whole run's sandbox limit, 30.0),
``memory_mb`` (512), ``entry_field``.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from streamrl.domains.base import SandboxSpec
from streamrl.domains.fences import PYTHON_BLOCK
from streamrl.domains.kinds import Record, TestResult, Verifier, kind
from streamrl.domains.kinds.answers import check_options
from streamrl.domains.kinds.harness_host import (
    check_harness,
    decode_report,
    harness_files,
    harness_request,
    report_nonce,
)
from streamrl.sandbox.base import ExecRequest, ExecResult, Limits

HARNESS = "pytests_harness.py"
MAX_MESSAGE = 500
_ASSERT_CALL = re.compile(r"assert\s+(?:not\s+)?\(?\s*(?:set\()?\s*([A-Za-z_]\w*)\s*\(")


def extract_code(text: str) -> str:
    """The first fenced block, else the text; leading blank lines dropped (indentation kept:
    a body that continues the prompt starts indented)."""
    match = PYTHON_BLOCK.search(text)
    code = match.group(1) if match else text
    return code.lstrip("\n").rstrip()


def _compiles(source: str) -> bool:
    try:
        ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return True


def _defines(source: str, name: str) -> bool:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
               for n in tree.body)


def test_program(item: Record) -> str:
    tests = item.tests
    return "\n".join(str(t) for t in tests) if isinstance(tests, list) else str(tests or "")


@dataclass(frozen=True)
class PythonTests:
    per_test_timeout_s: float = 2.0
    entry_field: str = "entry_point"
    sandbox: SandboxSpec = field(default_factory=lambda: SandboxSpec(
        limits=Limits(timeout_s=30.0, memory_mb=512, cpu_s=30, max_processes=32,
                      max_file_mb=4, output_bytes=256 << 10),
        files=harness_files(HARNESS)))

    def entry(self, item: Record) -> str:
        entry = item.extra.get(self.entry_field)
        if isinstance(entry, str) and entry:
            return entry
        found = _ASSERT_CALL.search(test_program(item))
        return found.group(1) if found else ""

    def check_item(self, item: Record) -> None:
        if not test_program(item).strip():
            raise ValueError(f"item {item.id!r}: no tests (a test program or asserts)")
        if not _compiles(test_program(item)):
            raise ValueError(f"item {item.id!r}: its test program does not parse")
        if not self.entry(item):
            raise ValueError(f"item {item.id!r}: no entry point (extra[{self.entry_field!r}])")

    def nonce(self, item: Record, completion: str) -> str:
        return report_nonce(item.id, completion, test_program(item).encode())

    def program(self, item: Record, completion: str) -> str:
        code, prompt = extract_code(completion), item.prompt
        setup = str(item.extra.get("test_setup_code") or "")
        prelude = prompt if _compiles(prompt) else ""
        if _defines(code, self.entry(item)) or not prelude:
            return "\n\n".join(p for p in (setup, prelude, code) if p) + "\n"
        return "\n".join(p for p in (setup, prelude.rstrip("\n"), code) if p) + "\n"

    def exec_request(self, item: Record, completion: str) -> ExecRequest | None:
        if not extract_code(completion).strip():
            return None
        setup = str(item.extra.get("test_setup_code") or "")
        spec = {
            "nonce": self.nonce(item, completion),
            "program": self.program(item, completion),
            "setup": "\n".join(p for p in (item.prompt if _compiles(item.prompt) else "",
                                           setup) if p),
            "test": test_program(item),
            "entry": self.entry(item),
            "timeout_s": self.per_test_timeout_s,
            "max_message": MAX_MESSAGE,
        }
        return harness_request(HARNESS, spec, self.sandbox.limits, self.sandbox.files)

    def test_results(
        self, item: Record, completion: str, result: ExecResult | None
    ) -> list[TestResult]:
        """Each test's result, or [] when the run produced no trustworthy report."""
        return decode_report(result, self.nonce(item, completion), list[TestResult]) or []

    def score(self, item: Record, completion: str, result: ExecResult | None) -> float:
        """The fraction of tests passed; 0 without a trustworthy report, unless the harness
        failed by itself (``harness_host.check_harness``)."""
        results = self.test_results(item, completion, result)
        if not results:
            check_harness(result)
            return 0.0
        return sum(r.status == "pass" for r in results) / len(results)


@kind("python_tests")
def python_tests(options: Mapping[str, Any]) -> Verifier:
    check_options("python_tests", options,
                  {"per_test_timeout_s", "timeout_s", "memory_mb", "entry_field"})
    verifier = PythonTests(float(options.get("per_test_timeout_s", 2.0)),
                           str(options.get("entry_field", "entry_point")))
    timeout_s, memory_mb = float(options.get("timeout_s", 0)), int(options.get("memory_mb", 0))
    if timeout_s or memory_mb:
        verifier = PythonTests(verifier.per_test_timeout_s, verifier.entry_field,
                               verifier.sandbox.with_overrides(timeout_s, memory_mb))
    return verifier
