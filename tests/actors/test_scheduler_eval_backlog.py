"""A held-out round does not hold training back: its tasks do not count against the
scheduler's backlog bound (``scheduler.max_backlog`` bounds the training work queued), so
the first training groups are admitted while the first round is still waiting for the
generators. Against a real Redis and a real scheduler actor, connected as its role's user."""

from __future__ import annotations

from pathlib import Path

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


def _config(tmp_path: Path, redis_url: str, run: str) -> Config:
    return load_config(None, [
        f"run.name={run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}",
        "scheduler.max_backlog=3", "scheduler.eval_items=8", "learner.groups_per_step=2",
        "learner.max_staleness=100", "queues.block_ms=100",
    ])  # fmt: skip


async def _splits(client: RedisClient, names: N.Names) -> dict[str, int]:
    rows = await client.call(client.sync.xrange, names.stream(N.TASKS))
    tasks = [decode(f[b"d"], Task) for _, f in rows]
    return {s: sum(t.split == s for t in tasks) for s in ("eval", "train")}


async def test_training_is_admitted_while_the_first_held_out_round_waits(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a run whose held-out round (8 tasks) is larger than its backlog bound (3), and a
    # generator that has taken two of the round's tasks and is still working on them
    credentials = {"scheduler": role_credentials(names)["scheduler"]}
    await roles.apply_acls(client, names, credentials)
    as_user = RedisClient(role_url(client.url.url, credentials["scheduler"]))
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), as_user, names)
    await ensure_group(client, names.stream(N.TASKS), GROUP)
    scheduler = Scheduler(ctx)
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.serve)  # the round is published before it is started
        assert await _splits(client, names) == {"eval": 8, "train": 0}
        await client.call(client.sync.xreadgroup, GROUP, "g", {names.stream(N.TASKS): ">"},
                          count=2)  # fmt: skip
        # When the scheduler admits
        await wait_until(lambda: scheduler.blocked == "backlog", timeout=30)
        # Then the training groups fill the backlog bound beside the held-out round, no more
        assert await _splits(client, names) == {"eval": 8, "train": 3}
        # and once the generator took and finished all the training tasks, it admits again
        raw = await client.call(client.sync.xreadgroup, GROUP, "g",
                                {names.stream(N.TASKS): ">"}, count=100)  # fmt: skip
        taken = [eid for _, entries in raw for eid, f in entries
                 if decode(f[b"d"], Task).split == "train"]  # fmt: skip
        await client.call(client.sync.xack, names.stream(N.TASKS), GROUP, *taken)

        async def admitted_again() -> bool:
            return (await _splits(client, names))["train"] == 6

        await wait_until(admitted_again, timeout=30)
        nursery.cancel_scope.cancel()
    as_user.close()
