"""A learner that dies after checkpointing a step but before announcing it: the restarted
learner announces that step with its metrics, once."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from streamrl.actors.learner import Learner, serve
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, WeightsPublished
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from tests.actors.helpers import ONE_TINY_STEP, Died, contains_died, group
from tests.helpers import run_config


async def test_step_checkpointed_but_not_announced_is_announced_with_its_metrics(
    client: RedisClient,
    names: N.Names,
    redis_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = run_config(tmp_path, redis_url, names.run, *ONE_TINY_STEP)
    ctx = ActorContext(config, client, names)
    groups = [group([0.0, 1.0]), group([1.0, 0.0])]
    await Producer(client, names).publish(N.TRAJECTORIES, [encode(g) for g in groups])

    # Given a learner that dies right after writing step 1's checkpoint
    async def die(*args: object) -> None:
        raise Died

    monkeypatch.setattr(Learner, "_announce", die)
    with trio.fail_after(120), pytest.raises(BaseException) as died:
        await serve(ctx)
    assert contains_died(died.value)
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
