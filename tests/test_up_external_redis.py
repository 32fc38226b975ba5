"""The real ``streamrl up`` on an external Redis without an ACL file: Redis restarts in the
middle of the run, losing the role users; ``up`` creates them again and the run trains on to
its step limit (tiny model, configs/tiny.toml)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from streamrl.protocol.roles import ROLES
from tests.actors.test_role_users_restored import ExternalRedis

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.system
def test_up_goes_on_after_redis_restarts_without_its_users(tmp_path: Path) -> None:
    redis_server = ExternalRedis(tmp_path / "redis")
    redis_server.start()
    summary = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMRL_")}
    env["STREAMRL_REDIS_URL"] = redis_server.admin_url  # the admin URL, off the command line
    up = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml",
         "--set", "run.name=restarted", "--set", f"run.work_dir={tmp_path / 'run'}",
         "--set", "learner.max_steps=20", "--set", "up.progress_interval_s=2",
         "--max-minutes", "8", "--summary-json", str(summary)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(up.stdout or []), daemon=True).start()
    try:
        # Given a run that has trained its first step (of 20: tiny steps take seconds, so with
        # a limit of 6 the run could reach it before the progress line was read)
        deadline = time.monotonic() + 300
        while not any(re.search(r"policy v[1-9]", line) for line in lines):
            assert up.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)
        # When Redis restarts (its AOF kept, its users lost)
        at_restart = max(int(v) for v in re.findall(r"policy v(\d+)", "".join(lines)))
        redis_server.stop()
        redis_server.start()
        # Then up creates the users again and the run trains on to its step limit
        assert up.wait(timeout=400) == 0, "".join(lines)[-3000:]
        out = "".join(lines)
        assert f"Redis had lost {len(ROLES)} of the run's ACL users" in out, out[-3000:]
        final = json.loads(summary.read_text())["policy_version"]
        assert final == 20 > at_restart, out[-3000:]  # trained on after the restart
        assert "code=1" not in out, out[-3000:]  # no actor crashed on the refused logins
    finally:
        up.kill()
        redis_server.stop()
