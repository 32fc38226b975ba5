"""One short ``streamrl up`` run for a test: the real CLI in a child process, on the test
session's Redis, with ``--set`` overrides; then what it left in Redis and in its logs.

    done = run_up(redis_url, tmp_path, {"learner.max_steps": "1"}, prefix="cf")
    assert done.summary["steps"] >= 1
    for t in done.trajectories(): ...
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, Trajectory
from streamrl.queues.codec import decode

REPO = Path(__file__).resolve().parents[1]


@dataclass
class UpRun:
    run: str  # run.name: the run's keys in Redis
    work_dir: Path  # run.work_dir: checkpoints, weights, logs/
    summary: dict[str, Any]  # the --summary-json file
    stdout: str
    redis_url: str

    def records(self, stream: str, kind: Any) -> list[Any]:
        """Every entry of one of the run's streams (e.g. ``N.TRAJECTORIES``), decoded."""
        r = redis.Redis.from_url(self.redis_url)
        try:
            entries: Any = r.xrange(N.Names(self.run).stream(stream))
            return [decode(fields[b"d"], kind) for _, fields in entries]
        finally:
            r.close()

    def trajectories(self) -> list[Trajectory]:
        return self.records(N.TRAJECTORIES, Trajectory)

    def metrics(self) -> list[StepMetrics]:
        return self.records(N.METRICS, StepMetrics)

    def log(self, process: str) -> str:
        """The log of one supervised process, e.g. ``"executor-0"``."""
        return (self.work_dir / "logs" / f"{process}.log").read_text()


def run_up(redis_url: str, tmp_path: Path, overrides: dict[str, str], *, prefix: str = "up",
           config: str = "configs/tiny.toml", max_minutes: float = 5,
           timeout_s: float = 420) -> UpRun:
    """Run ``streamrl up --config config`` to its end (``learner.max_steps`` or
    ``max_minutes``) under a run name of its own (``prefix`` + random: tests share the
    session's Redis and its ACL users), with a clean environment (no inherited
    ``STREAMRL_*``); fails the test with the tail of the output if it exits non-zero."""
    run = f"{prefix}{uuid.uuid4().hex[:8]}"
    work_dir = tmp_path / "run"
    summary_path = tmp_path / "summary.json"
    settings = {"run.name": run, "run.work_dir": str(work_dir), **overrides}
    sets = [arg for k, v in settings.items() for arg in ("--set", f"{k}={v}")]
    env = {"STREAMRL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin", "HOME": str(Path.home())}
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "up", "--config", config, *sets,
         "--max-minutes", str(max_minutes), "--summary-json", str(summary_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    return UpRun(run=run, work_dir=work_dir, summary=summary, stdout=proc.stdout,
                 redis_url=redis_url)  # fmt: skip
