"""Scoring is isolated and bounded: a domain whose ``score`` hangs, or kills its process,
costs its message retries and then a dead letter, while the verifier keeps running and the
other domains' messages are verified. Real Redis, the real runtime and verifier, real
scorer processes (:mod:`runtime.workers`)."""

from __future__ import annotations

import trio

from streamrl.actors.executor import to_outcome
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import SCORER_PRELOAD, Verifier
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Rollout, Sample, Sampling, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode, encode
from streamrl.queues.streams import ConsumerSettings, Producer, open_stream_consumer
from streamrl.runtime.policies import Policies, RetryPolicy
from streamrl.runtime.serve import ActorRuntime, RuntimeSettings
from streamrl.runtime.workers import open_worker_pool
from streamrl.testing.wait import wait_until
from tests.actors import planted_scorers
from tests.actors.planted_scorers import PlantedItem


def _executed(domain: str) -> Executed:
    task = make_task(domain, PlantedItem(id=domain, prompt="p"), split="train", group_size=1,
                     sampling=Sampling(), version=0)
    sample = Sample(tokens=b"\0\0\0\0", logprobs=b"\0\0\0\0", text="x", finish_reason="stop",
                    weight_version=0)
    rollout = Rollout(id=new_id(), created_at=now(), policy_version=0, task=task,
                      prompt_ids=b"\0\0\0\0", samples=[sample])
    return Executed(id=new_id(), created_at=now(), policy_version=0, rollout=rollout,
                    outcomes=[to_outcome(None)])


async def _verify(client: RedisClient, names: N.Names, groups: list[Executed]) -> ActorRuntime:
    await Producer(client, names).publish(N.EXECUTED, [encode(g) for g in groups])
    policies = Policies(retry=RetryPolicy(max_retries=2, backoff_s=0.05, max_backoff_s=0.1),
                        time_limit_s=30.0)
    settings = ConsumerSettings(block_ms=50)
    async with (
        open_worker_pool(2, planted_scorers.setup, SCORER_PRELOAD) as scorers,
        open_stream_consumer(client, names, N.EXECUTED, stage="verifier",
                             settings=settings) as consumer,
    ):
        verifier = Verifier(scorers=scorers, score_timeout_s=1.0)
        runtime = ActorRuntime(consumer, verifier, policies, RuntimeSettings(concurrency=2))
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            await wait_until(
                lambda: (s := runtime.statistics()).handled + s.dead_lettered >= len(groups),
                timeout=60,
                interval=0.1,
            )
            # the verifier is still serving: one more good message is verified
            await Producer(client, names).publish(N.EXECUTED, [encode(_executed("planted-ok"))])
            await wait_until(  # 2 good + 1 more
                lambda: runtime.statistics().handled >= len(groups), timeout=30
            )
            nursery.cancel_scope.cancel()
        assert scorers.statistics().failed == 3  # each failed attempt: its worker killed
    return runtime


async def _dead(client: RedisClient, names: N.Names) -> list[DeadLetter]:
    rows = await client.call(client.sync.xrange, names.stream(N.DEAD))
    return [decode(f[b"d"], DeadLetter) for _, f in rows]


async def test_hanging_scorer_is_retried_then_dead_lettered_while_others_verify(
    client: RedisClient, names: N.Names
) -> None:
    # Given a message whose scorer never returns, between messages of a good domain
    groups = [_executed("planted-ok"), _executed("planted-hang"), _executed("planted-ok")]
    # When the verifier serves them
    runtime = await _verify(client, names, groups)
    # Then the hanging one was tried 3 times (each attempt's worker killed at its deadline)
    # and dead-lettered, and every good one (including one sent afterwards) was verified
    [letter] = await _dead(client, names)
    assert "failed 3 times" in letter.error and "deadline" in letter.error, letter.error
    assert runtime.statistics().handled == 3
    assert await client.call(client.sync.xlen, names.stream(N.TRAJECTORIES)) == 3


async def test_crashing_scorer_is_retried_then_dead_lettered_while_others_verify(
    client: RedisClient, names: N.Names
) -> None:
    # Given a message whose scorer kills its own process (os._exit)
    groups = [_executed("planted-crash"), _executed("planted-ok"), _executed("planted-ok")]
    # When the verifier serves them
    runtime = await _verify(client, names, groups)
    # Then this process lives on, the crashing one is dead-lettered after its retries
    [letter] = await _dead(client, names)
    assert "failed 3 times" in letter.error and "died" in letter.error, letter.error
    assert runtime.statistics().handled == 3
    assert await client.call(client.sync.xlen, names.stream(N.TRAJECTORIES)) == 3
