"""The ``stdio`` kind: a program judged on stdin/stdout cases (APPS / CodeContests style).

An item's ``tests`` is a list of ``{"input": ..., "output": ...}`` cases, or APPS's layout
``{"inputs": [...], "outputs": [...]}`` (also as the JSON string APPS stores); an input that
is a list of lines is joined with newlines. APPS's call-based problems (``fn_name``) are
refused at load time: they are the ``python_tests`` kind's.

The model's program is the first fenced block of the completion, else the whole completion
(Python 3). The sandbox runs ``python3 -I stdio_harness.py``
(:mod:`domains.kinds.stdio_harness`, where why the program can neither forge a pass nor read
an expected output is spelled out): the program runs once per case, as a child of the
harness with only that case's input on its stdin, under a per-case timeout and output cap;
the harness compares. Reward = the fraction of cases passed (``all_or_nothing``: 1 only if
every case passed), counted only from the harness's one line ``<nonce> <json>`` with exit
code 0 and no timeout; :meth:`Stdio.test_results` gives each case's :class:`TestResult`
(``pass``; ``fail`` with expected vs got; ``error`` with the exit status and stderr tail;
``timeout``; ``truncated``).

Options: ``compare`` (``lines``: trailing whitespace per line and trailing blank lines
ignored, the default; ``exact``; ``tokens``: whitespace-insensitive), ``float_tolerance``
(> 0: tokens, numbers equal within that absolute or relative error), ``all_or_nothing``,
``per_case_timeout_s`` (2.0), ``max_output_kb`` (per case, 1024), ``max_cases`` (0: all),
``timeout_s`` (the whole run's sandbox limit, 60), ``memory_mb`` (512).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from streamrl.domains.base import SandboxSpec
from streamrl.domains.kinds import Record, TestResult, Verifier, kind
from streamrl.domains.kinds.answers import check_options
from streamrl.domains.kinds.harness_host import (
    check_harness,
    decode_report,
    harness_files,
    harness_request,
    report_nonce,
)
from streamrl.domains.kinds.pytests import extract_code
from streamrl.sandbox.base import ExecRequest, ExecResult, Limits

HARNESS = "stdio_harness.py"
COMPARES = ("lines", "exact", "tokens")
MAX_MESSAGE = 300
_MARGIN_S = 3.0  # of the sandbox's limit, kept for the harness's own start and report


def _text(value: Any) -> str:
    if isinstance(value, list):
        return "\n".join(str(v) for v in value) + "\n"
    return value if isinstance(value, str) else str(value)


def cases(item: Record) -> list[dict[str, str]]:
    """The item's cases as ``[{"input", "output"}]``; ``ValueError`` naming what is wrong."""
    tests = item.tests
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except ValueError:
            raise ValueError(f"item {item.id!r}: tests is a string but not JSON") from None
    if isinstance(tests, Mapping):
        if tests.get("fn_name"):
            raise ValueError(f"item {item.id!r}: a call-based problem (fn_name): use the "
                             "python_tests kind")
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list) or (
                len(inputs) != len(outputs)):
            raise ValueError(f"item {item.id!r}: tests needs 'inputs' and 'outputs' lists of "
                             "the same length")
        tests = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"item {item.id!r}: no tests (a list of {{input, output}} cases)")
    out = []
    for n, case in enumerate(tests):
        if not isinstance(case, Mapping) or "input" not in case or "output" not in case:
            raise ValueError(f"item {item.id!r}: case {n} is not an {{input, output}} object")
        out.append({"input": _text(case["input"]), "output": _text(case["output"])})
    return out


@dataclass(frozen=True)
class Stdio:
    compare: str = "lines"
    float_tolerance: float = 0.0
    all_or_nothing: bool = False
    per_case_timeout_s: float = 2.0
    max_output_bytes: int = 1 << 20
    max_cases: int = 0
    sandbox: SandboxSpec = field(default_factory=lambda: SandboxSpec(
        limits=Limits(timeout_s=60.0, memory_mb=512, cpu_s=60, max_processes=32,
                      max_file_mb=4, output_bytes=256 << 10),
        files=harness_files(HARNESS)))

    def __post_init__(self) -> None:
        if self.compare not in COMPARES:
            raise ValueError(f"compare must be one of {COMPARES}, not {self.compare!r}")
        if self.float_tolerance < 0 or self.per_case_timeout_s <= 0 or self.max_cases < 0:
            raise ValueError("float_tolerance and max_cases must be >= 0, "
                             "per_case_timeout_s > 0")

    def cases(self, item: Record) -> list[dict[str, str]]:
        found = cases(item)
        return found[: self.max_cases] if self.max_cases else found

    def check_item(self, item: Record) -> None:
        self.cases(item)

    def nonce(self, item: Record, completion: str) -> str:
        return report_nonce(item.id, completion, json.dumps(self.cases(item)).encode())

    def exec_request(self, item: Record, completion: str) -> ExecRequest | None:
        program = extract_code(completion)
        if not program.strip():
            return None
        spec = {
            "nonce": self.nonce(item, completion),
            "program": program + "\n",
            "cases": self.cases(item),
            "timeout_s": self.per_case_timeout_s,
            "budget_s": max(1.0, self.sandbox.limits.timeout_s - _MARGIN_S),
            "max_output": self.max_output_bytes,
            "compare": self.compare,
            "float_tol": self.float_tolerance,
            "max_message": MAX_MESSAGE,
        }
        return harness_request(HARNESS, spec, self.sandbox.limits, self.sandbox.files)

    def test_results(
        self, item: Record, completion: str, result: ExecResult | None
    ) -> list[TestResult]:
        """Each case's result, or [] when the run produced no trustworthy report."""
        results = decode_report(result, self.nonce(item, completion), list[TestResult])
        return results if results is not None and len(results) == len(self.cases(item)) else []

    def score(self, item: Record, completion: str, result: ExecResult | None) -> float:
        """The fraction (or all-or-nothing) of cases passed; 0 without a trustworthy report,
        unless the harness failed by itself (``harness_host.check_harness``)."""
        results = self.test_results(item, completion, result)
        if not results:
            check_harness(result)
            return 0.0
        passed = sum(r.status == "pass" for r in results)
        if self.all_or_nothing:
            return float(passed == len(results))
        return passed / len(results)


OPTIONS = {"compare", "float_tolerance", "all_or_nothing", "per_case_timeout_s",
           "max_output_kb", "max_cases", "timeout_s", "memory_mb"}


@kind("stdio")
def stdio(options: Mapping[str, Any]) -> Verifier:
    check_options("stdio", options, OPTIONS)
    base = Stdio()
    timeout_s, memory_mb = float(options.get("timeout_s", 0)), int(options.get("memory_mb", 0))
    return Stdio(
        compare=str(options.get("compare", "lines")),
        float_tolerance=float(options.get("float_tolerance", 0.0)),
        all_or_nothing=bool(options.get("all_or_nothing", False)),
        per_case_timeout_s=float(options.get("per_case_timeout_s", 2.0)),
        max_output_bytes=int(options.get("max_output_kb", 1024)) << 10,
        max_cases=int(options.get("max_cases", 0)),
        sandbox=base.sandbox.with_overrides(timeout_s, memory_mb),
    )
