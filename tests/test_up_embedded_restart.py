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


@pytest.mark.system
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


@pytest.mark.system
def test_a_ctrl_c_at_the_terminal_stops_the_run_not_its_server_first(tmp_path: Path) -> None:
    # Given a running `up` leading its own process group, as in a terminal
    work, summary = tmp_path / "run", tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    out_path = tmp_path / "up.log"
    with out_path.open("w") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml",
             "--set", "run.name=ctrlc", "--set", "run.redis_url=",
             "--set", f"run.work_dir={work}", "--max-minutes", "3",
             "--summary-json", str(summary)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        try:
            wait_until_sync(lambda: "streamrl: started" in out_path.read_text(), timeout=240)
            # When the terminal's Ctrl-C reaches the whole group
            os.killpg(up.pid, signal.SIGINT)
            up.wait(timeout=120)
        finally:
            up.kill()
            if up.wait() != 0 and running_url(work / "redis") is not None:
                _kill_server(work)
    out = out_path.read_text()
    # Then `up` stopped the run with its server still under it (not restarted, not lost),
    # wrote the summary and stopped the server last
    assert "interrupted, shutting down" in out, out[-3000:]
    assert "embedded Redis exited" not in out, out[-3000:]
    assert json.loads(summary.read_text())["dead_letters"] == 0
    assert running_url(work / "redis") is None
