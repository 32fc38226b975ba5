"""``streamrl up`` with ``up.serve_models``: the supervisor starts a serve-model process and
the generator samples through it over the SGLang protocol (the real CLI, real Redis, tiny
model); the policy advances and every rollout names the weights of each of its tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

from streamrl.protocol import names as N
from streamrl.protocol.messages import Trajectory
from streamrl.queues.codec import decode

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("weight_sync", ["disk", "broadcast"])
def test_up_starts_serve_model_and_the_generator_uses_it(
    redis_url: str, tmp_path: Path, weight_sync: str
) -> None:
    # a name of its own: the parametrized runs share the session's Redis (and its ACL users)
    run = f"srv{weight_sync[:4]}{uuid.uuid4().hex[:6]}"
    summary_path = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "up", "--config", "configs/tiny.toml",
         "--set", f"run.name={run}", "--set", f"run.work_dir={tmp_path / 'run'}",
         "--set", "up.serve_models=1", "--set", "learner.max_steps=2",
         "--set", f"learner.weight_sync={weight_sync}",
         "--max-minutes", "5", "--summary-json", str(summary_path)],
        cwd=REPO,
        env={"STREAMRL_REDIS_URL": redis_url, "PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
        capture_output=True, text=True, timeout=540,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] >= 2 and summary["dead_letters"] == 0
    assert summary["eval_reward_after"] is not None
    logs = tmp_path / "run" / "logs"
    # The serve-model process served the generator and loaded the published weights: from
    # disk through the generator, or over the learner's weight-update group
    served = (logs / "serve-model-0.log").read_text()
    generator = (logs / "generator-0.log").read_text()
    if weight_sync == "disk":
        assert '"weights updated"' in served or "weights updated" in served
        assert "server weights updated" in generator
    else:
        assert "weights updated from the group" in served
        assert "weights broadcast" in (logs / "learner-0.log").read_text()
        assert "server serves the version already" in generator
        assert "server weights updated" not in generator
    # Every trained group carries per-token versions that agree with its samples
    r = redis.Redis.from_url(redis_url)
    groups = [decode(f[b"d"], Trajectory) for _, f in r.xrange(N.Names(run).stream(N.TRAJECTORIES))]
    assert groups
    for g in groups:
        for s in g.rollout.samples:
            versions = s.token_versions()
            assert len(versions) == len(s.tokens) // 4
            assert len(versions) == 0 or int(versions.min()) == s.weight_version
