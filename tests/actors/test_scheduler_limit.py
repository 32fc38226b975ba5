"""The scheduler admits exactly ``scheduler.max_train_groups`` training groups per run,
across restarts, with evaluation tasks on top."""

from __future__ import annotations

from pathlib import Path

import trio

from streamrl.actors.scheduler import Scheduler
from streamrl.config.schema import Config, load_config
from streamrl.protocol import names as N
from streamrl.protocol.messages import Task
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode
from streamrl.queues.streams import ensure_group
from streamrl.runtime.context import ActorContext
from tests.helpers import scheduler_held


def _config(tmp_path: Path, redis_url: str, run: str) -> Config:
    return load_config(
        None,
        [
            f"run.name={run}",
            f"run.redis_url={redis_url}",
            f"run.work_dir={tmp_path}",
            "scheduler.max_train_groups=7",
            "scheduler.max_backlog=5",
            "scheduler.eval_items=2",
            "learner.groups_per_step=2",
            "learner.max_staleness=100",
            "queues.block_ms=100",
        ],
    )


async def _tasks(client: RedisClient, names: N.Names) -> list[Task]:
    rows = await client.call(client.sync.xrange, names.stream(N.TASKS))
    return [decode(f[b"d"], Task) for _, f in rows]


async def test_scheduler_admits_exactly_max_train_groups(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    config = _config(tmp_path, redis_url, names.run)
    ctx = ActorContext(config, client, names)
    await ensure_group(client, names.stream(N.TASKS), "generator")

    async def take_all() -> None:  # what generators do: read and acknowledge
        raw = await client.call(
            client.sync.xreadgroup, "generator", "g", {names.stream(N.TASKS): ">"}, count=100
        )
        ids = [eid for _, entries in raw or [] for eid, _ in entries]
        if ids:
            await client.call(client.sync.xack, names.stream(N.TASKS), "generator", *ids)

    # Given a scheduler whose backlog bound (5) is below its limit (7)
    scheduler = Scheduler(ctx)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.serve)
        # When generators take whatever it admits each time it is held by its backlog bound,
        # and once more when it is held by its limit
        while (held := await scheduler_held(scheduler)) == "backlog":
            await take_all()
        assert held == "limit"
        await take_all()
        # Then with nothing left in its backlog, its limit still holds it
        assert await scheduler_held(scheduler) == "limit"
        nursery.cancel_scope.cancel()
    # and a restarted one (same run) is held by the limit too, and admits no more
    restarted = Scheduler(ctx)
    async with trio.open_nursery() as nursery:
        await nursery.start(restarted.serve)
        assert await scheduler_held(restarted) == "limit"
        nursery.cancel_scope.cancel()
    # Then it admitted exactly the limit
    tasks = await _tasks(client, names)
    train = [t for t in tasks if t.split == "train"]
    assert len(train) == 7 == int(await client.call(client.sync.get, names.admitted))
    assert len([t for t in tasks if t.split == "eval"]) == 2  # one round, at the first start
