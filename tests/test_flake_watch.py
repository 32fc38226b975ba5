"""The flake watch (testing/flake_watch.py) runs real pytest runs and reports each test's
failure rate: a test that fails in some runs is named with its rate and its failures' first
lines, a steady one is not, and the exit status says whether anything failed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TESTS = '''
from pathlib import Path

import pytest

COUNT = Path(__file__).with_name("count")


def test_steady():
    assert True


def test_every_other_run():
    n = int(COUNT.read_text()) if COUNT.exists() else 0
    COUNT.write_text(str(n + 1))
    assert n % 2 == 1, f"run number {n} is even"


@pytest.mark.skip(reason="not here")
def test_skipped():
    pass
'''


def watch(tmp_path: Path, *args: str) -> tuple[int, dict]:
    (tmp_path / "test_sample.py").write_text(TESTS)
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl.testing.flake_watch", *args, "-c", "/dev/null",
         "-p", "no:randomly", "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return proc.returncode, json.loads(proc.stdout)


def test_a_test_failing_in_some_runs_is_named_with_its_rate(tmp_path: Path) -> None:
    code, out = watch(tmp_path, "--runs", "3", "--workers", "0")
    assert code == 1
    assert [r["tests"] for r in out["runs"]] == [3, 3, 3]
    assert out["failed_tests"] == 1 and out["failures"] == 2
    (name, flaky), = out["flaky"].items()
    assert name.endswith("test_sample.py::test_every_other_run")
    assert (flaky["passed"], flaky["failed"], flaky["failure_rate"]) == (1, 2, 0.6667)
    assert [f.split(":")[0] for f in flaky["failures"]] == ["run 1", "run 3"]
    assert "run number 0 is even" in flaky["failures"][0]
    steady = next(v for k, v in out["all"].items() if k.endswith("::test_steady"))
    assert (steady["passed"], steady["failed"]) == (3, 0)
    skipped = next(v for k, v in out["all"].items() if k.endswith("::test_skipped"))
    assert (skipped["skipped"], skipped["failure_rate"]) == (3, 0.0)


def test_steady_tests_exit_0(tmp_path: Path) -> None:
    (tmp_path / "count").write_text("1")  # odd on the first run: passes
    code, out = watch(tmp_path, "--runs", "1", "--workers", "0")
    assert code == 0 and out["flaky"] == {} and out["failures"] == 0


def test_a_run_that_collects_nothing_counts_as_a_failure(tmp_path: Path) -> None:
    (tmp_path / "test_sample.py").write_text("import nonexistent_module_xyz\n")
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl.testing.flake_watch", "--runs", "2", "--workers", "0",
         "-c", "/dev/null", "--rootdir", str(tmp_path), str(tmp_path / "test_sample.py")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = json.loads(proc.stdout)
    assert proc.returncode == 1
    assert sum(r["failed"] for r in out["flaky"].values()) == 2, out
