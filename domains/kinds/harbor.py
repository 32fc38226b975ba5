"""The ``harbor`` kind: task directories in the Harbor (Terminal-Bench 2) layout, run in the
sandbox, rewarded by their own ``tests/test.sh``.

A task directory holds ``instruction.md`` (the prompt), ``environment/`` (files staged into
the work dir; its ``Dockerfile`` / ``docker-compose.yaml`` describe an image and are not
staged), optionally ``solution/`` (a reference, ``solve.sh``; kept in ``extra`` for checks,
never run), ``tests/`` (``test.sh`` and what it needs; it writes the reward to
``/logs/verifier/reward.txt``) and optionally ``task.toml`` (``[agent].timeout_sec`` and
``[verifier].timeout_sec`` lower the kind's own limits for that task).
:func:`load_harbor` reads a directory of them into :class:`Record` items, and
:func:`write_harbor_jsonl` writes them as rows (a ``[domain.<name>]`` ``data`` file: files
as ``{path: base64}`` in ``tests`` and ``extra["environment"]``); a ``data`` that names the
directory of task directories itself (or one of them) is read the same way, by
:func:`harbor_row` (domains/declared.py).

The model's completion is a shell script (its first fenced block, else the whole text). The
sandbox runs ``python3 -I .harbor_harness.py`` (:mod:`domains.kinds.harbor_harness`, where
the order of the steps and what they do and do not prevent is spelled out): the script in
the staged environment; everything it left running killed; ``tests/`` staged fresh (never
visible before) with a fresh reward location; ``test.sh``. Reward = the number in the
reward file, clamped to [0, 1], counted only from the harness's one line ``<nonce> <json>``
with exit code 0 and no timeout. A test.sh that ends without a readable reward (missing or
garbage) is a failure of the verifier, not a 0 (``VerifierFailed``: the group is not
trained); no report at all (the script killed the harness, the deadline) or a test.sh past
its timeout scores 0.

The process backend's root is read-only, so Harbor's absolute paths (``/tests``, ``/logs``,
the agent's work dir ``workdir``, default ``/app``) are rewritten to the staged directories
in the text of the test files and of the script.

Options: ``solution_timeout_s`` (30), ``test_timeout_s`` (30), ``workdir`` (``/app``),
``memory_mb`` (1024); the sandbox's limit is the two timeouts plus a margin.
"""

from __future__ import annotations

import base64
import json
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamrl.domains.base import SandboxSpec, VerifierFailed
from streamrl.domains.fences import SHELL, block_or_text, fence
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

HARNESS = ".harbor_harness.py"
IMAGE_FILES = {"Dockerfile", "docker-compose.yaml", "docker-compose.yml"}
MAX_TASK_BYTES = 4 << 20
_MARGIN_S = 5.0
_FENCE = fence(SHELL)


def extract_script(text: str) -> str:
    """The first fenced block (``bash``, ``sh`` or untagged), else the whole text."""
    return block_or_text(text, _FENCE)


# -- the loader ---------------------------------------------------------------------------


def _files(root: Path, skip: Collection[str] = ()) -> dict[str, str]:
    if not root.is_dir():
        return {}
    return {p.relative_to(root).as_posix(): base64.b64encode(p.read_bytes()).decode()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name not in skip}


