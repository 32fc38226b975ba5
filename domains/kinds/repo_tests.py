"""The ``repo_tests`` kind: repository tasks (SWE style), decided by hidden tests.

An item: ``prompt`` (the problem statement, or the whole single-turn prompt), the repository
(``extra``: ``repo`` inline ``{path: text}``, or ``repo_dir`` [+ ``base_commit``]: a local
directory or git checkout, :mod:`streamrl.domains.repo.files`; with the ``snapshots``
option, ``<snapshots>/<id>`` when the row names none), ``tests`` (the hidden test files
``{path: text}``, or a SWE-bench ``test_patch`` diff applied to the repository),
``extra["FAIL_TO_PASS"]`` and ``extra["PASS_TO_PASS"]`` (pytest ids, lists or JSON strings
of lists as in SWE-bench), optionally ``extra["image"]`` (a container image for the Docker
backend: the interpreter and dependencies; the files still come from the repository) and
``extra["solution"]`` (a reference diff, never shown, for checks).

Two ways to judge:
- single-turn: the completion is a unified diff (its first fenced block, else the text from
  its first ``--- ``); it is applied on the host to the repository with the standard tool
  set's exact semantics (:func:`~streamrl.domains.repo.files.apply_diff`: all or nothing,
  no path outside the repository, no renames); one that does not apply scores 0;
- multi-turn (the standard tools on a session, :meth:`RepoTests.session_files` staged
  first): :meth:`RepoTests.final_request` judges the work dir as the model left it.
Either way the sandbox runs ``python3 -I .repo_tests_harness.py``
(:mod:`domains.kinds.repo_tests_harness`: the steps, and what they do and do not prevent):
a fresh copy of the work dir, the hidden tests (never visible before) and the original
conftests written over it, pytest on exactly the listed ids under the harness's own ini,
a clean environment and no plugin autoload, a fresh report location, leftovers killed.

Reward: 1.0 when every ``FAIL_TO_PASS`` and every ``PASS_TO_PASS`` test passes, else 0
(``partial = true``: the fraction of them that pass); 0 when the report is not the
harness's (its nonce, exit 0, no timeout) or a canary passed (a forged report).
:meth:`RepoTests.test_results` keeps each test's :class:`TestResult` for feedback.

Options: ``test_timeout_s`` (60), ``memory_mb`` (1024), ``partial`` (false), ``conftest``
(``original``: the repository's own conftest.py files, as they were; ``none``), ``snapshots``
(a directory of ``<instance_id>/`` snapshots), ``max_repo_mb`` (64).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from streamrl.domains.base import SandboxSpec
from streamrl.domains.fences import DIFF, fence
from streamrl.domains.kinds import Record, TestResult, Verifier, kind
from streamrl.domains.kinds.answers import check_options
from streamrl.domains.kinds.harness_host import (
    check_harness,
    decode_report,
    harness_files,
    harness_request,
    report_nonce,
)
from streamrl.domains.repo.files import apply_diff, clean_path, repo_files
from streamrl.domains.tools.standard import ToolRefused
from streamrl.sandbox.base import ExecRequest, ExecResult, Limits

HARNESS = ".repo_tests_harness.py"
FINAL = "\x00the work dir as the model left it\x00"
"""The completion stand-in in the nonce of :meth:`RepoTests.final_request`."""
_MARGIN_S = 10.0
_FENCE = fence(DIFF)


def extract_diff(text: str) -> str:
    """The first fenced block that holds a ``--- `` header, else the text from its first
    ``--- `` / ``diff --git`` line; "" when there is none."""
    for match in _FENCE.finditer(text):
        if re.search(r"^--- ", match.group(1), re.MULTILINE):
            return match.group(1)
    start = re.search(r"^(?:diff --git |--- )", text, re.MULTILINE)
    return text[start.start():] if start else ""


def test_ids(value: Any, what: str) -> list[str]:
    """A SWE-bench id list: a list of strings, or a JSON string of one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"{what}: not a JSON list") from None
    if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
        raise ValueError(f"{what} must be a list of pytest ids")
    for t in value:
        clean_path(t.split("::", 1)[0])
    return list(value)


