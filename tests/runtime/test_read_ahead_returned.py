"""Entries read ahead and never handed to a handler are returned uncharged at shutdown: the
delivery limit counts the deliveries a handler had, not the reads that went before them.

Against a real Redis: each test stops a consumer with entries in hand, restarts it under the
same name with ``max_deliveries = 1``, and reads what the restarted one is given.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

import trio

from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling, Task, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode, encode
from streamrl.queues.shards import open_sharded_consumer
from streamrl.queues.streams import (
    ConsumerSettings,
    Producer,
    StreamConsumer,
    open_stream_consumer,
)
from streamrl.runtime.batches import BatchSettings, open_batches
from streamrl.runtime.policies import Policies, Unavailable
from streamrl.runtime.serve import ActorRuntime, Output, RuntimeSettings
from streamrl.testing.wait import wait_until

ONCE = ConsumerSettings(block_ms=50, max_deliveries=1)


def _task(i: int) -> Task:
    return Task(id=new_id(), created_at=now(), policy_version=0, domain="d", item_id=str(i),
                split="train", prompt="p", spec={}, group_size=1, sampling=Sampling())


def _consumer(
    client: RedisClient, names: N.Names, name: str
) -> AbstractAsyncContextManager[StreamConsumer]:
    """A consumer of ``tasks`` named ``name`` (restarted: the same name) with the limit at 1."""
    return open_stream_consumer(client, names, N.TASKS, stage=name, consumer=name, settings=ONCE)


def _settled(runtime: ActorRuntime) -> int:
    stats = runtime.statistics()
    return stats.handled + stats.dead_lettered


async def _dead(client: RedisClient, names: N.Names) -> list[DeadLetter]:
    rows = await client.call(client.sync.xrange, names.stream(N.DEAD))
    return [decode(f[b"d"], DeadLetter) for _, f in rows]


async def test_batches_read_ahead_return_uncharged_and_the_begun_ones_stay_charged(
    client: RedisClient, names: N.Names
) -> None:
    # Given two entries, and a batch consumer (the learner's: a fixed name, the delivery
    # limit at 1) that begins a step on the first and reads the second ahead for the next
    tasks = [_task(0), _task(1)]
    await Producer(client, names).publish(N.TASKS, [encode(t) for t in tasks])
    began = trio.Event()

    async def train(_: list[Task]) -> None:
        began.set()
        await trio.sleep_forever()

    async with (
        _consumer(client, names, "learner-0") as c,
        open_batches(c, "learner", Task, Policies(), BatchSettings()) as batches,
        trio.open_nursery() as nursery,
    ):
        step = await batches.collect(1)
        nursery.start_soon(batches.handle, step, train)
        await began.wait()
        ahead = await batches.collect(1)
        # When the process stops with the step running and the next batch in hand
        nursery.cancel_scope.cancel()
    assert [h.message.id for h in step + ahead] == [t.id for t in tasks]
    # Then, restarted under the same name, the step's entry is past the limit (its handler
    # had it once) and the entry read ahead is handed out as new (it was never begun)
    async with _consumer(client, names, "learner-0") as c:
        again = await c.read(2)
    assert [(d.past_limit, d.deliveries) for d in again] == [(True, 2), (False, 1)]


async def test_a_sharded_consumers_read_ahead_returns_uncharged_when_it_closes(
    client: RedisClient, names: N.Names
) -> None:
    # Given one entry in each of two shards and a consumer of both that takes one of them,
    # holding the other (read from Redis with it, not handed out yet)
    sharded = names.in_shard(None)
    for shard in (0, 1):
        await Producer(client, names.in_shard(shard)).publish(N.TASKS, [encode(_task(shard))])
    both = (0, 1)
    async with open_sharded_consumer(client, sharded, N.TASKS, both, stage="s", consumer="s-0",
                                     settings=ONCE) as c:
        [taken] = await c.read(1)
    # When it closes and a consumer of the same name reads both shards again
    async with open_sharded_consumer(client, sharded, N.TASKS, both, stage="s", consumer="s-0",
                                     settings=ONCE) as c:
        again = {d.entry_id: d for d in await c.read(2)}
        if len(again) < 2:
            again.update({d.entry_id: d for d in await c.read(2)})
    # Then the one handed out is charged (2 > 1: past the limit), the one held back is not
    assert len(again) == 2
    assert {eid for eid, d in again.items() if d.past_limit} == {taken.entry_id}


class WaitsForWeights:
    """A generator's shape: the task waits for weights that never come; the process drains
    while it waits (SIGTERM), so the task is released before anything of it began."""

    stage = "generator"
    input_stream = N.TASKS
    input_type = Task

    def __init__(self) -> None:
        self.runtime: ActorRuntime | None = None
        self.calls = 0

    async def handle(self, task: Task) -> list[Output]:
        self.calls += 1
        if self.runtime is not None:
            self.runtime.drain()
            raise Unavailable("draining: weights not served, released for another generator")
        return [Output(N.ROLLOUTS, task)]


async def test_a_task_released_while_draining_is_not_charged_a_delivery(
    client: RedisClient, names: N.Names
) -> None:
    # Given a task taken by a generator that drains while the task waits for weights
    await Producer(client, names).publish(N.TASKS, [encode(_task(0))])
    actor = WaitsForWeights()
    async with _consumer(client, names, "generator-a") as c:
        actor.runtime = ActorRuntime(c, actor, Policies(), RuntimeSettings(concurrency=1))
        with trio.fail_after(30):
            await actor.runtime.serve()
        assert actor.runtime.statistics().released == 1
    # When the generator comes back (same name: its own pending list first)
    actor.runtime = None
    async with _consumer(client, names, "generator-a") as c:
        runtime = ActorRuntime(c, actor, Policies(), RuntimeSettings(concurrency=1))
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            await wait_until(lambda: _settled(runtime), timeout=20)
            nursery.cancel_scope.cancel()
    # Then the task is generated: the delivery that was released is not held against it
    assert await _dead(client, names) == []
    assert actor.calls == 2
    assert await client.call(client.sync.xlen, names.stream(N.ROLLOUTS)) == 1
