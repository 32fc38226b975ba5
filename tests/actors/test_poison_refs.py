"""A poison claim-check reference (one naming a key of another type, a key the consuming role
may not read, a key outside its stream's blob prefix, a blob that is gone) is dead-lettered
once with the reason, within the delivery limit, by every consumer of every input stream;
the consumer keeps running and still handles valid traffic. An entry past the delivery
limit is dead-lettered before its payload is fetched. Real Redis, every side connected as
its role's ACL user."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import trio

from streamrl.actors.archiver import serve_stream
from streamrl.actors.learner import serve as serve_learner
from streamrl.actors.monitor import Monitor
from streamrl.config.schema import Config
from streamrl.protocol import names as N
from streamrl.protocol.messages import Rollout, StepMetrics
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode, encode
from streamrl.queues.operations import increment
from streamrl.queues.payloads import REF_PREFIX
from streamrl.runtime.context import ActorContext
from streamrl.runtime.serve import Output, serve_actor
from streamrl.testing.wait import wait_until
from tests.actors.helpers import ONE_TINY_STEP, group
from tests.chaos.badinputs import INPUT_TYPES, VALID, _eval_trajectory
from tests.helpers import open_roles, run_config

MAX_DELIVERIES = 3
FAST = (
    f"queues.max_deliveries={MAX_DELIVERIES}",
    "queues.block_ms=100",
    "queues.reclaim_interval_s=0.1",
    "queues.reclaim_min_idle_ms=200",
    "queues.heartbeat_interval_s=0.1",
    "retry.max_retries=0",
)
WRITER = {  # the role that adds to each input stream
    N.TASKS: "scheduler",
    N.ROLLOUTS: "generator",
    N.EXECUTED: "executor",
    N.TRAJECTORIES: "verifier",
    N.EVALS: "verifier",
}
READER = {N.TASKS: "generator", N.ROLLOUTS: "executor", N.EXECUTED: "verifier"}


def _poisons(names: N.Names, stream: str) -> dict[str, tuple[bytes, str]]:
    """kind -> (payload, pattern the dead letter's reason must contain)."""
    key = names.stream(stream)
    return {
        "a counter the reader may not read": (
            REF_PREFIX + names.admitted.encode(), "not a blob of"
        ),
        "the dead-letter stream": (
            REF_PREFIX + names.stream(N.DEAD).encode(), "not a blob of"
        ),
        "another stream's blob": (
            REF_PREFIX + (names.stream(N.METRICS) + ":blob:x").encode(), "not a blob of"
        ),
        "a blob of the wrong type": (
            REF_PREFIX + f"{key}:blob:wrongtype".encode(), "WRONGTYPE"
        ),
        "a blob that is gone": (REF_PREFIX + f"{key}:blob:gone".encode(), "missing"),
    }


async def _plant(
    admin: RedisClient, writer: RedisClient, names: N.Names, stream: str
) -> dict[str, tuple[str, str]]:
    """Write the poison references as ``writer`` (the stream's producing role); returns
    entry id -> (kind, expected reason)."""
    await admin.call(admin.sync.hset, f"{names.stream(stream)}:blob:wrongtype", "f", "v")
    planted = {}
    for kind, (payload, reason) in _poisons(names, stream).items():
        eid = await writer.call(writer.sync.xadd, names.stream(stream), {b"d": payload})
        planted[eid.decode()] = (kind, reason)
    return planted


async def _letters(client: RedisClient, names: N.Names) -> list[DeadLetter]:
    rows = await client.call(client.sync.xrange, names.stream(N.DEAD))
    return [decode(f[b"d"], DeadLetter) for _, f in rows]


def _check_letters(
    letters: list[DeadLetter], planted: dict[str, tuple[str, str]], stream: str
) -> None:
    """Every planted entry dead-lettered once, with its reason, within the delivery limit."""
    got = {x.entry_id: x for x in letters if x.stream == stream}
    assert sorted(got) == sorted(planted), [x.error for x in letters]
    assert len([x for x in letters if x.stream == stream]) == len(planted)
    for eid, (kind, reason) in planted.items():
        assert reason in got[eid].error, (kind, got[eid].error)
        assert got[eid].deliveries <= MAX_DELIVERIES, (kind, got[eid].deliveries)


class Accepting:
    """A stage that handles every valid input (publishing nothing), counting them."""

    def __init__(self, stream: str) -> None:
        self.stage = READER.get(stream, "stage")
        self.input_stream = stream
        self.input_type = INPUT_TYPES[stream]
        self.handled = 0

    async def handle(self, message: Any) -> list[Output]:
        self.handled += 1
        return []


def _config(tmp_path: Path, redis_url: str, run: str, *more: str) -> Config:
    return run_config(tmp_path, redis_url, run, *FAST, *more)


@pytest.mark.parametrize("stream", [N.TASKS, N.ROLLOUTS, N.EXECUTED])
async def test_poison_references_are_dead_lettered_by_the_runtime(
    stream: str, client: RedisClient, names: N.Names, roles: dict[str, RedisClient],
    redis_url: str, tmp_path: Path,
) -> None:
    # Given poison references written by the stream's producer, then a valid entry
    planted = await _plant(client, roles[WRITER[stream]], names, stream)
    valid = encode(VALID[stream]())
    await roles[WRITER[stream]].call(roles[WRITER[stream]].sync.xadd, names.stream(stream),
                                     {b"d": valid})
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), roles[READER[stream]], names)
    actor = Accepting(stream)

    # When the stage's runtime (as its role's user) serves the stream
    async with ctx.consumer(stream, actor.stage) as consumer, trio.open_nursery() as nursery:
        await nursery.start(
            serve_actor, consumer, actor, ctx.policies(10), ctx.runtime_settings(2, stream)
        )
        await wait_until(lambda: _done(client, names, planted, actor), timeout=30)
        nursery.cancel_scope.cancel()

    # Then each poison entry is dead-lettered once with the reason, the valid one handled
    _check_letters(await _letters(client, names), planted, stream)
    assert actor.handled == 1


