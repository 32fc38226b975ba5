"""The whole pipeline split into 3 shards on a real 3-node Redis Cluster: the real CLI
(``streamrl up``), the real actors as processes, each as its role's ACL user, the tiny torch
model, ``queues.shards = 3``.

Checks that work is spread and nothing is lost or done twice: tasks are routed into every
shard and counted exactly by the run-global admission counter; each task's rollout,
execution and trajectory stay in its shard; every trajectory comes from an admitted task,
once; the learner trains each group once (its ledger), announces each step once, and
leaves nothing pending but its partial batch; no dead letters, no ACL refusal.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, Task, Trajectory, WeightsPublished
from streamrl.queues import keys as K
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode
from streamrl.queues.payloads import PayloadLimits, resolve
from streamrl.queues.server import ClusterProcess
from tests.chaos.harness import LedgerView

REPO = Path(__file__).resolve().parents[1]
SHARDS = 3
STEPS = 3


def _payloads(client: RedisClient, key: str) -> list[bytes]:
    entries = [(e.decode(), f.get(b"d")) for e, f in client.sync.xrange(key)]
    return [r.payload for r in resolve(client.sync, entries, PayloadLimits()) if r.payload]


@pytest.mark.system
def test_sharded_pipeline_on_cluster_loses_and_duplicates_nothing(
    redis_cluster: ClusterProcess, tmp_path: Path
) -> None:
    run = f"e2es{uuid.uuid4().hex[:6]}"
    summary_path = tmp_path / "summary.json"
    started = time.monotonic()
    # When: three learner steps through 3 shards, then the final evaluation
    proc = subprocess.run(
        [
            sys.executable, "-m", "streamrl", "up",
            "--config", "configs/tiny.toml",
            "--set", f"run.name={run}",
            "--set", f"run.work_dir={tmp_path / 'run'}",
            "--set", f"learner.max_steps={STEPS}",
            "--set", f"queues.shards={SHARDS}",
            "--max-minutes", "6",
            "--summary-json", str(summary_path),
        ],
        cwd=REPO,
        env={"STREAMRL_REDIS_URL": redis_cluster.url, "PATH": "/usr/bin:/bin",
             "HOME": str(Path.home())},
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    print(f"streamrl up, {SHARDS} shards, {STEPS} steps: {time.monotonic() - started:.1f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] >= STEPS and summary["policy_version"] >= STEPS
    assert summary["eval_reward_before"] is not None and summary["eval_reward_after"] is not None
    assert summary["dead_letters"] == 0

    client = RedisClient(redis_cluster.url)
    try:
        names = N.Names(run, shards=SHARDS)
        layouts = names.layouts()
        sync = client.sync
        # the unsharded work streams were never used
        for stream in N.WORK_STREAMS:
            assert sync.exists(N.Names(run).stream(stream)) == 0

        # Tasks: routed into every shard by episode; train tasks exactly as admitted
        tasks = {
            k: [decode(p, Task) for p in _payloads(client, layout.stream(N.TASKS))]
            for k, layout in enumerate(layouts)
        }
        assert all(tasks.values()), {k: len(v) for k, v in tasks.items()}
        for k, ts in tasks.items():
            assert all(K.shard_for(t.episode_id, SHARDS) == k for t in ts)
        train = [t.id for ts in tasks.values() for t in ts if t.split == "train"]
        assert len(train) == len(set(train)) == int(sync.get(names.admitted))
        assert sync.hlen(names.admissions) == 0

        # Trajectories: each from an admitted task, once, in the shard of its task
        trajs = {
            k: [decode(p, Trajectory) for p in _payloads(client, layout.stream(N.TRAJECTORIES))]
            for k, layout in enumerate(layouts)
        }
        episodes = [t.episode_id for ts in trajs.values() for t in ts]
        assert sorted(e for e, n in Counter(episodes).items() if n > 1) == []
        assert set(episodes) <= set(train)
        for k, ts in trajs.items():
            assert all(K.shard_for(t.episode_id, SHARDS) == k for t in ts)

        # Nothing pending anywhere but the learner's partial batch; the rest is accounted for
        waiting_upstream = 0
        for layout in layouts:
            for stream in (N.TASKS, N.ROLLOUTS, N.EXECUTED, N.EVALS):
                [group] = [
                    g for g in sync.xinfo_groups(layout.stream(stream))
                    if g["name"].decode() == N.GROUP_OF_STREAM[stream]
                ]  # fmt: skip
                assert int(group["pending"]) == 0, (layout.shard, stream)
                waiting_upstream += int(group["lag"]) if stream != N.EVALS else 0
            assert sync.xlen(layout.stream(N.DEAD)) == 0
        assert len(train) == len(episodes) + waiting_upstream  # no zero-variance skipping here

        # The learner: every group trained once, each step announced once
        ledger = LedgerView.read(tmp_path / "run" / "weights").episode_ids
        assert sorted(e for e, n in Counter(ledger).items() if n > 1) == []
        assert set(ledger) <= set(episodes)
        metrics = [decode(p, StepMetrics) for p in _payloads(client, names.stream(N.METRICS))]
        versions = [decode(p, WeightsPublished).version
                    for p in _payloads(client, names.stream(N.WEIGHTS))]  # fmt: skip
        assert [m.step for m in metrics] == versions == list(range(1, len(metrics) + 1))
        assert sum(m.groups for m in metrics) == len(ledger)
        learner_waiting = 0
        for layout in layouts:
            [group] = [
                g for g in sync.xinfo_groups(layout.stream(N.TRAJECTORIES))
                if g["name"].decode() == N.GROUP_OF_STREAM[N.TRAJECTORIES]
            ]  # fmt: skip
            learner_waiting += int(group["lag"]) + int(group["pending"])
        dropped = int(sync.get(names.counter("dropped_stale")) or 0)
        assert len(ledger) + dropped + learner_waiting == len(episodes)

        # Every role ran as its own ACL user (rules for every shard), refused nothing
        for node in redis_cluster.nodes:
            node_client = RedisClient(node.url)
            refused = [
                e for e in node_client.sync.acl_log(count=128)
                if e["username"].startswith(f"streamrl-{run}-")
            ]  # fmt: skip
            node_client.close()
            assert refused == [], refused
        print(
            f"tasks per shard {[len(v) for v in tasks.values()]}, "
            f"trajectories per shard {[len(v) for v in trajs.values()]}, "
            f"trained {len(ledger)} groups in {len(metrics)} steps"
        )
    finally:
        client.close()
