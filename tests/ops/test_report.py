"""``streamrl report``: charts and summary from a run's metrics, trajectories and streams."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import Producer
from tests.ops.helpers import executed

PNG = b"\x89PNG\r\n\x1a\n"


async def test_report_writes_charts_and_summary(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    import streamrl.domains.arith.domain  # noqa: F401
    from streamrl.actors.verifier import Verifier

    # Given three learner steps, training groups at versions 0 and 1, an eval at 0 and 1
    producer = Producer(client, names)
    steps = [
        StepMetrics(id=new_id(), created_at=now(), policy_version=s, step=s, loss=0.1 * s,
                    grad_norm=1.0, reward_mean=0.5, groups=2, samples=4, tokens=40,
                    dropped_stale=0, max_staleness_seen=s - 1, step_seconds=3.0,
                    wait_seconds=float(s))
        for s in (1, 2, 3)
    ]
    await producer.publish(N.METRICS, [encode(m) for m in steps])
    groups = [
        executed("1", ["1", "2"], policy_version=0), executed("1", ["1", "1"], policy_version=1),
        executed("2", ["3", "3"], policy_version=0, split="eval"),
        executed("2", ["2", "3"], policy_version=1, split="eval"),
    ]
    for g in groups:
        out, *_ = await Verifier().handle(g)  # the output, then its counters
        await producer.publish(out.stream, [encode(out.message)])
    await producer.publish(N.ROLLOUTS, [encode(g.rollout) for g in groups])

    # When the report command runs
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "streamrl", "report", "--out", str(out),
         "--set", f"run.name={names.run}", "--set", f"run.redis_url={redis_url}",
         "--set", f"run.work_dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr

    # Then every chart is a PNG, and the summary has the numbers behind them
    for name in ("reward.png", "eval.png", "throughput.png", "learner_busy.png",
                 "staleness.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    text = (out / "summary.md").read_text()
    assert "| arith | 0 | 0.500 | 2 |" in text and "| arith | 1 | 1.000 | 2 |" in text
    assert "| arith | 0 | 0.000 | 2 |" in text  # held-out at v0
    assert "learner steps: 3" in text and "busy fraction: mean 0.62, last 0.50" in text
    assert "staleness: max 2 versions" in text
    assert "| generator | 4 | - |" in text and "| learner (steps) | 3 | - |" in text