async def _done(
    client: RedisClient, names: N.Names, planted: dict[str, Any], actor: Accepting
) -> bool:
    return actor.handled >= 1 and len(await _letters(client, names)) >= len(planted)


async def test_poison_references_are_dead_lettered_by_a_sharded_consumer(
    client: RedisClient, redis_url: str, tmp_path: Path,
) -> None:
    # Given a run of 2 shards, its role users, and poison references in both shards' tasks
    names = N.Names(run=f"t{uuid.uuid4().hex[:10]}", shards=2)
    async with open_roles(client, names) as roles:
        planted: dict[int, dict[str, tuple[str, str]]] = {}
        for shard in range(2):
            local = names.in_shard(shard)
            planted[shard] = await _plant(client, roles["scheduler"], local, N.TASKS)
            await roles["scheduler"].call(
                roles["scheduler"].sync.xadd, local.stream(N.TASKS),
                {b"d": encode(VALID[N.TASKS]())},
            )
        config = _config(tmp_path, redis_url, names.run, "queues.shards=2")
        ctx = ActorContext(config, roles["generator"], names)
        actor = Accepting(N.TASKS)
        total = sum(len(p) for p in planted.values())

        async def done() -> bool:
            letters = 0
            for shard in range(2):
                key = names.in_shard(shard).stream(N.DEAD)
                letters += await client.call(client.sync.xlen, key)
            return actor.handled >= 2 and letters >= total

        # When the generator's runtime serves both shards
        async with ctx.consumer(N.TASKS, "generator") as consumer, trio.open_nursery() as n:
            await n.start(
                serve_actor, consumer, actor, ctx.policies(10), ctx.runtime_settings(2, N.TASKS)
            )
            await wait_until(done, timeout=30)
            n.cancel_scope.cancel()

        # Then each shard dead-lettered its poison entries once, and both valid ones passed
        for shard in range(2):
            _check_letters(await _letters(client, names.in_shard(shard)), planted[shard],
                           N.TASKS)
        assert actor.handled == 2


async def test_poison_references_are_dead_lettered_by_the_learner(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given poison references in trajectories, then two trainable groups
    planted = await _plant(client, roles["verifier"], names, N.TRAJECTORIES)
    for g in (group([0.0, 1.0]), group([1.0, 0.0])):
        await roles["verifier"].call(roles["verifier"].sync.xadd, names.stream(N.TRAJECTORIES),
                                     {b"d": encode(g)})
    config = _config(tmp_path, redis_url, names.run, *ONE_TINY_STEP)
    ctx = ActorContext(config, roles["learner"], names)

    # When the learner (as its role's user) takes its one step
    with trio.fail_after(120):
        await serve_learner(ctx)

    # Then it trained the two groups and dead-lettered every poison entry with its reason
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.METRICS))
    assert decode(fields[b"d"], StepMetrics).groups == 2
    _check_letters(await _letters(client, names), planted, N.TRAJECTORIES)


