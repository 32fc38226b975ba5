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
from streamrl.queues.server import open_data_dir, running_url
from streamrl.testing.wait import wait_until_sync

REPO = Path(__file__).resolve().parents[1]


def _trajectories(work: Path, run: str) -> int:
    """Groups handed to the learner so far (its input stream), 0 while no server answers."""
    url = running_url(work / "redis")
    if url is None:
        return 0
    with redis.Redis.from_url(url) as r:
        return int(r.xlen(N.Names(run).stream(N.TRAJECTORIES)))


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
    # Given a running `up` on the embedded server that has handed a group to the learner
    work, summary = tmp_path / "run", tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    log = (tmp_path / "up.log").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml",
         "--set", "run.name=killed", "--set", "run.redis_url=", "--set", f"run.work_dir={work}",
         "--set", "learner.max_steps=2", "--max-minutes", "2", "--summary-json", str(summary)],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        before = wait_until_sync(lambda: _trajectories(work, "killed"), timeout=240, interval=0.5)
        # When its server is killed outright
        _kill_server(work)
        up.wait(timeout=300)
    finally:
        up.kill()
        log.close()
        if up.wait() != 0 and running_url(work / "redis") is not None:  # up did not stop it
            _kill_server(work)
    out = (tmp_path / "up.log").read_text()
    # Then up started it again on its data and said so, and the run ended normally
    assert up.returncode == 0, out[-4000:]
    assert "embedded Redis exited (code -9); restarting it" in out, out[-4000:]
    assert "embedded Redis is back" in out
    # with its summary written and no work dead-lettered
    written = json.loads(summary.read_text())
    assert written["dead_letters"] == 0
    # and the run went on through the restarted server: more groups reached the learner
    with open_data_dir(work / "redis") as url, redis.Redis.from_url(url) as r:
        after = int(r.xlen(N.Names("killed").stream(N.TRAJECTORIES)))
    assert after > before, (before, after)
