"""A learner that dies after checkpointing a step but before announcing it: the restarted
learner announces that step with its metrics, once."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from actors.config import load_config
from actors.context import ActorContext
from actors.learner import Learner, serve
from learner.batch import make_trajectory
from queues import names as N
from queues.client import RedisClient
from queues.messages import StepMetrics, WeightsPublished, decode, encode
from queues.streams import Producer


class Died(Exception):
    pass


def _died(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return any(_died(e) for e in exc.exceptions)
    return isinstance(exc, Died)


async def test_step_checkpointed_but_not_announced_is_announced_with_its_metrics(
    client: RedisClient,
    names: N.Names,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = load_config(
        None,
        [
            f"run.name={names.run}",
            f"run.redis_url={redis_url}",
            f"run.work_dir={tmp_path}",
            "model.spec=tiny",
            "learner.groups_per_step=2",
            "learner.max_steps=1",
            "queues.block_ms=200",
        ],
    )
    ctx = ActorContext(config, client, names)
    groups = [
        make_trajectory([1, 2, 3], [[5, 6]] * 2, [[-1.0, -1.0]] * 2, rewards)
        for rewards in ([0.0, 1.0], [1.0, 0.0])
    ]
    await Producer(client, names).publish(N.TRAJECTORIES, [encode(g) for g in groups])

    # Given a learner that dies right after writing step 1's checkpoint
    async def die(*args: object) -> None:
        raise Died

    monkeypatch.setattr(Learner, "_announce", die)
    with trio.fail_after(120), pytest.raises(BaseException) as died:
        await serve(ctx)
    assert _died(died.value)
    monkeypatch.undo()
    assert await client.call(client.sync.xlen, names.stream(N.METRICS)) == 0

    # When it is restarted
    with trio.fail_after(120):
        await serve(ctx)

    # Then step 1 is announced once, with the metrics of that step
    rows = await client.call(client.sync.xrange, names.stream(N.METRICS))
    [metrics] = [decode(f[b"d"], StepMetrics) for _, f in rows]
    assert (metrics.step, metrics.groups, metrics.samples) == (1, 2, 4)
    rows = await client.call(client.sync.xrange, names.stream(N.WEIGHTS))
    assert [decode(f[b"d"], WeightsPublished).version for _, f in rows] == [1]
    pending = await client.call(client.sync.xpending, names.stream(N.TRAJECTORIES), "learner")
    assert pending["pending"] == 0
