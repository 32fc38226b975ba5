"""The synchronous (on-policy) mode: ``max_staleness = 0`` is a batch barrier between the
real scheduler and the real learner; and a group the learner drops as stale frees its
admission slot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import trio

from streamrl.actors import learner as learner_actor
from streamrl.actors.scheduler import Scheduler
from streamrl.config.schema import Config, load_config
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, Task, Trajectory
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.messages import make_trajectory
from streamrl.testing.wait import deadline, wait_until
from tests.helpers import run_config, scheduler_held

GROUPS_PER_STEP = 2
STEPS = 3


def _config(tmp_path: Path, redis_url: str, run: str, staleness: int) -> Config:
    return run_config(
        tmp_path,
        redis_url,
        run,
        "model.spec=tiny",
        "scheduler.group_size=2",
        "scheduler.eval_every=0",
        "scheduler.eval_items=1",
        "scheduler.max_backlog=64",
        f"learner.groups_per_step={GROUPS_PER_STEP}",
        f"learner.max_staleness={staleness}",
        f"learner.max_steps={STEPS}",
        "queues.block_ms=50",
    )


async def _sample_at_admission_version(ctx: ActorContext, seen: list[Task]) -> None:
    """Generator + verifier stand-in: every training task becomes a group sampled by the
    policy version it was admitted at (what an on-policy generator serves)."""
    async with ctx.consumer(N.TASKS, "generator") as tasks:
        while True:
            for d in await tasks.read(16):
                assert d.payload is not None
                task = decode(d.payload, Task)
                if task.split == "train":
                    seen.append(task)
                    version = task.policy_version
                    group = make_trajectory([1, 2, 3], [[5, 6], [7]], [[-2.0, -2.0], [-3.0]],
                                            [1.0, 0.0], weight_versions=version)  # fmt: skip
                    await ctx.producer().publish(N.TRAJECTORIES, [encode(group)])
                await tasks.ack([d.entry_id])


async def test_zero_staleness_admits_one_batch_per_published_version(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given the real scheduler and learner in synchronous mode
    ctx = ActorContext(_config(tmp_path, redis_url, names.run, staleness=0), client, names)
    seen: list[Task] = []
    # When they run until the learner has taken its steps
    scheduler = Scheduler(ctx)
    with deadline(150, "the learner did not take its steps"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_sample_at_admission_version, ctx, seen)
            await nursery.start(scheduler.serve)
            await learner_actor.serve(ctx)
            # and the scheduler has answered the last version: held by the staleness bound
            await wait_until(lambda: any(t.policy_version == STEPS for t in seen), 30,
                             what=f"no task admitted at the last version {STEPS}")
            assert await scheduler_held(scheduler) == "staleness"
            nursery.cancel_scope.cancel()
    # Then exactly one batch was admitted per version (the one after the last included)
    rows = await client.call(client.sync.xrange, names.stream(N.TASKS))
    admitted = [task for _, f in rows if (task := decode(f[b"d"], Task)).split == "train"]
    per_version = Counter(t.policy_version for t in admitted)
    assert per_version == {v: GROUPS_PER_STEP for v in range(STEPS + 1)}, per_version
    # and every step trained on groups of the version just before it: nothing stale, nothing
    # dropped
    rows = await client.call(client.sync.xrange, names.stream(N.METRICS))
    metrics = [decode(f[b"d"], StepMetrics) for _, f in rows]
    assert [m.step for m in metrics] == [1, 2, 3]
    assert all(m.max_staleness_seen == 0 and m.groups == GROUPS_PER_STEP for m in metrics)
    assert await client.call(client.sync.get, names.counter("dropped_stale")) is None


async def test_a_dropped_stale_group_frees_its_admission_slot(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    ctx = ActorContext(_config(tmp_path, redis_url, names.run, staleness=1), client, names)
    scheduler = Scheduler(ctx)
    # Given the scheduler has admitted everything the bound allows at version 0
    count, admitted = await scheduler.admissible(0)
    assert (count, admitted) == ((0 + 1 + 1) * GROUPS_PER_STEP, 0)
    assert await scheduler.admit(count, 0, admitted) == count
    assert await scheduler.admissible(0) == (0, count)
    # When the learner drops one admitted group as stale (its counter, as the actor keeps it)
    await client.call(client.sync.incr, names.counter("dropped_stale"))
    # Then one replacement may be admitted, and no more
    assert await scheduler.admissible(0) == (1, count)


async def test_the_learner_drops_groups_older_than_zero_versions(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a synchronous learner at version 0 that takes one step, then sees a group
    # sampled by version 0 while it is at version 1
    config = _config(tmp_path, redis_url, names.run, staleness=0)
    config = load_config(None, [*_overrides(config), "learner.max_steps=2"])
    ctx = ActorContext(config, client, names)

    def group(version: int) -> bytes:
        return encode(make_trajectory([1, 2], [[3], [4]], [[-1.0], [-1.0]], [1.0, 0.0],
                                      weight_versions=version))  # fmt: skip

    producer = Producer(client, names)
    groups = [group(0), group(0), group(0), group(1), group(1)]
    admitted = [decode(g, Trajectory).episode_id for g in groups]  # as the scheduler does
    await client.call(client.sync.sadd, names.admitted_groups, *admitted)
    await producer.publish(N.TRAJECTORIES, groups)
    with trio.fail_after(120):
        await learner_actor.serve(ctx)
    # Then the third version-0 group was dropped and counted; step 2 trained the v1 groups
    assert int(await client.call(client.sync.get, names.counter("dropped_stale"))) == 1
    rows = await client.call(client.sync.xrange, names.stream(N.METRICS))
    metrics = [decode(f[b"d"], StepMetrics) for _, f in rows]
    assert [(m.step, m.groups, m.max_staleness_seen) for m in metrics] == [(1, 2, 0), (2, 2, 0)]


def _overrides(config: Config) -> list[str]:
    r, le = config.run, config.learner
    return [
        f"run.name={r.name}", f"run.redis_url={r.redis_url}", f"run.work_dir={r.work_dir}",
        "model.spec=tiny", f"learner.groups_per_step={le.groups_per_step}",
        "learner.max_staleness=0", "queues.block_ms=50",
    ]  # fmt: skip