def harbor_row(task: Path) -> dict[str, Any]:
    """One task directory as a row: ``id`` (the directory's name), ``prompt``, ``tests``,
    ``environment``, ``solution``, ``agent_timeout_s`` / ``verifier_timeout_s`` (0: none)."""
    instruction = task / "instruction.md"
    if not instruction.is_file():
        raise ValueError(f"{task}: no instruction.md")
    config: dict[str, Any] = {}
    if (task / "task.toml").is_file():
        try:
            config = tomllib.loads((task / "task.toml").read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{task}/task.toml: {exc}") from None
    tests = _files(task / "tests")
    if "test.sh" not in tests:
        raise ValueError(f"{task}: no tests/test.sh")
    row = {
        "id": task.name,
        "prompt": instruction.read_text(),
        "tests": tests,
        "environment": _files(task / "environment", IMAGE_FILES),
        "solution": _files(task / "solution"),
        "agent_timeout_s": _timeout_sec(task, config, "agent"),
        "verifier_timeout_s": _timeout_sec(task, config, "verifier"),
    }
    size = len(json.dumps(row))
    if size > MAX_TASK_BYTES:
        raise ValueError(f"{task}: {size} bytes as a row, more than {MAX_TASK_BYTES}")
    return row


def _timeout_sec(task: Path, config: dict[str, Any], table: str) -> float:
    """``[table] timeout_sec`` of a task.toml (0: none); ValueError naming it when the table
    is not a table or the value not a number."""
    section = config.get(table, {})
    value = section.get("timeout_sec", 0) if isinstance(section, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"{task}/task.toml: [{table}] timeout_sec must be a number of "
                         f"seconds, not {value!r}")
    return float(value)


def harbor_rows(tasks_dir: Path) -> list[dict[str, Any]]:
    """Every task directory (one holding ``instruction.md``) under ``tasks_dir``, by name."""
    found = sorted(p.parent for p in Path(tasks_dir).glob("*/instruction.md"))
    if not found:
        raise ValueError(f"{tasks_dir}: no task directories (*/instruction.md)")
    return [harbor_row(task) for task in found]


def load_harbor(tasks_dir: Path) -> list[Record]:
    """The task directories under ``tasks_dir`` as items of this kind."""
    records = []
    for row in harbor_rows(tasks_dir):
        extra = {k: v for k, v in row.items() if k not in ("id", "prompt", "tests")}
        records.append(Record(id=row["id"], prompt=row["prompt"], tests=row["tests"],
                              extra=extra))
    return records


def write_harbor_jsonl(tasks_dir: Path, out: Path) -> Path:
    """The task directories as a JSONL data file for a ``[domain.<name>]`` of this kind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(row) + "\n" for row in harbor_rows(tasks_dir)))
    return out


# -- the verifier -------------------------------------------------------------------------


def _b64_files(value: Any, what: str, item: Record) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"item {item.id!r}: {what} must be {{path: base64}}")
    for path in value:
        if path.startswith("/") or ".." in Path(path).parts:
            raise ValueError(f"item {item.id!r}: {what}: bad path {path!r}")
    return dict(value)


@dataclass(frozen=True)
class Harbor:
    solution_timeout_s: float = 30.0
    test_timeout_s: float = 30.0
    workdir: str = "/app"
    memory_mb: int = 1024

    @property
    def sandbox(self) -> SandboxSpec:
        timeout_s = self.solution_timeout_s + self.test_timeout_s + _MARGIN_S
        return SandboxSpec(limits=Limits(
            timeout_s=timeout_s, memory_mb=self.memory_mb, cpu_s=int(timeout_s) + 1,
            max_processes=64, max_file_mb=16, output_bytes=256 << 10),
            files=harness_files("harbor_harness.py", HARNESS))

    def check_item(self, item: Record) -> None:
        tests = _b64_files(item.tests, "tests", item)
        if "test.sh" not in tests:
            raise ValueError(f"item {item.id!r}: no tests/test.sh")
        _b64_files(item.extra.get("environment", {}), "environment", item)

    def nonce(self, item: Record, completion: str) -> str:
        return report_nonce(item.id, completion,
                            json.dumps(item.tests, sort_keys=True).encode())

    def _timeout(self, item: Record, key: str, cap: float) -> float:
        own = float(item.extra.get(key) or 0)
        return min(own, cap) if own > 0 else cap

    def exec_request(self, item: Record, completion: str) -> ExecRequest | None:
        script = extract_script(completion)
        if not script:
            return None
        files = {path: base64.b64decode(data) for path, data in
                 _b64_files(item.extra.get("environment", {}), "environment", item).items()}
        spec = {
            "nonce": self.nonce(item, completion),
            "script": script + "\n",
            "tests": item.tests,
            "workdir": self.workdir,
            "solution_timeout_s": self._timeout(item, "agent_timeout_s",
                                                self.solution_timeout_s),
            "test_timeout_s": self._timeout(item, "verifier_timeout_s", self.test_timeout_s),
            "max_tail": 2000,
        }
        sandbox = self.sandbox
        return harness_request(HARNESS, spec, sandbox.limits, {**files, **sandbox.files})

    def report(self, item: Record, completion: str,
               result: ExecResult | None) -> dict[str, Any] | None:
        """The harness's report (the solution's and test.sh's exit, tails, the reward), or
        None when the run produced no trustworthy one."""
        return decode_report(result, self.nonce(item, completion), dict[str, Any])

    def test_results(self, item: Record, completion: str,
                     result: ExecResult | None) -> list[TestResult]:
        """One result: ``test.sh`` passed (reward 1), failed (< 1) or errored (no reward)."""
        report = self.report(item, completion, result)
        if report is None:
            return []
        reward, tests = report.get("reward"), report.get("tests") or {}
        message = str(report.get("error") or tests.get("stderr") or tests.get("stdout") or "")
        status = "error" if not isinstance(reward, int | float) else (
            "pass" if reward >= 1 else "fail")
        return [TestResult(name="test.sh", status=status, message=message[-500:])]

    def score(self, item: Record, completion: str, result: ExecResult | None) -> float:
        """The reward test.sh wrote; 0 when the script left no trustworthy report (it killed
        or stopped the harness, ran out of time or memory) or test.sh timed out (it runs the
        model's programs). :class:`VerifierFailed` when test.sh ended and wrote no readable
        reward, or the harness failed by itself: the check failed, not the answer."""
        report = self.report(item, completion, result)
        if report is None:
            check_harness(result)
            return 0.0
        reward, tests = report.get("reward"), report.get("tests")
        if isinstance(reward, int | float) and not isinstance(reward, bool) and reward == reward:
            return min(1.0, max(0.0, float(reward)))
        if isinstance(tests, dict) and not tests.get("timed_out"):
            tail = str(tests.get("stderr") or "").strip().splitlines()[-1:]
            raise VerifierFailed(f"test.sh exited {tests.get('exit')} and wrote no readable "
                                 "reward" + (f" (stderr: {tail[0][:200]})" if tail else ""))
        return 0.0


@kind("harbor")
def harbor(options: Mapping[str, Any]) -> Verifier:
    check_options("harbor", options,
                  {"solution_timeout_s", "test_timeout_s", "workdir", "memory_mb"})
    verifier = Harbor(float(options.get("solution_timeout_s", 30.0)),
                      float(options.get("test_timeout_s", 30.0)),
                      str(options.get("workdir", "/app")),
                      int(options.get("memory_mb", 1024)))
    if verifier.solution_timeout_s <= 0 or verifier.test_timeout_s <= 0:
        raise ValueError("solution_timeout_s and test_timeout_s must be > 0")
    if not verifier.workdir.startswith("/"):
        raise ValueError(f"workdir must be an absolute path, not {verifier.workdir!r}")
    return verifier
