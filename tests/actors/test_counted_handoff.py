"""The counters admission and the domain shares are computed from (``zero_variance``,
``resolved:<domain>``, ``trained:<domain>``, ``dropped_stale``, ``duplicates_skipped``) are
written by the hand-off that causes them, in its script and under its dedup key: a replayed
hand-off (the entry reclaimed from a replica that died before its hand-off and redelivered,
a script call repeated after a lost reply) counts nothing twice, and the scheduler's
staleness bound ``(V + max_staleness + 1) * groups_per_step + D`` stays exact. Real Redis,
the real actors, each connected as its role's ACL user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis
import trio

from streamrl.actors.executor import to_outcome
from streamrl.actors.learner import serve as serve_learner
from streamrl.actors.scheduler import Scheduler, make_task
from streamrl.actors.verifier import Verifier
from streamrl.domains.math import MathItem
from streamrl.learner.weights import save_weights
from streamrl.models import load_model, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import (
    Executed,
    Rollout,
    Sample,
    Sampling,
    Trajectory,
    new_id,
    now,
)
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import ConsumerSettings, Producer, open_stream_consumer
from streamrl.runtime.context import ActorContext
from streamrl.runtime.policies import Policies
from streamrl.runtime.serve import ActorRuntime, RuntimeSettings
from streamrl.testing.messages import make_trajectory
from streamrl.testing.wait import wait_until
from tests.helpers import run_config

ITEM = MathItem(id="m", prompt="What is 2+2?", answer="4", kind="t")
COUNTERS = ("zero_variance", "resolved:math", "trained:math", "dropped_stale",
            "duplicates_skipped")


class Replaying(RedisClient):
    """A client whose every write is sent twice, as a retry after a lost reply sends it
    (:meth:`RedisClient.call` requires ``fn`` to be repeatable): the hand-off scripts, and
    any plain INCR/INCRBY."""

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        first = await super().call(fn, *args, **kwargs)
        if isinstance(fn, redis.commands.core.Script) or getattr(fn, "__name__", "") in (
            "incr", "incrby",
        ):
            return await super().call(fn, *args, **kwargs)
        return first


class DiesBeforeHandoff:
    """A consumer whose process dies after its handler ran, before its hand-off: the entry
    stays pending on it, for a reclaimer of another replica."""

    def __init__(self, consumer: Any) -> None:
        self._consumer = consumer
        self.reached = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._consumer, name)

    async def complete(self, handoff: Any) -> None:
        self.reached += 1
        await trio.sleep_forever()


def _executed(texts: list[str]) -> Executed:
    task = make_task("math", ITEM, split="train", group_size=len(texts), sampling=Sampling(),
                     version=0)
    samples = [Sample(tokens=b"\0\0\0\0", logprobs=b"\0\0\0\0", text=t, finish_reason="stop",
                      weight_version=0) for t in texts]
    rollout = Rollout(id=new_id(), created_at=now(), policy_version=0, task=task,
                      prompt_ids=b"\0\0\0\0", samples=samples)
    return Executed(id=new_id(), created_at=now(), policy_version=0, rollout=rollout,
                    outcomes=[to_outcome(None) for _ in texts])


async def _admit(client: RedisClient, names: N.Names, payloads: list[bytes]) -> None:
    """Record the groups as admitted (what the scheduler's admission script does)."""
    groups = [decode(p, Trajectory).episode_id for p in payloads]
    await client.call(client.sync.sadd, names.admitted_groups, *groups)


async def _counters(client: RedisClient, names: N.Names) -> dict[str, int]:
    return {
        c: sum([int(await client.call(client.sync.get, k.counter(c)) or 0)
                for k in names.layouts()])
        for c in COUNTERS
    }


async def test_replayed_verifier_handoffs_count_once_and_admission_stays_in_bound(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a run of 3 groups per step, staleness 0, dynamic sampling: 3 groups admitted at
    # v0, which the verifier finds to be 2 without reward variance and 1 mixed
    config = run_config(
        tmp_path, redis_url, names.run, "learner.groups_per_step=3", "learner.max_staleness=0",
        "verifier.dynamic_sampling=true", "scheduler.max_backlog=100",
    )
    groups = [_executed(["Answer: 4", "Answer: 4"]), _executed(["Answer: 5", "no"]),
              _executed(["Answer: 4", "Answer: 5"])]
    tasks = [g.rollout.task for g in groups]
    assert await Producer(roles["scheduler"], names).publish_counted(
        N.TASKS, [encode(t) for t in tasks], names.admitted, 0,
        members=[t.episode_id for t in tasks],
    ) == 3
    await Producer(client, names).publish(N.EXECUTED, [encode(g) for g in groups])
    scheduler = Scheduler(ActorContext(config, roles["scheduler"], names))
    bound_d0 = (0 + 0 + 1) * 3  # D true: the groups that will never be trained, each once
    samples: list[tuple[dict[str, int], int]] = []

    async def sample() -> None:
        while True:
            count, admitted = await scheduler.admissible(0)
            samples.append((await _counters(client, names), admitted + count))
            await trio.sleep(0.01)

    fast = ConsumerSettings(block_ms=50, reclaim_min_idle_ms=200)
    policies, settings = Policies(), RuntimeSettings(concurrency=4, reclaim_interval_s=0.1)
    async with trio.open_nursery() as watch:
        watch.start_soon(sample)
        # When replica A handles every group and dies before its hand-offs
        async with open_stream_consumer(roles["verifier"], names, N.EXECUTED, stage="verifier",
                                        settings=fast) as consumer:
            dying = DiesBeforeHandoff(consumer)
            runtime = ActorRuntime(dying, Verifier(True), policies, settings)  # type: ignore
            async with trio.open_nursery() as nursery:
                await nursery.start(runtime.serve)
                await wait_until(lambda: dying.reached >= 3, 20, 0.02)
                nursery.cancel_scope.cancel()
        # and replica B reclaims them, its every script call replayed (a lost reply retried)
        replaying = Replaying(roles["verifier"].url)
        try:
            async with open_stream_consumer(replaying, names, N.EXECUTED, stage="verifier",
                                            settings=fast) as consumer:
                runtime = ActorRuntime(consumer, Verifier(True), policies, settings)
                async with trio.open_nursery() as nursery:
                    await nursery.start(runtime.serve)
                    await wait_until(lambda: runtime.statistics().handled >= 3, 20, 0.02)
                    nursery.cancel_scope.cancel()
        finally:
            replaying.close()
        taken = len(samples)  # and the watcher samples what is left after both replicas
        await wait_until(lambda: len(samples) >= taken + 2, 10, what="no sample taken after")
        watch.cancel_scope.cancel()

    # Then at no sample did admission pass the exact bound (D: the 2 skipped groups)
    assert samples
    for counters, admissible in samples:
        assert admissible <= bound_d0 + 2, (counters, admissible)
    assert samples[-1][1] == bound_d0 + 2  # the two skipped groups were replaced, once
    # and each counter counted each group once, never more at any sample
    expected = {"zero_variance": 2, "resolved:math": 3, "trained:math": 1,
                "dropped_stale": 0, "duplicates_skipped": 0}
    assert await _counters(client, names) == expected
    for counters, _ in samples:
        assert all(counters[c] <= expected[c] for c in COUNTERS), counters
    assert await client.call(client.sync.xlen, names.stream(N.TRAJECTORIES)) == 1
    pending = await client.call(client.sync.xpending, names.stream(N.EXECUTED), "verifier")
    assert pending["pending"] == 0


async def test_replayed_learner_settlements_count_once(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a learner resuming at policy version 3, staleness 1, 2 groups per step
    base = resolve_model("tiny")
    await trio.to_thread.run_sync(save_weights, load_model(base), base, tmp_path / "weights", 3, 2)
    config = run_config(
        tmp_path, redis_url, names.run, "model.spec=tiny", "learner.groups_per_step=2",
        "learner.max_staleness=1", "learner.max_steps=4", "queues.block_ms=200",
    )

    def group(version: int) -> bytes:
        return encode(make_trajectory(
            [1, 2, 3], [[5, 6, 7]] * 2, [[-1.0] * 3] * 2, [0.0, 1.0], weight_versions=version
        ))

    # and two stale groups (sampled by v0, v1), one of them published twice (a duplicate
    # entry after Redis lost a dedup key), and two fresh ones
    stale = [group(0), group(1)]
    fresh = [group(2), group(3)]
    await _admit(client, names, [*stale, *fresh])
    await Producer(client, names).publish(
        N.TRAJECTORIES, [stale[0], fresh[0], stale[1], stale[0], fresh[1]]
    )

    # When the learner, connected as its user with every write replayed, takes its step
    replaying = Replaying(roles["learner"].url)
    try:
        with trio.fail_after(120):
            await serve_learner(ActorContext(config, replaying, names))
    finally:
        replaying.close()

    # Then each stale group counted once (its duplicate entry frees no second slot), and the
    # scheduler reads D = 2
    assert await _counters(client, names) == {
        "zero_variance": 0, "resolved:math": 0, "trained:math": 0, "dropped_stale": 2,
        "duplicates_skipped": 0,
    }
    scheduler = Scheduler(ActorContext(config, roles["scheduler"], names))
    assert await scheduler.counted("dropped_stale") == 2
    pending = await client.call(client.sync.xpending, names.stream(N.TRAJECTORIES), "learner")
    assert pending["pending"] == 0


async def test_a_group_dead_lettered_upstream_frees_its_slot_once_when_it_also_arrives_stale(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a learner resuming at policy version 3, staleness 1, 2 groups per step
    base = resolve_model("tiny")
    await trio.to_thread.run_sync(save_weights, load_model(base), base, tmp_path / "weights", 3, 2)
    config = run_config(
        tmp_path, redis_url, names.run, "model.spec=tiny", "learner.groups_per_step=2",
        "learner.max_staleness=1", "learner.max_steps=4", "queues.block_ms=200",
    )

    def group(version: int) -> Trajectory:
        return make_trajectory(
            [1, 2, 3], [[5, 6, 7]] * 2, [[-1.0] * 3] * 2, [0.0, 1.0], weight_versions=version
        )

    # and an admitted group (sampled by v0) dead-lettered upstream, which frees its slot
    # (dead_groups), while a duplicate entry of it still reaches the learner, stale
    lost, fresh = group(0), [group(2), group(3)]
    await _admit(client, names, [encode(t) for t in (lost, *fresh)])
    await Producer(client, names).publish(N.EXECUTED, [encode(lost)])
    settings = ConsumerSettings(block_ms=50)
    async with open_stream_consumer(
        roles["verifier"], names, N.EXECUTED, stage="verifier", settings=settings
    ) as verifier:
        [d] = await verifier.read(1)
        await verifier.dead_letter(d, "verifier gave up", ticket=lost.episode_id)
    await Producer(client, names).publish(N.TRAJECTORIES, [encode(t) for t in (lost, *fresh)])

    # When the learner drops it as stale and trains the fresh ones
    with trio.fail_after(120):
        await serve_learner(ActorContext(config, roles["learner"], names))

    # Then the group is in D once: in dead_groups, not again in dropped_stale
    scheduler = Scheduler(ActorContext(config, roles["scheduler"], names))
    assert await scheduler.counted("dropped_stale") == 0
    assert int(await client.call(client.sync.get, names.dead_groups) or 0) == 1
    assert await client.call(client.sync.scard, names.admitted_groups) == 0
    pending = await client.call(client.sync.xpending, names.stream(N.TRAJECTORIES), "learner")
    assert pending["pending"] == 0
