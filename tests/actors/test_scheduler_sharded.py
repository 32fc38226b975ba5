"""The scheduler of a sharded run on the real 3-node Redis Cluster: tasks routed into the
shard of their episode, admitted exactly up to ``scheduler.max_train_groups`` against the
run-global counter, the backlog bound summed over the shards, and an admission that a dead
scheduler counted but never published is published (once) by the next one at its start."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import trio

from streamrl.actors.scheduler import Scheduler
from streamrl.protocol import names as N
from streamrl.protocol.messages import Task
from streamrl.queues import keys as K
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.shards import reserve_counted
from streamrl.queues.stats import group_state
from streamrl.queues.streams import ensure_group
from streamrl.runtime.context import ActorContext
from tests.helpers import run_config, scheduler_held

SHARDS = 3
pytestmark = pytest.mark.on_cluster(shards=3)  # redis_url, names: tests/conftest.py


async def test_sharded_scheduler_admits_exactly_and_finishes_a_dead_ones_admission(
    client: RedisClient, redis_url: str, tmp_path: Path
) -> None:
    names = N.Names(f"t{uuid.uuid4().hex[:10]}", shards=SHARDS)
    config = run_config(
        tmp_path,
        redis_url,
        names.run,
        "scheduler.max_train_groups=12",
        "scheduler.max_backlog=5",
        "scheduler.eval_items=2",
        "learner.groups_per_step=2",
        "learner.max_staleness=100",
        "queues.block_ms=100",
        f"queues.shards={SHARDS}",
    )
    ctx = ActorContext(config, client, names)
    for layout in names.layouts():
        await ensure_group(client, layout.stream(N.TASKS), "generator")
    # Given a scheduler that counted 3 tasks and died before publishing them
    dead = [t for t in (Scheduler(ctx).sample(0) for _ in range(3)) if t is not None]
    items = [(t.episode_id, encode(t)) for t in dead]
    assert await reserve_counted(client, names, N.TASKS, items, names.admitted, 0) == 3

    backlogs = []

    async def take_all() -> None:  # what generators do: read and acknowledge, every shard
        backlogs.append((await group_state(client, names, N.TASKS, "generator")).backlog)
        for layout in names.layouts():
            key = layout.stream(N.TASKS)
            raw = await client.call(client.sync.xreadgroup, "generator", "g", {key: ">"}, count=100)
            ids = [eid for _, entries in raw or [] for eid, _ in entries]
            if ids:
                await client.call(client.sync.xack, key, "generator", *ids)

    # When a new scheduler runs while generators take what it admits each time it is held
    # by its backlog bound, until its limit holds it
    scheduler = Scheduler(ctx)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.serve)
        while (held := await scheduler_held(scheduler)) == "backlog":
            await take_all()
        assert held == "limit"
        await take_all()
        nursery.cancel_scope.cancel()

    # Then exactly the limit was admitted, the dead one's tasks once among them, each task in
    # the shard of its episode, no admission record left, and the backlog bound held
    tasks: list[Task] = []
    for k, layout in enumerate(names.layouts()):
        rows = await client.call(client.sync.xrange, layout.stream(N.TASKS))
        shard_tasks = [decode(f[b"d"], Task) for _, f in rows]
        assert all(K.shard_for(t.episode_id, SHARDS) == k for t in shard_tasks)
        tasks += shard_tasks
    train = [t.id for t in tasks if t.split == "train"]
    assert (
        len(train)
        == len(set(train))
        == 12
        == int(await client.call(client.sync.get, names.admitted))
    )
    assert {t.id for t in dead} <= set(train)
    assert await client.call(client.sync.hlen, names.admissions) == 0
    assert len([t for t in tasks if t.split == "eval"]) == 2
    assert max(backlogs) <= 5 + 2  # max_backlog, plus the evaluation round (not bounded)
    assert await client.call(client.sync.exists, N.Names(names.run).stream(N.TASKS)) == 0
