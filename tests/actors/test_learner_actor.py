"""The learner actor against a real Redis and the tiny model: staleness, atomic steps."""

from __future__ import annotations

import secrets
from pathlib import Path

import msgspec
import pytest
import trio

from streamrl.actors.learner import serve
from streamrl.config.schema import Config
from streamrl.learner.checkpoint import LEDGER_FILE, TRAINER_STATE_FILE, Ledger
from streamrl.learner.weights import save_weights
from streamrl.models import load_model, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, Trajectory, WeightsPublished
from streamrl.protocol.roles import apply_acls
from streamrl.queues.acl import Credentials, role_url
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode, encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.messages import make_trajectory
from streamrl.testing.wait import wait_until
from tests.helpers import WatchedContext, more_calls, run_config


def _config(tmp_path: Path, redis_url: str, run: str, extra: tuple[str, ...] = ()) -> Config:
    return run_config(
        tmp_path,
        redis_url,
        run,
        "model.spec=tiny",
        "learner.groups_per_step=2",
        "learner.max_staleness=1",
        "learner.max_steps=4",
        "learner.lr=1e-4",
        "queues.block_ms=200",
        *extra,
    )


def _group(version: int, rewards: list[float]) -> bytes:
    n = len(rewards)
    traj = make_trajectory(
        [1, 2, 3], [[5, 6, 7]] * n, [[-1.0, -1.0, -1.0]] * n, rewards, weight_versions=version
    )
    return encode(traj)


async def test_learner_drops_stale_groups_and_steps_atomically(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a learner resuming at policy version 3 (weights v3 on disk)
    base = resolve_model("tiny")
    await trio.to_thread.run_sync(save_weights, load_model(base), base, tmp_path / "weights", 3, 2)
    config = _config(tmp_path, redis_url, names.run)
    ctx = ActorContext(config, client, names)
    # and groups sampled by v0 and v1 (stale: 3 and 2 versions old) and by v2, v3 (fresh)
    stale = [_group(0, [0.0, 1.0]), _group(1, [1.0, 0.0])]
    fresh = [_group(2, [0.0, 1.0]), _group(3, [1.0, 0.0])]
    admitted = [decode(p, Trajectory).episode_id for p in (*stale, *fresh)]
    await client.call(client.sync.sadd, names.admitted_groups, *admitted)  # by the scheduler
    await Producer(client, names).publish(N.TRAJECTORIES, [stale[0], fresh[0], stale[1], fresh[1]])

    # When the learner takes one step (max_steps=4: from version 3 to 4) and stops
    with trio.fail_after(120):
        await serve(ctx)

    # Then only the fresh groups were trained, the stale ones counted, all acknowledged
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.METRICS))
    metrics = decode(fields[b"d"], StepMetrics)
    assert (metrics.step, metrics.groups, metrics.dropped_stale) == (4, 2, 2)
    # with what the loss saw: learning rate, entropy, train-vs-rollout mismatch
    assert metrics.lr == pytest.approx(1e-4) and metrics.entropy > 0
    assert metrics.mismatch_ratio_min <= metrics.mismatch_ratio_mean <= metrics.mismatch_ratio_max
    assert metrics.mismatch_kl >= 0 and metrics.mismatch_ratio_max != 1.0
    assert int(await client.call(client.sync.get, names.counter("dropped_stale"))) == 2
    events = await client.call(client.sync.xrange, names.stream(N.WEIGHTS))
    published = [decode(f[b"d"], WeightsPublished) for _, f in events]
    # the restart re-announces v3 idempotently, then the new step publishes v4
    assert [e.version for e in published] == [3, 4]
    assert Path(published[-1].path) == tmp_path / "weights" / "v000004"
    pending = await client.call(client.sync.xpending, names.stream(N.TRAJECTORIES), "learner")
    assert pending["pending"] == 0
    [line] = (tmp_path / "weights" / LEDGER_FILE).read_text().splitlines()
    record = msgspec.json.decode(line)
    assert record["version"] == 4
    assert sorted(record["episode_ids"]) == sorted(decode(f, Trajectory).episode_id for f in fresh)


