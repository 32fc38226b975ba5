"""A training group dead-lettered at any stage frees its slot in the scheduler's staleness
admission (``queues/deadletter.lua`` counts it with the letter); a requeued one takes the slot
back. Without this, ``(max_staleness + 1) * groups_per_step`` dead groups stall a run for
good: no batch can fill and nothing more is admitted. Real Redis, each side connected as its
role's ACL user."""

from __future__ import annotations

from pathlib import Path

import trio

from streamrl.actors.scheduler import Scheduler
from streamrl.cli.dlq import list_dead, requeue
from streamrl.config.schema import load_config
from streamrl.protocol import names as N
from streamrl.protocol.health import domain_health
from streamrl.protocol.messages import Sampling, Task, new_id, now
from streamrl.protocol.quarantine import counts
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import (
    ConsumerSettings,
    Producer,
    ensure_group,
    open_stream_consumer,
)
from streamrl.runtime.context import ActorContext
from streamrl.runtime.policies import Policies, Reject
from streamrl.runtime.serve import ActorRuntime, Output, RuntimeSettings
from streamrl.testing.wait import wait_until


def _task(split: str, eval_round: int = -1) -> Task:
    return Task(
        id=new_id(), created_at=now(), policy_version=0, domain="arith", item_id="1",
        split=split, prompt="p", spec={}, group_size=2, sampling=Sampling(),
        eval_round=eval_round,
    )


class Refusing:
    """A generator stage that rejects every task (as for a task it can never serve)."""

    stage = "generator"
    input_stream = N.TASKS
    input_type = Task

    async def handle(self, task: Task) -> list[Output]:
        raise Reject("cannot serve this task")


async def _dead_letter_all(
    admin: RedisClient, generator: RedisClient, names: N.Names, payloads: list[bytes],
    expect: int | None = None,
) -> None:
    """Publish ``payloads``, then run the real actor runtime as the generator's user until
    ``expect`` entries (default: the payloads) are dead-lettered."""
    expect = len(payloads) if expect is None else expect
    if payloads:
        await Producer(admin, names).publish(N.TASKS, payloads)
    client = generator
    settings = ConsumerSettings(block_ms=50)
    async with open_stream_consumer(client, names, N.TASKS, stage="generator",
                                    settings=settings) as consumer:
        runtime = ActorRuntime(consumer, Refusing(), Policies(), RuntimeSettings(concurrency=2))
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            await wait_until(lambda: runtime.statistics().dead_lettered >= expect, 20)
            nursery.cancel_scope.cancel()


async def test_dead_lettered_training_groups_free_their_admission_slot(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a synchronous run (one group per step, staleness 0) whose one admissible group at
    # policy v0 was admitted
    config = load_config(None, [
        f"run.name={names.run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}",
        "learner.groups_per_step=1", "learner.max_staleness=0", "scheduler.max_backlog=10",
    ])
    scheduler = Scheduler(ActorContext(config, roles["scheduler"], names))
    train_task = _task("train")
    admitted = await Producer(roles["scheduler"], names).publish_counted(
        N.TASKS, [encode(train_task)], names.admitted, 0, members=[train_task.episode_id]
    )
    assert admitted == 1
    assert (await scheduler.admissible(0))[0] == 0

    # When the generator dead-letters that training group, an evaluation task and garbage
    await _dead_letter_all(client, roles["generator"], names, [
        encode(_task("eval", eval_round=0)), b"\xc1 not msgpack",
    ], expect=3)

    # Then only the training group frees its slot: one replacement may be admitted at v0
    assert int(await client.call(client.sync.get, names.dead_groups)) == 1
    assert (await scheduler.admissible(0))[0] == 1

    # When the operator requeues the training group's letter (twice: the second finds it gone)
    letters = await list_dead(client, names)
    assert len(letters) == 3
    train = [e for e in letters if e.letter and b"train" in e.letter.payload]
    assert len(train) == 1
    assert (await requeue(client, names, train))[0][1] is not None
    assert (await requeue(client, names, train))[0][1] is None

    # Then the group is in flight again and holds its slot once more
    assert int(await client.call(client.sync.get, names.dead_groups)) == 0
    assert (await scheduler.admissible(0))[0] == 0

    # And dead-lettered again, it frees the slot again (counted once per letter)
    await _dead_letter_all(client, roles["generator"], names, [], expect=1)
    assert int(await client.call(client.sync.get, names.dead_groups)) == 1
    assert (await scheduler.admissible(0))[0] == 1


async def test_requeue_takes_back_the_domain_counts_its_letter_added(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given one admitted training group of arith, in flight (admitted - resolved = 1)
    config = load_config(None, [
        f"run.name={names.run}", f"run.redis_url={redis_url}", f"run.work_dir={tmp_path}",
        "scheduler.domains=['arith']", "scheduler.max_backlog=10",
    ])
    scheduler = Scheduler(ActorContext(config, roles["scheduler"], names))
    await ensure_group(client, names.stream(N.TASKS), "generator")
    assert await scheduler.admit(1, 0, 0) == 1
    before = (await domain_health(client, names, ["arith"]))["arith"]
    assert (before.admitted, before.resolved, before.backlog) == (1, 0, 1)

    # When the generator dead-letters it (rejected): counted failed and resolved, once
    await _dead_letter_all(client, roles["generator"], names, [], expect=1)
    failed = [N.failed_counter("arith"), N.failed_counter("arith", "generator", "rejected")]
    dead = (await domain_health(client, names, ["arith"]))["arith"]
    assert (dead.resolved, dead.backlog) == (1, 0)
    assert await counts(client, names, failed) == [1, 1]

    # And the operator (as the admin role) requeues the letter, twice
    letters = await list_dead(client, names)
    assert (await requeue(roles["admin"], names, letters))[0][1] is not None
    assert (await requeue(roles["admin"], names, letters))[0][1] is None

    # Then the group is in flight again as before the letter: resolved and failed taken back
    after = (await domain_health(client, names, ["arith"]))["arith"]
    assert (after.admitted, after.resolved, after.backlog) == (1, 0, 1)
    assert await counts(client, names, failed) == [0, 0]
    assert int(await client.call(client.sync.get, names.dead_groups)) == 0

    # And dead-lettered again, it counts again (once per letter)
    await _dead_letter_all(client, roles["generator"], names, [], expect=1)
    assert (await domain_health(client, names, ["arith"]))["arith"].backlog == 0
    assert await counts(client, names, failed) == [1, 1]