@dataclass(frozen=True)
class RepoTests:
    test_timeout_s: float = 60.0
    memory_mb: int = 1024
    partial: bool = False
    conftest: str = "original"
    snapshots: str = ""
    max_repo_mb: int = 64
    max_new_tokens: int = 1024

    @property
    def sandbox(self) -> SandboxSpec:
        timeout_s = self.test_timeout_s + _MARGIN_S
        return SandboxSpec(limits=Limits(
            timeout_s=timeout_s, memory_mb=self.memory_mb, cpu_s=int(timeout_s) + 1,
            max_processes=64, max_file_mb=self.max_repo_mb, max_open_files=512,
            output_bytes=4 << 20), files=harness_files("repo_tests_harness.py", HARNESS))

    # -- the item ---------------------------------------------------------------------

    def ids(self, item: Record) -> tuple[list[str], list[str]]:
        return (test_ids(item.extra.get("FAIL_TO_PASS"), "FAIL_TO_PASS"),
                test_ids(item.extra.get("PASS_TO_PASS", []), "PASS_TO_PASS"))

    def source(self, item: Record) -> dict[str, Any]:
        """Where the item's repository is (``repo``, or ``repo_dir`` [+ ``base_commit``])."""
        extra = dict(item.extra)
        if isinstance(extra.get("repo"), str):  # SWE-bench's "owner/name", not files
            extra["repo_name"] = extra.pop("repo")
        if extra.get("repo") is None and not extra.get("repo_dir") and self.snapshots:
            extra["repo_dir"] = str(Path(self.snapshots) / item.id)
        if extra.get("repo_dir") and not (Path(extra["repo_dir"]) / ".git").exists():
            extra.pop("base_commit", None)  # a plain directory snapshot
        return extra

    def repository(self, item: Record) -> dict[str, bytes]:
        """The repository before the model's work: what a session starts with."""
        return repo_files(self.source(item), self.max_repo_mb << 20)

    session_files = repository

    def item_image(self, item: Record) -> str:
        """The item's container image (``extra["image"]``), "" for the domain's own."""
        image = item.extra.get("image")
        return image if isinstance(image, str) else ""

    def hidden(self, item: Record, base: Mapping[str, bytes]) -> dict[str, bytes]:
        """The hidden test files: ``tests`` as files, or its diff applied to ``base``."""
        tests = item.tests
        if isinstance(tests, str):
            try:
                after = apply_diff(base, tests)
            except ToolRefused as exc:
                raise ValueError(f"item {item.id!r}: its test patch does not apply: {exc}"
                                 ) from None
            return {p: d for p, d in after.items() if base.get(p) != d}
        if not isinstance(tests, Mapping) or not tests or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in tests.items()):
            raise ValueError(f"item {item.id!r}: tests must be {{path: text}} or a test patch")
        return {clean_path(k): v.encode() for k, v in tests.items()}

    def restore(self, item: Record, base: Mapping[str, bytes]) -> dict[str, bytes]:
        """What the harness writes over the work dir: the original conftests, the original
        of every file an id names, then the hidden tests."""
        f2p, p2p = self.ids(item)
        keep = {p for p in base if p.rsplit("/", 1)[-1] == "conftest.py"}
        keep |= {t.split("::", 1)[0] for t in f2p + p2p}
        hidden = self.hidden(item, base)
        out = {p: base[p] for p in sorted(keep) if p in base}
        out.update(hidden)
        missing = sorted({t.split("::", 1)[0] for t in f2p + p2p} - set(out))
        if missing:
            raise ValueError(f"item {item.id!r}: test files in neither the repository nor "
                             f"the hidden tests: {missing}")
        return out

    def check_item(self, item: Record) -> None:
        f2p, p2p = self.ids(item)
        if not f2p:
            raise ValueError(f"item {item.id!r}: FAIL_TO_PASS is empty")
        if set(f2p) & set(p2p):
            raise ValueError(f"item {item.id!r}: an id in both FAIL_TO_PASS and PASS_TO_PASS")
        image = item.extra.get("image")
        if image is not None and not isinstance(image, str):
            raise ValueError(f"item {item.id!r}: image must be a string")
        try:
            self.restore(item, self.repository(item))
        except ValueError as exc:
            raise ValueError(f"item {item.id!r}: {exc}") from None

    # -- running ------------------------------------------------------------------------

    def nonce(self, item: Record, completion: str) -> str:
        return report_nonce(item.id, completion, json.dumps(
            [item.tests, item.extra.get("FAIL_TO_PASS")], sort_keys=True).encode())

    def _request(self, item: Record, completion: str, base: Mapping[str, bytes],
                 files: dict[str, bytes]) -> ExecRequest:
        f2p, p2p = self.ids(item)
        spec = {
            "nonce": self.nonce(item, completion),
            "restore": {p: base64.b64encode(d).decode()
                        for p, d in self.restore(item, base).items()},
            "conftest": self.conftest,
            "tests": f2p + p2p,
            "timeout_s": self.test_timeout_s,
            "max_message": 500,
            "max_bytes": self.max_repo_mb << 20,
            "max_files": 20_000,
        }
        sandbox = self.sandbox
        return harness_request(HARNESS, spec, sandbox.limits, {**files, **sandbox.files})

    def exec_request(self, item: Record, completion: str) -> ExecRequest | None:
        """Single-turn: the completion's diff applied to the repository, then judged."""
        diff = extract_diff(completion)
        if not diff.strip():
            return None
        base = self.repository(item)
        try:
            files = apply_diff(base, diff)
        except ToolRefused:
            return None
        return self._request(item, completion, base, files)

    def final_request(self, item: Record) -> ExecRequest:
        """Multi-turn: judge the session's work dir as the model left it (run in it)."""
        return self._request(item, FINAL, self.repository(item), {})

    def judge(self, item: Record, files: dict[str, bytes]) -> ExecRequest:
        """Judge ``files`` as the work dir (a fresh sandbox), scored with ``FINAL``: the
        data checks (the buggy repository, a reference fix)."""
        return self._request(item, FINAL, self.repository(item), files)

    # -- scoring ------------------------------------------------------------------------

    def report(self, item: Record, completion: str,
               result: ExecResult | None) -> dict[str, Any] | None:
        """The harness's report, or None when the run produced no trustworthy one."""
        return decode_report(result, self.nonce(item, completion), dict[str, Any])

    def test_results(self, item: Record, completion: str,
                     result: ExecResult | None) -> list[TestResult]:
        """Each listed test's result ([] without a trustworthy report); with a canary that
        passed, every test is an ``error`` saying so."""
        report = self.report(item, completion, result)
        if report is None or not isinstance(report.get("tests"), list):
            return []
        try:
            tests = msgspec.convert(report["tests"], list[TestResult])
            canaries = msgspec.convert(report.get("canaries") or [], list[TestResult])
        except msgspec.ValidationError:
            return []
        if any(c.status == "pass" for c in canaries):
            return [TestResult(name=t.name, status="error",
                               message="forged: a test that must fail passed") for t in tests]
        return tests

    def score(self, item: Record, completion: str, result: ExecResult | None) -> float:
        """The listed tests passed (all, or the fraction with ``partial``); 0 without a
        trustworthy report, unless the harness failed by itself
        (``harness_host.check_harness``)."""
        if self.report(item, completion, result) is None:
            check_harness(result)
        results = {r.name: r.status for r in self.test_results(item, completion, result)}
        f2p, p2p = self.ids(item)
        passed = sum(results.get(t) == "pass" for t in f2p + p2p)
        if self.partial:
            return passed / len(f2p + p2p)
        return 1.0 if passed == len(f2p + p2p) else 0.0

    def score_final(self, item: Record, result: ExecResult | None) -> float:
        return self.score(item, FINAL, result)


@kind("repo_tests")
def repo_tests(options: Mapping[str, Any]) -> Verifier:
    check_options("repo_tests", options, {"test_timeout_s", "memory_mb", "partial",
                                          "conftest", "snapshots", "max_repo_mb"})
    verifier = RepoTests(float(options.get("test_timeout_s", 60.0)),
                         int(options.get("memory_mb", 1024)), bool(options.get("partial", False)),
                         str(options.get("conftest", "original")),
                         str(options.get("snapshots", "")), int(options.get("max_repo_mb", 64)))
    if verifier.test_timeout_s <= 0 or verifier.memory_mb <= 0 or verifier.max_repo_mb <= 0:
        raise ValueError("test_timeout_s, memory_mb and max_repo_mb must be > 0")
    if verifier.conftest not in ("original", "none"):
        raise ValueError(f"conftest must be 'original' or 'none', not {verifier.conftest!r}")
    if verifier.snapshots and not Path(verifier.snapshots).is_dir():
        raise ValueError(f"snapshots: {verifier.snapshots}: not a directory")
    return verifier
