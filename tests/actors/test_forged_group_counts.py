"""A training group the run never admitted counts nothing for its domain: the verifier's
counts of a group (resolved, trained, scored, zero-variance skips) are added with its
hand-off only if the group is in the admission record (``names.admitted_groups``, checked in
the same script). Before, forged tasks counted as trained for their domain (a summary with
``trained`` 1,543 > ``admitted`` 1,541) and a forged group without reward variance freed an
admission slot. Real Redis, the real verifier runtime as its role's user."""

from __future__ import annotations

import uuid
from pathlib import Path

import trio

from streamrl.actors.verifier import Verifier
from streamrl.protocol import names as N
from streamrl.protocol.quarantine import counts
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.keys import shard_for
from streamrl.queues.streams import ConsumerSettings, Producer, open_stream_consumer
from streamrl.runtime.context import ActorContext
from streamrl.runtime.policies import Policies
from streamrl.runtime.serve import ActorRuntime, RuntimeSettings
from streamrl.testing.wait import wait_until
from tests.actors.test_counted_handoff import _executed
from tests.helpers import open_roles, run_config

COUNTERS = ["resolved:math", "trained:math", "zero_variance"]


async def _verify(roles: dict[str, RedisClient], names: N.Names, n: int) -> None:
    settings = ConsumerSettings(block_ms=50)
    async with open_stream_consumer(roles["verifier"], names, N.EXECUTED, stage="verifier",
                                    settings=settings) as consumer:
        runtime = ActorRuntime(consumer, Verifier(True), Policies(), RuntimeSettings(2))
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            await wait_until(lambda: runtime.statistics().handled >= n, 30)
            nursery.cancel_scope.cancel()


async def test_a_group_never_admitted_counts_nothing(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], tmp_path: Path,
) -> None:
    # Given one admitted math group, and two forged ones (one mixed, one without variance)
    admitted = _executed(["Answer: 4", "Answer: 5"])
    await client.call(client.sync.sadd, names.admitted_groups, admitted.rollout.task.episode_id)
    forged = [_executed(["Answer: 4", "no"]), _executed(["Answer: 4", "Answer: 4"])]
    await Producer(roles["executor"], names).publish(
        N.EXECUTED, [encode(e) for e in (admitted, *forged)])

    # When the verifier handles the three
    await _verify(roles, names, 3)

    # Then only the admitted group counted: resolved and trained once, no slot freed
    assert await counts(client, names, COUNTERS) == [1, 1, 0]
    assert await client.call(client.sync.xlen, names.stream(N.TRAJECTORIES)) == 2


async def test_a_sharded_run_checks_each_group_in_its_own_shard(
    client: RedisClient, redis_url: str, tmp_path: Path,
) -> None:
    # Given a run of 2 shards: in each shard one admitted math group and one forged one
    names = N.Names(run=f"t{uuid.uuid4().hex[:10]}", shards=2)
    async with open_roles(client, names) as roles:
        config = run_config(tmp_path, redis_url, names.run, "queues.shards=2")
        per_shard: dict[int, list[bool]] = {0: [], 1: []}
        while any(len(v) < 2 for v in per_shard.values()):
            group = _executed(["Answer: 4", "Answer: 5"])
            shard = shard_for(group.rollout.task.episode_id, 2)
            if len(per_shard[shard]) == 2:
                continue
            layout = names.in_shard(shard)
            if not per_shard[shard]:  # the first of each shard is admitted
                await client.call(client.sync.sadd, layout.admitted_groups,
                                  group.rollout.task.episode_id)
            per_shard[shard].append(True)
            await client.call(client.sync.xadd, layout.stream(N.EXECUTED), {"d": encode(group)})

        # When the verifier (its sharded consumer, as its user) handles the four
        ctx = ActorContext(config, roles["verifier"], names)
        async with ctx.consumer(N.EXECUTED, "verifier") as consumer:
            runtime = ActorRuntime(consumer, Verifier(True), Policies(), RuntimeSettings(2))
            async with trio.open_nursery() as nursery:
                await nursery.start(runtime.serve)
                await wait_until(lambda: runtime.statistics().handled >= 4, 30)
                nursery.cancel_scope.cancel()

        # Then each shard counted its admitted group only
        assert await counts(client, names, COUNTERS) == [2, 2, 0]
