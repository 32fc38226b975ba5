"""Only an admitted training group frees an admission slot when it is dead-lettered, and
only once: the scheduler records each group it admits (``names.admitted_groups``, in the
same script as the admission), a dead letter frees a slot only for a group it takes out of
that record, a requeue puts it back, and the learner takes out the groups it settles.
Without the record, every forged or garbage training task dead-lettered let the scheduler
admit one extra group. Real Redis, every side connected as its role's ACL user."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from streamrl.actors.learner import serve as serve_learner
from streamrl.actors.monitor import Monitor
from streamrl.actors.scheduler import Scheduler
from streamrl.cli.dlq import list_dead, requeue
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Rollout, Task
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.runtime.policies import Reject
from streamrl.runtime.serve import Output, serve_actor
from streamrl.testing.wait import wait_until
from tests.actors.helpers import ONE_TINY_STEP, group
from tests.actors.test_poison_refs import READER, WRITER, _config, _letters
from tests.chaos.badinputs import INPUT_TYPES, VALID, _executed, _rollout, _trajectory
from tests.helpers import open_roles


class Refusing:
    """A stage that rejects every input (as for one it can never serve)."""

    def __init__(self, stream: str) -> None:
        self.stage = READER[stream]
        self.input_stream = stream
        self.input_type = INPUT_TYPES[stream]

    async def handle(self, message: Any) -> list[Output]:
        raise Reject("cannot serve this")


async def _dead_groups(client: RedisClient, names: N.Names) -> int:
    total = 0
    for layout in names.layouts():
        total += int(await client.call(client.sync.get, layout.dead_groups) or 0)
    return total


async def _refuse_all(
    ctx: ActorContext, stream: str, client: RedisClient, letters: int
) -> None:
    """Run ``stream``'s stage, refusing everything, until the run has ``letters`` letters."""

    async def done() -> bool:
        n = 0
        for layout in ctx.names.layouts():
            n += int(await client.call(client.sync.xlen, layout.stream(N.DEAD)))
        return n >= letters

    actor = Refusing(stream)
    async with ctx.consumer(stream, actor.stage) as consumer, trio.open_nursery() as nursery:
        await nursery.start(
            serve_actor, consumer, actor, ctx.policies(10), ctx.runtime_settings(2, stream)
        )
        await wait_until(done, timeout=30)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("stream", [N.TASKS, N.ROLLOUTS, N.EXECUTED])
async def test_a_forged_training_group_frees_no_slot_at_a_runtime_stage(
    stream: str, client: RedisClient, names: N.Names, roles: dict[str, RedisClient],
    redis_url: str, tmp_path: Path,
) -> None:
    # Given a training group of split "train" the scheduler never admitted, written by the
    # stream's producer
    forged = VALID[stream]()
    writer = roles[WRITER[stream]]
    await writer.call(writer.sync.xadd, names.stream(stream), {b"d": encode(forged)})
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), roles[READER[stream]], names)

    # When the stage dead-letters it
    await _refuse_all(ctx, stream, client, 1)

    # Then the letter is there and no admission slot was freed
    [letter] = await _letters(client, names)
    assert letter.error == "rejected: cannot serve this"
    assert await _dead_groups(client, names) == 0


async def test_a_forged_training_group_frees_no_slot_at_the_learner(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a training group the learner cannot train on (3 rewards for 2 samples), never
    # admitted, then two trainable groups
    verifier = roles["verifier"]
    forged = _trajectory(rewards=[0.0, 1.0, 1.0])
    for t in (forged, group([0.0, 1.0]), group([1.0, 0.0])):
        await verifier.call(verifier.sync.xadd, names.stream(N.TRAJECTORIES), {b"d": encode(t)})
    config = _config(tmp_path, redis_url, names.run, *ONE_TINY_STEP)

    # When the learner takes its step
    with trio.fail_after(120):
        await serve_learner(ActorContext(config, roles["learner"], names))

    # Then the forged group is dead-lettered and freed no slot
    [letter] = await _letters(client, names)
    assert letter.error.startswith("malformed group: "), letter.error
    assert await _dead_groups(client, names) == 0


async def test_a_forged_training_group_frees_no_slot_at_the_monitor(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a training group pushed into evals (never admitted), and one of an admitted
    # group (its real entry is still on its way to the learner)
    verifier = roles["verifier"]
    await verifier.call(verifier.sync.xadd, names.stream(N.EVALS), {b"d": encode(_trajectory())})
    admitted = _trajectory()
    await client.call(client.sync.sadd, names.admitted_groups, admitted.episode_id)
    await verifier.call(verifier.sync.xadd, names.stream(N.EVALS), {b"d": encode(admitted)})
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), roles["monitor"], names)

    # When the monitor dead-letters it
    async with trio.open_nursery() as nursery:
        await nursery.start(Monitor(ctx, tmp_path, eval_items=1).serve)
        await wait_until(lambda: _count(client, names, 2), timeout=30)
        nursery.cancel_scope.cancel()

    # Then both are dead-lettered and no slot was freed: the admitted group is still unsettled
    letters = await _letters(client, names)
    assert len(letters) == 2
    assert all(x.error.startswith("rejected: not an evaluation result") for x in letters)
    assert await _dead_groups(client, names) == 0
    assert await client.call(client.sync.sismember, names.admitted_groups, admitted.episode_id)