async def test_restarted_learner_trains_each_group_exactly_once(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a learner that took step 1 on groups A and B
    first = [_group(0, [0.0, 1.0]), _group(0, [1.0, 0.0])]
    await Producer(client, names).publish(N.TRAJECTORIES, first)
    one_step = _config(tmp_path, redis_url, names.run, ("learner.max_steps=1",))
    with trio.fail_after(120):
        await serve(ActorContext(one_step, client, names))
    weights = tmp_path / "weights"
    assert (weights / "v000001" / TRAINER_STATE_FILE).exists()

    # and Redis then lost the acknowledgement: A and B come again (a crash of Redis within
    # its fsync window re-delivers them with new entry ids), followed by new groups C and D
    second = [_group(0, [0.0, 1.0]), _group(1, [1.0, 0.0])]
    await Producer(client, names).publish(
        N.TRAJECTORIES, [first[1], second[0], first[0], second[1]]
    )

    # When the learner restarts and takes step 2
    two_steps = _config(tmp_path, redis_url, names.run, ("learner.max_steps=2",))
    with trio.fail_after(120):
        await serve(ActorContext(two_steps, client, names))

    # Then step 2 trained exactly C and D, A and B were acknowledged without training
    ledger = Ledger.open(weights, latest=2)
    episodes = [decode(g, Trajectory).episode_id for g in first + second]
    assert [set(r.episode_ids) for r in ledger.records] == [set(episodes[:2]), set(episodes[2:])]
    assert int(await client.call(client.sync.get, names.counter("duplicates_skipped"))) == 2
    metrics = [
        decode(f[b"d"], StepMetrics)
        for _, f in await client.call(client.sync.xrange, names.stream(N.METRICS))
    ]
    assert [(m.step, m.groups) for m in metrics] == [(1, 2), (2, 2)]
    pending = await client.call(client.sync.xpending, names.stream(N.TRAJECTORIES), "learner")
    assert pending["pending"] == 0
    # and the optimiser state moved on with the newest version only
    assert (weights / "v000002" / TRAINER_STATE_FILE).exists()
    assert not (weights / "v000001" / TRAINER_STATE_FILE).exists()


async def test_last_part_filled_step_is_trained_once_nothing_more_can_come(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a run that admitted all of its 3 training groups (max_train_groups) and a learner
    # taking 2 groups per step, and 3 groups reaching it
    config = _config(
        tmp_path, redis_url, names.run, ("scheduler.max_train_groups=3", "learner.max_steps=2")
    )
    await client.call(client.sync.set, names.admitted, 3)
    groups = [_group(0, [0.0, 1.0]), _group(1, [1.0, 0.0]), _group(1, [0.0, 1.0])]
    # and one more sample still on its way upstream (in the executor's stream)
    await Producer(client, names).publish(N.ROLLOUTS, [b"in flight"])
    await client.call(
        client.sync.xgroup_create, names.stream(N.ROLLOUTS), N.GROUP_OF_STREAM[N.ROLLOUTS], "0"
    )
    await Producer(client, names).publish(N.TRAJECTORIES, groups)
    # and the learner connected as its role's ACL user (what it checks must be allowed to it)
    user = Credentials(f"streamrl-{names.run}-learner", secrets.token_hex(16))
    await apply_acls(client, names, {"learner": user})
    learner_client = RedisClient(role_url(client.url.url, user))

    ctx = WatchedContext(config, learner_client, names)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve, ctx)
        # When step 1 took two groups: the third waits while upstream still holds work
        metrics_key = names.stream(N.METRICS)
        await wait_until(
            lambda: client.call(client.sync.xlen, metrics_key), timeout=120, interval=0.1
        )
        await more_calls(ctx, N.TRAJECTORIES, 4)  # empty reads, each with its upstream check
        assert await client.call(client.sync.xlen, metrics_key) == 1
        # and once upstream is drained (an executor took that sample and settled it)
        key, group = names.stream(N.ROLLOUTS), N.GROUP_OF_STREAM[N.ROLLOUTS]
        [(_, [(entry_id, _)])] = await client.call(
            client.sync.xreadgroup, group, "executor-x", {key: ">"}, count=1
        )
        await more_calls(ctx, N.TRAJECTORIES, 4)  # in progress: still not drained
        assert await client.call(client.sync.xlen, metrics_key) == 1
        await client.call(client.sync.xack, key, group, entry_id)
        # Then the learner trains the last group alone, and stops (max_steps=2)

        async def two_steps() -> bool:
            return await client.call(client.sync.xlen, metrics_key) >= 2

        await wait_until(two_steps, timeout=60, interval=0.1)
    metrics = [
        decode(f[b"d"], StepMetrics)
        for _, f in await client.call(client.sync.xrange, metrics_key)
    ]
    assert [(m.step, m.groups) for m in metrics] == [(1, 2), (2, 1)]
    pending = await client.call(client.sync.xpending, names.stream(N.TRAJECTORIES), "learner")
    assert pending["pending"] == 0
    learner_client.close()
    client.sync.execute_command("ACL", "DELUSER", user.user)


async def test_groups_pending_on_the_learner_but_never_received_are_taken_back(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given two groups in the learner's pending list that its process never received (as
    # when Redis restarts while the read that delivered them is on the wire)
    config = _config(tmp_path, redis_url, names.run, ("learner.max_steps=1",))
    key, group = names.stream(N.TRAJECTORIES), N.GROUP_OF_STREAM[N.TRAJECTORIES]
    await client.call(client.sync.xgroup_create, key, group, "0", mkstream=True)
    await Producer(client, names).publish(
        N.TRAJECTORIES, [_group(0, [0.0, 1.0]), _group(0, [1.0, 0.0])]
    )
    [(_, entries)] = await client.call(client.sync.xreadgroup, group, "ghost", {key: ">"})
    ctx = WatchedContext(config, client, names)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, ctx)
        await more_calls(ctx, N.TRAJECTORIES, 2)  # the learner is up, reading: nothing new
        ids = [eid for eid, _ in entries]
        await client.call(client.sync.xclaim, key, group, "learner-0", 0, ids, justid=True)
        # When it is idle, then it takes them back and trains them (max_steps=1: it returns)
        await wait_until(
            lambda: client.call(client.sync.xlen, names.stream(N.METRICS)), timeout=60, interval=0.1
        )
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.METRICS))
    assert decode(fields[b"d"], StepMetrics).groups == 2
    pending = await client.call(client.sync.xpending, key, group)
    assert pending["pending"] == 0


