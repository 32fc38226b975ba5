"""A held-out round does not hold training back: its tasks do not count against the
scheduler's backlog bound (``scheduler.max_backlog`` bounds the training work queued), so
the first training groups are admitted while the first round is still waiting for the
generators. Against a real Redis and a real scheduler actor, connected as its role's user."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from streamrl.actors.scheduler import Scheduler
from streamrl.config.schema import Config, load_config
from streamrl.protocol import names as N
from streamrl.protocol import roles
from streamrl.protocol.messages import Task
from streamrl.queues.acl import role_url
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode
from streamrl.queues.streams import ensure_group
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until
from tests.helpers import role_credentials

GROUP = N.GROUP_OF_STREAM[N.TASKS]


def _config(tmp_path: Path, redis_url: str, names: N.Names) -> Config:
    return load_config(None, [
        f"run.name={names.run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}",
        "scheduler.max_backlog=3", "scheduler.eval_items=8", "learner.groups_per_step=2",
        "learner.max_staleness=100", "queues.block_ms=100", f"queues.shards={names.shards}",
    ])  # fmt: skip


def _keys(names: N.Names) -> list[str]:
    return [layout.stream(N.TASKS) for layout in names.layouts()]


async def _splits(client: RedisClient, names: N.Names) -> dict[str, int]:
    rows = [r for key in _keys(names) for r in await client.call(client.sync.xrange, key)]
    tasks = [decode(f[b"d"], Task) for _, f in rows]
    return {s: sum(t.split == s for t in tasks) for s in ("eval", "train")}


async def _take(client: RedisClient, names: N.Names, count: int) -> dict[str, list[Task]]:
    """What a generator does first: read up to ``count`` tasks of each shard (pending now)."""
    taken: dict[str, list[Task]] = {}
    for key in _keys(names):
        raw = await client.call(client.sync.xreadgroup, GROUP, "g", {key: ">"}, count=count)
        for _, entries in raw or []:
            taken[key] = taken.get(key, []) + [decode(f[b"d"], Task) for _, f in entries]
            ids = [eid for eid, f in entries if decode(f[b"d"], Task).split == "train"]
            if ids and count > 2:  # the training tasks generated and handed on
                await client.call(client.sync.xack, key, GROUP, *ids)
    return taken


@pytest.mark.parametrize("shards", [1, 2], ids=["one-shard", "two-shards"])
async def test_training_is_admitted_while_the_first_held_out_round_waits(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path, shards: int
) -> None:
    # Given a run whose held-out round (8 tasks) is larger than its backlog bound (3), and a
    # generator that has taken some of the round's tasks and is still working on them
    names = N.Names(names.run, shards=shards)
    credentials = {"scheduler": role_credentials(names)["scheduler"]}
    await roles.apply_acls(client, names, credentials, shards=shards if shards > 1 else 0)
    as_user = RedisClient(role_url(client.url.url, credentials["scheduler"]))
    ctx = ActorContext(_config(tmp_path, redis_url, names), as_user, names)
    for key in _keys(names):
        await ensure_group(client, key, GROUP)
    scheduler = Scheduler(ctx)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.serve)  # the round is published before it is started
        assert await _splits(client, names) == {"eval": 8, "train": 0}
        await _take(client, names, 1)
        # When the scheduler admits
        await wait_until(lambda: scheduler.blocked == "backlog", timeout=30)
        # Then the training groups fill the backlog bound beside the held-out round, no more
        assert await _splits(client, names) == {"eval": 8, "train": 3}
        # and once the generator took and finished all the training tasks, it admits again
        await _take(client, names, 100)

        async def admitted_again() -> bool:
            return (await _splits(client, names))["train"] == 6

        await wait_until(admitted_again, timeout=30)
        nursery.cancel_scope.cancel()
    as_user.close()