async def test_poison_references_are_dead_lettered_by_the_monitor(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given poison references in evals, then one evaluation result of the round the run opened
    await increment(client, names.eval_round)
    planted = await _plant(client, roles["verifier"], names, N.EVALS)
    await roles["verifier"].call(roles["verifier"].sync.xadd, names.stream(N.EVALS),
                                 {b"d": encode(_eval_trajectory())})
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), roles["monitor"], names)
    monitor = Monitor(ctx, tmp_path, eval_items=2)

    # When the monitor (as its role's user) reads them
    async with trio.open_nursery() as nursery:
        await nursery.start(monitor.serve)
        with trio.fail_after(30):
            await monitor.wait_round(0)
        await wait_until(lambda: _letter_count(client, names, len(planted)), timeout=30)
        nursery.cancel_scope.cancel()

    # Then it recorded the result and dead-lettered every poison entry with its reason
    assert monitor.rounds[0].rewards == [1.0, 1.0]
    _check_letters(await _letters(client, names), planted, N.EVALS)


async def _letter_count(client: RedisClient, names: N.Names, n: int) -> bool:
    return int(await client.call(client.sync.xlen, names.stream(N.DEAD))) >= n


@pytest.mark.parametrize("stream", [N.TRAJECTORIES, N.EVALS])
async def test_poison_references_do_not_stop_the_archiver(
    stream: str, client: RedisClient, names: N.Names, roles: dict[str, RedisClient],
    redis_url: str, tmp_path: Path,
) -> None:
    # Given poison references in the stream, then a valid trajectory
    await _plant(client, roles["verifier"], names, stream)
    valid = encode(VALID[stream]())
    await roles["verifier"].call(roles["verifier"].sync.xadd, names.stream(stream), {b"d": valid})
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), roles["archiver"], names)
    root = tmp_path / "archive"

    # When the archiver (as its role's user) serves the stream
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_stream, ctx, stream, root, 16)

        async def settled() -> bool:
            state = await client.call(client.sync.xpending, names.stream(stream), "archiver")
            return bool(list(root.rglob("*.parquet"))) and state["pending"] == 0

        await wait_until(settled, timeout=30)
        nursery.cancel_scope.cancel()

    # Then it archived the valid trajectory and acknowledged everything (the consuming stage
    # dead-letters the others)
    import pyarrow.parquet as pq

    [path] = list(root.rglob("*.parquet"))
    assert pq.read_table(path).column("payload").to_pylist() == [valid]


# ---------------------------------------------------------------------- the delivery limit


async def _delivered(
    client: RedisClient, names: N.Names, stream: str, payload: bytes, consumer: str, times: int
) -> str:
    """An entry of ``payload`` pending on ``consumer``, delivered ``times`` times already."""
    key, group_name = names.stream(stream), N.GROUP_OF_STREAM[stream]
    await client.call(client.sync.xgroup_create, key, group_name, id="0", mkstream=True)
    eid = (await client.call(client.sync.xadd, key, {b"d": payload})).decode()
    await client.call(client.sync.xreadgroup, group_name, consumer, {key: ">"})
    for _ in range(times - 1):
        await client.call(client.sync.xclaim, key, group_name, consumer, 0, [eid])
    return eid


async def test_an_entry_past_the_delivery_limit_is_dead_lettered_before_its_blob_is_read(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a rollout behind a claim check whose handler's process died every time: its
    # entry was delivered MAX_DELIVERIES times, and its blob became unreadable meanwhile
    # (a hash: fetching it would fail with WRONGTYPE)
    key = names.stream(N.ROLLOUTS)
    blob = f"{key}:blob:poison"
    await client.call(client.sync.hset, blob, "f", "v")
    ref = REF_PREFIX + blob.encode()
    ctx = ActorContext(_config(tmp_path, redis_url, names.run), roles["executor"], names)
    actor = Accepting(N.ROLLOUTS)
    assert actor.input_type is Rollout
    eid = await _delivered(client, names, N.ROLLOUTS, ref, "executor-0", MAX_DELIVERIES)

    # When the executor restarts under the same name (it reads its own pending list first)
    async with (
        ctx.consumer(N.ROLLOUTS, "executor", consumer="executor-0") as consumer,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(
            serve_actor, consumer, actor, ctx.policies(10), ctx.runtime_settings(2, N.ROLLOUTS)
        )
        await wait_until(lambda: _letter_count(client, names, 1), timeout=30)
        nursery.cancel_scope.cancel()

    # Then the entry is dead-lettered for its deliveries, before its blob was fetched (the
    # letter holds the reference, the reason is not the blob's type)
    [letter] = await _letters(client, names)
    assert letter.entry_id == eid
    assert letter.deliveries == MAX_DELIVERIES + 1
    assert f"delivered {MAX_DELIVERIES + 1} times" in letter.error, letter.error
    assert letter.payload == ref
    assert actor.handled == 0
