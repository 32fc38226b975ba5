"""Run tests N times and report each test's failure rate, so a flaky test is caught before it
lands.

    python -m streamrl.testing.flake_watch --runs 5 tests/chaos tests/sandbox/test_docker_fleet.py
    python -m streamrl.testing.flake_watch --runs 20 --workers 0 tests/ops/test_status.py -k url

Options other than its own go to pytest as given.
Each run is one ``pytest`` process (``-n WORKERS --dist loadgroup`` as ``make test`` runs it,
or in one process with ``--workers 0``) writing a JUnit XML report; a run that dies without
its report counts as a failure of every test. The output is JSON on stdout: per test, how many
runs it passed, failed (errors included) and was skipped in, its failure rate and each
failure's first line; then the totals. Exit status 1 when any test failed in any run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Record:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # "run N: first line"

    @property
    def runs(self) -> int:
        return self.passed + self.failed

    def as_json(self) -> dict[str, Any]:
        ordered = sorted(self.seconds)
        return {
            "passed": self.passed, "failed": self.failed, "skipped": self.skipped,
            "failure_rate": round(self.failed / self.runs, 4) if self.runs else 0.0,
            "median_s": round(ordered[len(ordered) // 2], 2) if ordered else None,
            "failures": self.failures,
        }  # fmt: skip


def test_id(case: ET.Element) -> str:
    """``path::name`` of a JUnit ``testcase`` (pytest writes its module as ``classname``)."""
    module, name = case.get("classname", ""), case.get("name", "")
    if not module:  # a collection error: its name is the file's
        return name
    parts = module.split(".")
    # classname "tests.ops.test_status" or "tests.ops.test_status.TestClass"
    for cut in range(len(parts), 0, -1):
        path = Path(*parts[:cut]).with_suffix(".py")
        if path.is_file():
            return "::".join([path.as_posix(), *parts[cut:], name])
    return f"{module}::{name}"


def read_report(path: Path, run: int, records: dict[str, Record]) -> int:
    """Add one run's JUnit report to ``records``; the number of tests it held."""
    cases = ET.parse(path).getroot().iter("testcase")
    n = 0
    for case in cases:
        n += 1
        record = records.setdefault(test_id(case), Record())
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        if bad is not None:
            record.failed += 1
            first = (bad.get("message") or bad.text or "").strip().splitlines()
            record.failures.append(f"run {run}: {first[0][:300] if first else '?'}")
        elif case.find("skipped") is not None:
            record.skipped += 1
        else:
            record.passed += 1
            record.seconds.append(float(case.get("time", "0")))
    return n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="how many times (default 5)")
    parser.add_argument("--workers", type=int, default=2,
                        help="pytest-xdist workers per run, 0: one process (default 2)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    # everything else (test paths, -k, -m, -c ...) goes to pytest as given
    args, pytest_args = parser.parse_known_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    xdist = (["-n", str(args.workers), "--dist", "loadgroup"] if args.workers
             else ["-p", "no:xdist"])
    records: dict[str, Record] = {}
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="flake-watch-") as tmp:
        for run in range(1, args.runs + 1):
            report = Path(tmp) / f"run{run}.xml"
            started = time.monotonic()
            try:
                proc = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *xdist,
                     f"--junitxml={report}", *pytest_args],
                    capture_output=True, text=True, timeout=args.timeout,
                )  # fmt: skip
                code, tail = proc.returncode, (proc.stdout + proc.stderr)[-2000:]
            except subprocess.TimeoutExpired as exc:
                code, tail = -1, f"run timed out after {exc.timeout} s"
            wall = round(time.monotonic() - started, 1)
            tests = read_report(report, run, records) if report.is_file() else 0
            if not tests:  # no report, or an empty one: the run itself failed
                record = records.setdefault("<the run itself>", Record())
                record.failed += 1
                record.failures.append(f"run {run}: exit {code}: {tail.strip()[-300:]}")
            runs.append({"run": run, "exit": code, "wall_s": wall, "tests": tests})
            print(f"flake-watch: run {run}/{args.runs}: exit {code}, {tests} tests, {wall} s",
                  file=sys.stderr, flush=True)
    flaky = {k: r.as_json() for k, r in sorted(records.items()) if r.failed}
    out = {
        "runs": runs,
        "tests": len(records),
        "failed_tests": len(flaky),
        "failures": sum(r.failed for r in records.values()),
        "flaky": flaky,
        "all": {k: r.as_json() for k, r in sorted(records.items())},
    }
    print(json.dumps(out, indent=2))
    return 1 if flaky else 0


if __name__ == "__main__":
    sys.exit(main())
