"""``streamrl up`` on a run that an earlier ``up`` ended resumes it (the earlier run's stop
flag no longer blocks admission); ``--fresh`` starts it over. Embedded Redis, tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.learner.weights import version_dir

REPO = Path(__file__).resolve().parents[1]


def _up(work: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    summary = work.parent / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml",
         "--set", "run.name=resume", "--set", "run.redis_url=", "--set", f"run.work_dir={work}",
         "--max-minutes", "3", "--summary-json", str(summary), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(summary.read_text())


@pytest.mark.system
def test_up_resumes_a_stopped_run_and_fresh_starts_over(tmp_path: Path) -> None:
    work = tmp_path / "run"
    planted = work / "left-over"
    planted.parent.mkdir(parents=True)
    planted.write_text("from an earlier run")
    # Given a run started over (--fresh) that trained one step and ended
    proc, first = _up(work, "--fresh", "--set", "learner.max_steps=1")
    assert f"removed {work}" in proc.stdout and not planted.exists()
    assert first["policy_version"] == 1
    # When `up` runs again on it with a higher step limit
    proc, second = _up(work, "--set", "learner.max_steps=2")
    # Then it resumed at v1 and trained on: the stop flag of the first `up` was cleared
    assert "resuming run 'resume' at policy v1" in proc.stdout
    assert second["policy_version"] == 2
    # and its summary still starts from the run's first evaluation round (evals.jsonl)
    rounds = [r["round"] for r in second["eval_rounds"]]
    assert rounds[0] == 0 and rounds[-1] > max(r["round"] for r in first["eval_rounds"])
    assert second["eval_reward_before"] == first["eval_reward_before"]
    assert version_dir(work / "weights", 2).is_dir()


def test_fresh_is_refused_with_an_external_redis(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml",
         "--set", "run.redis_url=redis://127.0.0.1:1/0", "--set", f"run.work_dir={tmp_path}",
         "--fresh"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    assert "use a new run.name instead" in proc.stderr
    assert tmp_path.exists()


@pytest.mark.system
def test_up_stops_when_an_actor_cannot_start(tmp_path: Path) -> None:
    # Given a run whose latest checkpoint is unreadable: the learner exits at every start
    work = tmp_path / "run"
    bad = version_dir(work / "weights", 1)
    bad.mkdir(parents=True)
    (bad / "config.json").write_text("{not json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    # When `up` runs it
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml",
         "--set", "run.name=broken", "--set", f"run.work_dir={work}", "--max-minutes", "4",
         "--set", "up.crash_loop_exits=2",
         "--summary-json", str(tmp_path / "summary.json")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    # Then it gives up on the crash loop and ends with an error naming the actor and its log
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "learner-0 exited 2 times in a row" in proc.stderr, proc.stderr[-2000:]
    assert str(work / "logs" / "learner-0.log") in proc.stderr
    # and the summary of the run as it ended is written all the same
    assert json.loads((tmp_path / "summary.json").read_text())["policy_version"] == 0
