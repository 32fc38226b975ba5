"""A learner step still running ``learner.step_deadline_s`` after it began is reported (an
error log line and ``streamrl_learner_steps_overdue``), not silent: under torchrun a rank
waiting in a collective that another rank skipped waits for ever, and its thread cannot be
cancelled. The step itself goes on and is published when it finishes."""

from __future__ import annotations

from pathlib import Path

import trio
from prometheus_client import REGISTRY
from structlog.testing import capture_logs

from streamrl.actors.learner import serve
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.messages import make_trajectory
from tests.helpers import run_config


def _overdue(run: str) -> float:
    return REGISTRY.get_sample_value("streamrl_learner_steps_overdue_total", {"run": run}) or 0.0


async def test_a_step_past_its_deadline_is_reported_and_still_published(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a learner whose step deadline (1 ms) is shorter than any real step of the tiny model
    config = run_config(
        tmp_path, redis_url, names.run, "model.spec=tiny", "learner.groups_per_step=1",
        "learner.max_steps=1", "learner.step_deadline_s=0.001", "queues.block_ms=200",
    )  # fmt: skip
    group = make_trajectory([1, 2, 3], [[5, 6, 7], [8, 9]], [[-1.0] * 3, [-1.0] * 2], [0.0, 1.0])
    await Producer(client, names).publish(N.TRAJECTORIES, [encode(group)])
    before = _overdue(names.run)
    # When it takes its one step
    with capture_logs() as logs, trio.fail_after(120):
        await serve(ActorContext(config, client, names))
    # Then the step was reported once while it ran, as an error, and counted
    overdue = [e for e in logs if e["event"] == "learner step past its deadline"]
    assert len(overdue) == 1, logs
    assert overdue[0]["log_level"] == "error" and overdue[0]["deadline_s"] == 0.001
    assert overdue[0]["groups"] == 1
    assert _overdue(names.run) == before + 1
    # and its end was logged with how long it took
    [finished] = [e for e in logs if e["event"] == "overdue learner step finished"]
    assert finished["seconds"] > 0.001
    # and the step was still trained and published
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.METRICS))
    assert decode(fields[b"d"], StepMetrics).step == 1
