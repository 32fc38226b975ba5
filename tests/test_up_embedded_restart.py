"""``streamrl up`` keeps its embedded server up: killed mid-run, it is started again on its
own data (same port and password), the actors ride it out, the run ends as it would have,
and the summary is written. Embedded Redis, tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from streamrl.protocol import names as N
from streamrl.queues.server import running_url
from streamrl.testing.wait import wait_until_sync

REPO = Path(__file__).resolve().parents[1]


def _steps_taken(work: Path, run: str) -> int:
    """The learner's steps so far (its metrics stream), 0 while the server is not up."""
    url = running_url(work / "redis")
    if url is None:
        return 0
    with redis.Redis.from_url(url) as r:
        return int(r.xlen(N.Names(run).stream(N.METRICS)))


def _kill_server(work: Path) -> int:
    """SIGKILL the server running over the run's data; its pid."""
    url = running_url(work / "redis")
    assert url is not None
    with redis.Redis.from_url(url) as r:
        pid = int(r.info("server")["process_id"])
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.slow
def test_up_restarts_its_killed_embedded_server_and_the_run_ends_normally(
    tmp_path: Path,
) -> None:
    # Given a running `up` on the embedded server that has trained a step
    work, summary = tmp_path / "run", tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml",
         "--set", "run.name=killed", "--set", "run.redis_url=", "--set", f"run.work_dir={work}",
         "--set", "learner.max_steps=3", "--max-minutes", "4", "--summary-json", str(summary)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        wait_until_sync(lambda: _steps_taken(work, "killed") >= 1, timeout=240, interval=0.5)
        # When its server is killed outright
        killed = _kill_server(work)
        up.wait(timeout=300)
    finally:
        up.kill()
        log.close()
    out = (tmp_path / "up.log").read_text()
    # Then up started it again on its data and said so, and the run ended normally
    assert up.returncode == 0, out[-4000:]
    assert "embedded Redis exited (code -9); restarting it" in out, out[-4000:]
    assert "embedded Redis is back" in out
    # with every step trained, no work dead-lettered, and the summary written
    written = json.loads(summary.read_text())
    assert written["steps"] == 3 and written["policy_version"] == 3
    assert written["dead_letters"] == 0
    assert written["trajectories"] >= 3 * 2  # learner.groups_per_step of each step
    assert killed != 0
