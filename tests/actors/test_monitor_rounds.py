"""The monitor counts held-out results and losses only in rounds the run opened (the
``eval_round`` counter the scheduler and ``up`` increment before they publish a round): a
forged evaluation task or result naming a round never opened is passed over (a result is
dead-lettered), so it can neither end a round nor crash the progress line. A real round
whose every item was dead-lettered ends empty and is reported as such. Real Redis, the
monitor as its role's user, the letters written by the real generator runtime or, forged, as
a stage's user."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import trio

from streamrl.actors.monitor import Monitor
from streamrl.protocol import names as N
from streamrl.protocol.messages import Task
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, encode
from streamrl.queues.operations import increment
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until
from tests.actors.test_dead_groups import _dead_letter_all
from tests.chaos.badinputs import _eval_trajectory, _task
from tests.helpers import run_config


def _eval_task(round_no: int, item: str, group_size: int = 1) -> Task:
    return msgspec.structs.replace(_task(split="eval", eval_round=round_no), item_id=item,
                                   group_size=group_size)


async def _forge_letter(stage: RedisClient, names: N.Names, task: Task) -> None:
    letter = DeadLetter(stream=N.TASKS, group="generator", entry_id="1-0", error="forged",
                        deliveries=1, payload=encode(task), at=0.0)
    await stage.call(stage.sync.xadd, names.stream(N.DEAD), {"d": encode(letter)})


async def test_a_round_never_opened_is_passed_over(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a run that opened round 0 (2 held-out items), and its monitor serving
    config = run_config(tmp_path, redis_url, names.run)
    await increment(client, names.eval_round)
    monitor = Monitor(ActorContext(config, roles["monitor"], names), tmp_path, eval_items=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.serve)

        # When a stage forges a dead letter of an eval task of round 999 (a group of 64), and
        # an evaluation result of round 999, then round 0's two items are lost for real
        await _forge_letter(roles["generator"], names, _eval_task(999, "x", group_size=64))
        forged = _eval_trajectory()
        forged = msgspec.structs.replace(forged, rollout=msgspec.structs.replace(
            forged.rollout, task=_eval_task(999, "y")))
        verifier = roles["verifier"]
        await verifier.call(verifier.sync.xadd, names.stream(N.EVALS), {"d": encode(forged)})
        for item in ("a", "b"):
            await _forge_letter(roles["generator"], names, _eval_task(0, item))
        with trio.fail_after(20):
            await monitor.wait_round(0)

        async def result_refused() -> bool:
            return await client.call(client.sync.xlen, names.stream(N.DEAD)) == 4

        await wait_until(result_refused, 20)
        nursery.cancel_scope.cancel()

    # Then round 999 was never counted: only round 0 ended, and the progress line reads
    assert sorted(monitor.rounds) == [0]
    assert "eval - (round 0: all 2 lost)" in monitor.progress_line()


async def test_a_round_whose_items_were_all_dead_lettered_is_reported_empty(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a run that opened round 0 of 2 held-out items, and its monitor serving
    config = run_config(tmp_path, redis_url, names.run)
    await increment(client, names.eval_round)
    monitor = Monitor(ActorContext(config, roles["monitor"], names), tmp_path, eval_items=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.serve)

        # When the generator dead-letters both of its items (the real runtime)
        await _dead_letter_all(client, roles["generator"], names,
                               [encode(_eval_task(0, "a")), encode(_eval_task(0, "b"))])
        with trio.fail_after(20):
            empty = await monitor.wait_round(0)
        nursery.cancel_scope.cancel()

    # Then the round ended with no result, and the progress line and summary report it
    assert (empty.rewards, empty.lost) == ([], 2)
    assert "eval - (round 0: all 2 lost)" in monitor.progress_line()
    summary = monitor.summary(names.run)
    assert [r["items"] for r in summary.eval_rounds] == [0]
    # with no reward for it (as `up` writes --summary-json: strict JSON, no NaN)
    assert summary.eval_reward_before is None and summary.eval_rounds[0]["reward"] is None
    json.loads(json.dumps(msgspec.to_builtins(summary)),
               parse_constant=lambda c: pytest.fail(f"{c} in the summary JSON"))
