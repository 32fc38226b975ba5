"""The scheduler publishes a held-out round at version 0, then every ``scheduler.eval_every``
policy versions: none in between, none twice for one version, also across a restart of the
scheduler. The versions come from the real learner (tiny model) stepping on real groups, so
they are announced exactly as in a run."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from streamrl.actors.learner import serve as learner_serve
from streamrl.actors.scheduler import Scheduler
from streamrl.protocol import names as N
from streamrl.protocol.messages import Task, WeightsPublished
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer, ensure_group
from streamrl.runtime.context import ActorContext
from streamrl.testing.messages import make_trajectory
from streamrl.testing.wait import wait_until
from tests.helpers import run_config


async def _tasks(client: RedisClient, names: N.Names) -> list[Task]:
    rows = await client.call(client.sync.xrange, names.stream(N.TASKS))
    return [decode(f[b"d"], Task) for _, f in rows]


async def _rounds(client: RedisClient, names: N.Names) -> list[tuple[int, int, int]]:
    """(eval_round, policy_version, tasks) of every round in the tasks stream, in order."""
    seen: dict[tuple[int, int], int] = {}
    for t in await _tasks(client, names):
        if t.split == "eval":
            assert t.eval_round >= 0 and t.group_size == 1
            key = (t.eval_round, t.policy_version)
            seen[key] = seen.get(key, 0) + 1
    return [(r, v, n) for (r, v), n in seen.items()]


async def _scheduler_saw(client: RedisClient, names: N.Names, version: int) -> None:
    """Wait until the scheduler acted on ``version``: it admits a training group at each
    version (staleness 0, one group per step), right after its evaluation check."""

    async def saw() -> bool:
        return any(
            t.split == "train" and t.policy_version == version
            for t in await _tasks(client, names)
        )

    await wait_until(saw, timeout=30, what=f"the scheduler did not act on version {version}")


async def _step(client: RedisClient, names: N.Names, version: int) -> None:
    """Give the learner one group sampled at ``version - 1``; wait for it to announce
    ``version``."""
    g = make_trajectory(
        [1, 2, 3], [[5, 6], [6, 5]], [[-1.0, -1.0]] * 2, [0.0, 1.0],
        weight_versions=version - 1, policy_version=version - 1,
    )
    await Producer(client, names).publish(N.TRAJECTORIES, [encode(g)])
    async def announced() -> bool:
        rows = await client.call(client.sync.xrange, names.stream(N.WEIGHTS))
        return any(decode(f[b"d"], WeightsPublished).version == version for _, f in rows)

    await wait_until(announced, 60, what=f"the learner did not announce version {version}")


@pytest.mark.system
async def test_eval_rounds_at_zero_and_every_k_versions_across_a_restart(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    config = run_config(
        tmp_path, redis_url, names.run,
        "model.spec=tiny",
        "scheduler.eval_every=3",
        "scheduler.eval_items=2",
        "scheduler.max_backlog=100",
        "learner.groups_per_step=1",
        "learner.max_staleness=0",
        "queues.block_ms=100",
    )
    ctx = ActorContext(config, client, names)
    await ensure_group(client, names.stream(N.TASKS), "generator")
    expected = [(0, 0, 2)]

    async with trio.open_nursery() as outer:
        outer.start_soon(learner_serve, ctx)  # the real learner announces every version

        # Given a scheduler started at version 0: one round, at once
        async with trio.open_nursery() as nursery:
            await nursery.start(Scheduler(ctx).serve)
            await _scheduler_saw(client, names, 0)
            assert await _rounds(client, names) == expected
            # When the learner publishes versions 1..4: a round at 3 only
            for v in range(1, 5):
                await _step(client, names, v)
                await _scheduler_saw(client, names, v)
                if v == 3:
                    expected.append((1, 3, 2))
                assert await _rounds(client, names) == expected, f"at version {v}"
            nursery.cancel_scope.cancel()

        # When the scheduler is restarted at version 4 (the round of version 3 was already
        # published): no round at its start ...
        async with trio.open_nursery() as nursery:
            await nursery.start(Scheduler(ctx).serve)  # started: its start-up check is done
            assert await _rounds(client, names) == expected
            # ... and the cadence goes on from the last round: 6, then 9
            for v in range(5, 10):
                await _step(client, names, v)
                await _scheduler_saw(client, names, v)
                if v in (6, 9):
                    expected.append((len(expected), v, 2))
                assert await _rounds(client, names) == expected, f"at version {v}"
            nursery.cancel_scope.cancel()

        # And a restart at version 9, right after its round, does not publish it again
        with trio.move_on_after(1.0):
            await Scheduler(ctx).serve()
        assert await _rounds(client, names) == expected
        assert int(await client.call(client.sync.get, names.eval_round)) == len(expected)
        outer.cancel_scope.cancel()
