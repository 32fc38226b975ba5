"""Well-formed messages an actor still cannot use are dead-lettered with the reason, and the
actor keeps going: a group the learner cannot train on, a result the monitor cannot record."""

from __future__ import annotations

from pathlib import Path

import msgspec
import trio

from streamrl.actors.learner import serve
from streamrl.actors.monitor import Monitor
from streamrl.config.schema import Config
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode, encode
from streamrl.queues.operations import increment
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from tests.actors.helpers import ONE_TINY_STEP, group
from tests.helpers import run_config


def _config(tmp_path: Path, redis_url: str, run: str) -> Config:
    return run_config(tmp_path, redis_url, run, *ONE_TINY_STEP)


async def _dead_letters(client: RedisClient, names: N.Names) -> list[DeadLetter]:
    rows = await client.call(client.sync.xrange, names.stream(N.DEAD))
    return [decode(f[b"d"], DeadLetter) for _, f in rows]


async def test_learner_dead_letters_groups_it_cannot_train_on(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given two good groups and two malformed ones: 3 rewards for 2 samples, 3 tokens for 2
    # logprobs (either would make the training step raise and the learner exit)
    good = [group([0.0, 1.0]), group([1.0, 0.0])]
    bad = [
        msgspec.structs.replace(group([0.0, 1.0]), rewards=[0.0, 1.0, 1.0]),
        group([0.0, 1.0], tokens=[5, 6, 7]),
    ]
    payloads = [encode(bad[0]), encode(good[0]), encode(bad[1]), encode(good[1])]
    await Producer(client, names).publish(N.TRAJECTORIES, payloads)
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), client, names)

    # When the learner takes its one step
    with trio.fail_after(120):
        await serve(ctx)

    # Then it trained the good groups, and dead-lettered the others with the reason
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.METRICS))
    assert decode(fields[b"d"], StepMetrics).groups == 2
    letters = await _dead_letters(client, names)
    assert [x.error.split(":")[0] for x in letters] == ["malformed group"] * 2
    assert "2 samples, 3 rewards" in letters[0].error
    assert "3 tokens, 2 logprobs" in letters[1].error
    pending = await client.call(client.sync.xpending, names.stream(N.TRAJECTORIES), "learner")
    assert pending["pending"] == 0


async def test_monitor_dead_letters_what_is_not_an_evaluation_result(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a training group and an evaluation result without rewards in the evals stream,
    # then a proper evaluation result
    train = group([0.0, 1.0])
    task = msgspec.structs.replace(train.rollout.task, split="eval", eval_round=0)
    result = msgspec.structs.replace(
        train, rollout=msgspec.structs.replace(train.rollout, task=task)
    )
    # (of another item: a dead-lettered result counts as lost for its own item, and had it the
    # proper result's item, whichever the monitor saw first would decide that item)
    other = msgspec.structs.replace(task, item_id=task.item_id + "-other")
    empty = msgspec.structs.replace(
        result, rollout=msgspec.structs.replace(result.rollout, task=other), rewards=[]
    )
    await Producer(client, names).publish(N.EVALS, [encode(train), encode(empty), encode(result)])
    await increment(client, names.eval_round)  # round 0, opened by the run
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), client, names)
    monitor = Monitor(ctx, tmp_path, eval_items=4)  # two items of two samples each

    # When the monitor reads them
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.serve)
        with trio.fail_after(30):
            await monitor.wait_round(0)
        nursery.cancel_scope.cancel()

    # Then it recorded the result and dead-lettered the other two (rejected by its handler,
    # through the runtime), and is still running
    assert monitor.rounds[0].rewards == [0.0, 1.0] and monitor.rounds[0].lost == 2
    letters = await _dead_letters(client, names)
    assert sorted(x.error for x in letters) == [  # handled concurrently: in any order
        "rejected: not an evaluation result: 0 rewards for 2 samples",
        "rejected: not an evaluation result: split 'train', eval round -1",
    ]
