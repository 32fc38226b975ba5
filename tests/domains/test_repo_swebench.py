"""domains/repo/swebench.py: a SWE-bench-style instance whose snapshot is a local git
checkout (made here with git init), read at its base commit whatever the work tree holds;
its test patch applied as the hidden tests; the reference patch scores 1.0, the base 0; raw
instances load as a declared domain with ``snapshots``; a snapshot that does not fit the
instance is refused at load."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import msgspec
import pytest

from streamrl.config.schema import DomainConfig
from streamrl.domains.declared import build_domain
from streamrl.domains.kinds.repo_tests import FINAL, RepoTests
from streamrl.domains.repo.files import make_diff
from streamrl.domains.repo.generate import record, run_local
from streamrl.domains.repo.swebench import read_instances, swebench_row

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
TEST_OLD = "from calc import add\n\n\ndef test_zero():\n    assert add(0, 0) == 0\n"
TEST_NEW = TEST_OLD + "\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def instance(tmp_path: Path) -> dict[str, object]:
    snap = tmp_path / "snapshots" / "demo__calc-1"
    snap.mkdir(parents=True)
    git(snap, "init", "-q")
    (snap / "calc.py").write_text(BUGGY)
    (snap / "test_calc.py").write_text(TEST_OLD)
    git(snap, "add", ".")
    git(snap, "commit", "-qm", "base")
    base = git(snap, "rev-parse", "HEAD")
    (snap / "calc.py").write_text("# the work tree moved on\n")  # not the base commit
    git(snap, "commit", "-qam", "later")
    inst = {
        "instance_id": "demo__calc-1", "repo": "demo/calc", "base_commit": base,
        "problem_statement": "add(2, 3) returns -1.",
        "FAIL_TO_PASS": json.dumps(["test_calc.py::test_add"]),
        "PASS_TO_PASS": json.dumps(["test_calc.py::test_zero"]),
        "test_patch": make_diff({"test_calc.py": TEST_OLD.encode()},
                                {"test_calc.py": TEST_NEW.encode()}),
        "patch": make_diff({"calc.py": BUGGY.encode()}, {"calc.py": FIXED.encode()}),
    }
    (tmp_path / "instances.json").write_text(json.dumps([inst]))
    return inst


def test_an_instance_at_its_base_commit_scores_its_patch(tmp_path: Path,
                                                        instance: dict[str, object]) -> None:
    (inst,) = read_instances(tmp_path / "instances.json")
    row = swebench_row(inst, tmp_path / "snapshots")
    assert row["tests"] == {"test_calc.py": TEST_NEW}
    assert row["FAIL_TO_PASS"] == ["test_calc.py::test_add"]
    assert row["base_commit"] == instance["base_commit"] and row["repo_name"] == "demo/calc"
    v = RepoTests(test_timeout_s=30.0)
    item = record(row)
    assert v.repository(item)["calc.py"] == BUGGY.encode()  # the commit, not the work tree
    fix = f"```diff\n{row['solution']}```"
    request = v.exec_request(item, fix)
    assert request is not None
    assert v.score(item, fix, run_local(request)) == 1.0
    base = run_local(v.judge(item, v.repository(item)))
    assert v.score(item, FINAL, base) == 0.0
    assert {r.name: r.status for r in v.test_results(item, FINAL, base)} == {
        "test_calc.py::test_add": "fail", "test_calc.py::test_zero": "pass"}


def test_raw_instances_load_as_a_declared_domain(tmp_path: Path,
                                                 instance: dict[str, object]) -> None:
    rows = tmp_path / "raw.jsonl"
    rows.write_text(json.dumps(instance) + "\n")
    cfg = msgspec.convert({
        "kind": "repo_tests", "data": str(rows),
        "fields": {"id": "instance_id", "prompt": "problem_statement", "tests": "test_patch"},
        "split": {"by": "hash", "eval_fraction": 0.5},
        "verifier": {"snapshots": str(tmp_path / "snapshots")}}, DomainConfig)
    domain = build_domain("swe", cfg)
    (item,) = domain.load_items("train") + domain.load_items("eval")
    v = RepoTests(snapshots=str(tmp_path / "snapshots"))
    fix = f"```diff\n{instance['patch']}```"
    request = v.exec_request(item, fix)
    assert request is not None and v.score(item, fix, run_local(request)) == 1.0


def test_a_snapshot_that_does_not_fit_is_refused(tmp_path: Path,
                                                 instance: dict[str, object]) -> None:
    snaps = tmp_path / "snapshots"
    with pytest.raises(ValueError, match="no snapshot directory"):
        swebench_row({**instance, "instance_id": "missing"}, snaps)
    with pytest.raises(ValueError, match="git"):
        swebench_row({**instance, "base_commit": "0" * 40}, snaps)
    bad_patch = str(instance["test_patch"]).replace("def test_zero", "def test_one")
    with pytest.raises(ValueError, match="test patch does not apply"):
        swebench_row({**instance, "test_patch": bad_patch}, snaps)
    with pytest.raises(ValueError, match="neither the repository nor"):
        swebench_row({**instance, "FAIL_TO_PASS": '["test_other.py::test_x"]'}, snaps)
