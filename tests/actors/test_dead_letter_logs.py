"""Every stage logs every dead letter (error level, with the entry id, the stream and the
reason), the learner and the monitor too; the learner refuses what is not a training group
(an evaluation result pushed into ``trajectories``) instead of training on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import trio
from structlog.testing import capture_logs

from streamrl.actors.learner import serve as serve_learner
from streamrl.actors.monitor import Monitor
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.runtime.context import ActorContext
from streamrl.runtime.serve import serve_actor
from streamrl.testing.wait import wait_until
from tests.actors.helpers import ONE_TINY_STEP, group
from tests.actors.test_admission_record import Refusing
from tests.actors.test_poison_refs import _config, _letters
from tests.chaos.badinputs import VALID


def _logged(logs: list[dict[str, Any]], entry_id: str, stream: str) -> dict[str, Any]:
    [line] = [e for e in logs if e["event"] == "dead-lettered" and e["entry_id"] == entry_id]
    assert line["log_level"] == "error" and line["stream"] == stream, line
    return line


async def test_the_learner_refuses_an_evaluation_result_and_logs_it(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given an evaluation result (split "eval", round 0, trainable rewards, temperature 1)
    # pushed into trajectories, then two training groups
    train = group([0.0, 1.0])
    task = msgspec.structs.replace(train.rollout.task, split="eval", eval_round=0)
    result = msgspec.structs.replace(
        train, rollout=msgspec.structs.replace(train.rollout, task=task)
    )
    assert task.sampling.temperature > 0
    verifier = roles["verifier"]
    ids = []
    for t in (result, group([0.0, 1.0]), group([1.0, 0.0])):
        eid = await verifier.call(verifier.sync.xadd, names.stream(N.TRAJECTORIES),
                                  {b"d": encode(t)})
        ids.append(eid.decode())
    config = _config(tmp_path, redis_url, names.run, *ONE_TINY_STEP)

    # When the learner takes its step
    with capture_logs() as logs, trio.fail_after(120):
        await serve_learner(ActorContext(config, roles["learner"], names))

    # Then it trained the two training groups only, dead-lettered the result with the reason,
    # and logged the letter
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.METRICS))
    assert decode(fields[b"d"], StepMetrics).groups == 2
    [letter] = await _letters(client, names)
    assert letter.entry_id == ids[0]
    assert letter.error == "not a training group: split 'eval', eval round 0"
    assert _logged(logs, ids[0], N.TRAJECTORIES)["reason"] == letter.error


async def test_the_monitor_logs_its_dead_letters(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a training group pushed into evals
    verifier = roles["verifier"]
    eid = await verifier.call(verifier.sync.xadd, names.stream(N.EVALS),
                              {b"d": encode(group([0.0, 1.0]))})
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), roles["monitor"], names)

    # When the monitor dead-letters it
    with capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await nursery.start(Monitor(ctx, tmp_path, eval_items=1).serve)
            await wait_until(lambda: _any_letter(client, names), timeout=30)
            nursery.cancel_scope.cancel()

    # Then the letter is logged with its reason
    [letter] = await _letters(client, names)
    line = _logged(logs, eid.decode(), N.EVALS)
    assert line["reason"] == letter.error
    assert line["reason"].startswith("rejected: not an evaluation result")


async def _any_letter(client: RedisClient, names: N.Names) -> bool:
    return bool(await client.call(client.sync.xlen, names.stream(N.DEAD)))


async def test_a_runtime_stage_logs_its_dead_letters(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a task the generator refuses
    scheduler = roles["scheduler"]
    eid = await scheduler.call(scheduler.sync.xadd, names.stream(N.TASKS),
                               {b"d": encode(VALID[N.TASKS]())})
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), roles["generator"], names)
    actor = Refusing(N.TASKS)

    # When the generator's runtime dead-letters it
    with capture_logs() as logs:
        async with ctx.consumer(N.TASKS, "generator") as consumer, trio.open_nursery() as n:
            await n.start(serve_actor, consumer, actor, ctx.policies(10),
                          ctx.runtime_settings(1, N.TASKS))
            await wait_until(lambda: _any_letter(client, names), timeout=30)
            n.cancel_scope.cancel()

    # Then it is logged once, with the reason
    assert _logged(logs, eid.decode(), N.TASKS)["reason"] == "rejected: cannot serve this"