@pytest.mark.system
@pytest.mark.parametrize(("groups_per_step", "good", "trained"), [(1, 2, [1, 1]), (2, 3, [1, 2])])
async def test_a_group_that_fails_the_step_is_dead_lettered_alone_and_the_rest_trained(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path,
    groups_per_step: int, good: int, trained: list[int],
) -> None:  # fmt: skip
    # Given a poisoned group (a token id far outside the vocabulary: the training step raises)
    # ahead of good ones, the next step's groups prefetched while the poisoned step fails
    config = run_config(
        tmp_path, redis_url, names.run, "model.spec=tiny",
        f"learner.groups_per_step={groups_per_step}", "learner.max_steps=2",
        "queues.block_ms=200", "queues.max_deliveries=2", "retry.max_retries=1",
        "retry.backoff_s=0.05",
    )  # fmt: skip
    poison = make_trajectory([1, 2, 3], [[5, 10**7]] * 2, [[-1.0] * 2] * 2, [0.0, 1.0])
    groups = [_group(0, [float(i % 2), float((i + 1) % 2)]) for i in range(good)]
    [poison_id, *_] = await Producer(client, names).publish(
        N.TRAJECTORIES, [encode(poison), *groups]
    )

    # When the learner runs (no restart: the step's failure stays in the process)
    with trio.fail_after(90):
        await serve(ActorContext(config, client, names))

    # Then the step was retried, then each group of it tried alone: only the poisoned one is
    # dead-lettered, with the error, and every good group is trained (the prefetched ones
    # too), v1 and v2; nothing is left pending
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.DEAD))
    letter = decode(fields[b"d"], DeadLetter)
    assert letter.entry_id == poison_id
    assert "failed on it alone" in letter.error and "IndexError" in letter.error
    events = await client.call(client.sync.xrange, names.stream(N.WEIGHTS))
    assert [decode(f[b"d"], WeightsPublished).version for _, f in events] == [1, 2]
    steps = await client.call(client.sync.xrange, names.stream(N.METRICS))
    assert [decode(f[b"d"], StepMetrics).groups for _, f in steps] == trained
    pending = await client.call(client.sync.xpending, names.stream(N.TRAJECTORIES), "learner")
    assert pending["pending"] == 0


async def test_a_group_past_the_delivery_limit_is_dead_lettered_untrained(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a group delivered to the learner 3 times already (its process died each time, as
    # with a group that runs it out of memory), with at most 2 deliveries, and a good group
    config = run_config(
        tmp_path, redis_url, names.run, "model.spec=tiny", "learner.groups_per_step=1",
        "learner.max_steps=1", "queues.block_ms=200", "queues.max_deliveries=2",
    )  # fmt: skip
    key, group = names.stream(N.TRAJECTORIES), N.GROUP_OF_STREAM[N.TRAJECTORIES]
    await client.call(client.sync.xgroup_create, key, group, "0", mkstream=True)
    [killer_id] = await Producer(client, names).publish(N.TRAJECTORIES, [_group(0, [0.0, 1.0])])
    for start in (">", "0", "0"):
        await client.call(client.sync.xreadgroup, group, "learner-0", {key: start})
    await Producer(client, names).publish(N.TRAJECTORIES, [_group(0, [1.0, 0.0])])

    # When the learner starts
    with trio.fail_after(60):
        await serve(ActorContext(config, client, names))

    # Then the group is dead-lettered before it is handled again, and the good one trained
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.DEAD))
    letter = decode(fields[b"d"], DeadLetter)
    assert letter.entry_id == killer_id and "delivered 4 times" in letter.error
    events = await client.call(client.sync.xrange, names.stream(N.WEIGHTS))
    assert [decode(f[b"d"], WeightsPublished).version for _, f in events] == [1]