async def _count(client: RedisClient, names: N.Names, n: int) -> bool:
    return int(await client.call(client.sync.xlen, names.stream(N.DEAD))) >= n


def _downstream(task: Task) -> tuple[Rollout, Executed]:
    """The admitted task's rollout and executed result (the same group, later stages)."""
    rollout = _rollout(task)
    return rollout, _executed(rollout)


async def test_an_admitted_group_frees_its_slot_once_and_again_after_a_requeue(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given one group admitted by the real scheduler (as its user)
    config = _config(tmp_path, redis_url, names.run, "learner.groups_per_step=1",
                     "learner.max_staleness=0", "scheduler.max_backlog=10")
    scheduler = Scheduler(ActorContext(config, roles["scheduler"], names))
    assert await scheduler.admit(1, 0, 0) == 1
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.TASKS))
    task = decode(fields[b"d"], Task)
    assert (await scheduler.admissible(0))[0] == 0

    # When the generator dead-letters it, and a copy of the same group (a rollout of it, as
    # after a duplicate hand-off) is dead-lettered by the executor as well
    await _refuse_all(ActorContext(config, roles["generator"], names), N.TASKS, client, 1)
    rollout, _ = _downstream(task)
    gen = roles["generator"]
    await gen.call(gen.sync.xadd, names.stream(N.ROLLOUTS), {b"d": encode(rollout)})
    await _refuse_all(ActorContext(config, roles["executor"], names), N.ROLLOUTS, client, 2)

    # Then its slot was freed once: one replacement may be admitted
    assert len(await _letters(client, names)) == 2
    assert await _dead_groups(client, names) == 1
    assert (await scheduler.admissible(0))[0] == 1

    # When the operator requeues the generator's letter, and the generator refuses it again
    letters = [e for e in await list_dead(client, names) if e.letter
               and e.letter.stream == N.TASKS]
    assert (await requeue(roles["admin"], names, letters))[0][1] is not None
    assert await _dead_groups(client, names) == 0
    await _refuse_all(ActorContext(config, roles["generator"], names), N.TASKS, client, 2)

    # Then it frees its slot again, once
    assert await _dead_groups(client, names) == 1


async def test_sharded_admission_records_each_group_in_its_shard(
    client: RedisClient, redis_url: str, tmp_path: Path,
) -> None:
    # Given a run of 2 shards and its users, 6 groups admitted by the real scheduler and
    # 2 forged training tasks in each shard
    names = N.Names(run=f"t{uuid.uuid4().hex[:10]}", shards=2)
    async with open_roles(client, names) as roles:
        config = _config(tmp_path, redis_url, names.run, "queues.shards=2",
                         "scheduler.max_backlog=100")
        scheduler = Scheduler(ActorContext(config, roles["scheduler"], names))
        assert await scheduler.admit(6, 0, 0) == 6
        for shard in range(2):
            for _ in range(2):
                forged = encode(VALID[N.TASKS]())
                await roles["scheduler"].call(
                    roles["scheduler"].sync.xadd, names.in_shard(shard).stream(N.TASKS),
                    {b"d": forged},
                )

        # When the generator dead-letters everything
        ctx = ActorContext(config, roles["generator"], names)
        await _refuse_all(ctx, N.TASKS, client, 10)

        # Then the 6 admitted groups freed one slot each, the forged ones none
        assert await _dead_groups(client, names) == 6
        for layout in names.layouts():
            assert await client.call(client.sync.scard, layout.admitted_groups) == 0


async def test_groups_the_learner_trains_leave_the_record(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given two admitted groups in trajectories (recorded as the scheduler records them)
    groups = [group([0.0, 1.0]), group([1.0, 0.0])]
    ids = [g.episode_id for g in groups]
    await Producer(client, names).publish_counted(
        N.TRAJECTORIES, [encode(g) for g in groups], names.counter("test"), 0, members=ids
    )
    assert await client.call(client.sync.scard, names.admitted_groups) == 2
    config = _config(tmp_path, redis_url, names.run, *ONE_TINY_STEP)

    # When the learner trains them
    with trio.fail_after(120):
        await serve_learner(ActorContext(config, roles["learner"], names))

    # Then they left the record with their acknowledgement (a copy of one dead-lettered
    # later, a duplicate, can free no slot)
    assert await client.call(client.sync.scard, names.admitted_groups) == 0
    assert await client.call(client.sync.xpending, names.stream(N.TRAJECTORIES), "learner") \
        == {"pending": 0, "min": None, "max": None, "consumers": []}
