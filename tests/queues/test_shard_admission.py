"""Sharded runs on the real 3-node Redis Cluster: the counted admission that crosses slots
(tasks routed into shards, the run-global ``admitted`` counter), the run view of a group's
backlog summed over shards, and the scheduler's ACL user doing the admission for real."""

from __future__ import annotations

import secrets
import uuid

import pytest
import trio

from streamrl.protocol import names as N
from streamrl.protocol.roles import apply_acls
from streamrl.queues import keys as K
from streamrl.queues.acl import Credentials, role_url
from streamrl.queues.client import RedisClient
from streamrl.queues.server import ClusterProcess
from streamrl.queues.shards import (
    finish_counted,
    open_consumer,
    publish_counted_routed,
    reserve_counted,
)
from streamrl.queues.stats import group_state, stream_length
from streamrl.queues.streams import (
    ConsumerSettings,
    Handoff,
    Producer,
    StreamConsumer,
    ensure_group,
)

SHARDS = 3
pytestmark = pytest.mark.on_cluster(shards=3)  # redis_url, names: tests/conftest.py


def _items(n: int, tag: str = "") -> list[tuple[str, bytes]]:
    return [(f"episode-{tag}{i}", f"task-{tag}{i}".encode()) for i in range(n)]


async def _tasks(client: RedisClient, names: N.Names) -> dict[int, list[bytes]]:
    """Payloads of the tasks stream of every shard."""
    out = {}
    for layout in names.layouts():
        rows = await client.call(client.sync.xrange, layout.stream(N.TASKS))
        assert layout.shard is not None
        out[layout.shard] = [f[b"d"] for _, f in rows]
    return out


async def test_counted_admission_routes_into_shards_and_counts_run_wide(
    client: RedisClient, names: N.Names
) -> None:
    # Given a run of 3 shards whose task streams live in 3 different slots
    assert len({K.key_slot(n.stream(N.TASKS)) for n in names.layouts()}) == SHARDS
    items = _items(30)
    # When 30 tasks are admitted against the run-global counter
    added = await publish_counted_routed(client, names, N.TASKS, items, names.admitted, 0)
    # Then each went to its episode's shard, once, and the counter says 30
    assert added == 30
    assert int(await client.call(client.sync.get, names.admitted)) == 30
    tasks = await _tasks(client, names)
    for shard, payloads in tasks.items():
        assert payloads == [p for k, p in items if K.shard_for(k, SHARDS) == shard]
    assert all(tasks.values()), "30 episodes reach every one of 3 shards"
    assert await client.call(client.sync.hlen, names.admissions) == 0
    # and a second scheduler that read the counter before (expected 0) admits nothing
    assert (
        await publish_counted_routed(client, names, N.TASKS, _items(5, "b"), names.admitted, 0) == 0
    )
    assert await stream_length(client, names, N.TASKS) == 30
    assert int(await client.call(client.sync.get, names.admitted)) == 30


async def test_admission_interrupted_after_counting_is_published_once(
    client: RedisClient, names: N.Names
) -> None:
    # Given an admission counted and recorded, and a scheduler that died before publishing
    token = uuid.uuid4().hex
    items = _items(12)
    assert (
        await reserve_counted(client, names, N.TASKS, items, names.admitted, 0, token=token) == 12
    )
    assert await stream_length(client, names, N.TASKS) == 0
    # a replay of the same call (lost reply) is recognised and reserves nothing more,
    assert (
        await reserve_counted(client, names, N.TASKS, items, names.admitted, 0, token=token) == 12
    )
    # another scheduler's call from the same counter value is refused
    assert await reserve_counted(client, names, N.TASKS, _items(3, "x"), names.admitted, 0) == 0
    assert int(await client.call(client.sync.get, names.admitted)) == 12

    # When two restarted schedulers finish the interrupted admissions at the same time
    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(finish_counted, client, names)
    await finish_counted(client, names)  # and once more, later

    # Then every counted task is published exactly once, in its shard, and the record is gone
    tasks = await _tasks(client, names)
    assert sorted(p for ps in tasks.values() for p in ps) == sorted(p for _, p in items)
    for shard, payloads in tasks.items():
        assert sorted(payloads) == sorted(p for k, p in items if K.shard_for(k, SHARDS) == shard)
    assert await client.call(client.sync.hlen, names.admissions) == 0
    # and the next admission starts from the count
    assert (
        await publish_counted_routed(client, names, N.TASKS, _items(4, "n"), names.admitted, 12)
        == 4
    )
    assert await stream_length(client, names, N.TASKS) == 16


async def test_run_view_of_a_group_sums_its_shards(client: RedisClient, names: N.Names) -> None:
    # Given tasks in every shard, one of which a consumer holds without acknowledging
    for layout in names.layouts():
        assert layout.shard is not None
        await Producer(client, layout).publish(N.TASKS, [b"t"] * (layout.shard + 1))  # 1, 2, 3
    one = StreamConsumer(client, names.in_shard(2), N.TASKS, "generator", stage="g")
    await one.ensure_group()
    for layout in names.layouts():
        await ensure_group(client, layout.stream(N.TASKS), "generator")
    [_] = await one.read(1)
    one.close()
    # When the state of the generator group is read for the run and for shard 2
    run = await group_state(client, names, N.TASKS, "generator")
    shard2 = await group_state(client, names.in_shard(2), N.TASKS, "generator")
    # Then the run's is the sum over the shards, the shard's its own
    assert (run.length, run.lag, run.pending, run.backlog) == (6, 5, 1, 6)
    assert (shard2.length, shard2.lag, shard2.pending) == (3, 2, 1)
    # and a consumer of the run view covers every shard, handing off within each
    settings = ConsumerSettings(block_ms=500, reclaim_min_idle_ms=1)
    async with open_consumer(client, names, N.TASKS, stage="g", settings=settings) as c:
        got = []
        with trio.fail_after(20):
            while len(got) < 5:
                got += await c.read(5 - len(got))
        for i, d in enumerate(got):
            out = [(c.names.stream(N.ROLLOUTS), b"r")]
            await c.complete(Handoff(d.entry_id, c.names.dedup("g", str(i)), out))
        [left] = await c.reclaim(5)  # the entry the first consumer left pending
        assert left.entry_id.startswith("2:")
        await c.complete(Handoff(left.entry_id, c.names.dedup("g", "left"), [(out[0][0], b"r")]))
    assert await stream_length(client, names, N.ROLLOUTS) == 6
    assert (await group_state(client, names, N.TASKS, "generator")).backlog == 0
    # one-shard runs keep the plain consumer (and keys) of the default layout
    async with open_consumer(client, N.Names(names.run), N.TASKS, stage="g") as plain:
        assert isinstance(plain, StreamConsumer)
        assert plain.stream == f"streamrl:{{{names.run}}}:s:tasks"


async def test_scheduler_user_admits_across_slots(
    redis_cluster: ClusterProcess, names: N.Names
) -> None:
    # Given the scheduler's ACL user of a 3-shard run on the cluster
    admin = RedisClient(redis_cluster.url)
    creds = Credentials(f"streamrl-{names.run}-scheduler", secrets.token_hex(8))
    try:
        await apply_acls(admin, names, {"scheduler": creds}, shards=SHARDS)
        scheduler = RedisClient(role_url(redis_cluster.url, creds))
        try:
            # When it reserves an admission, dies (nothing published), and a new one finishes
            # it and admits more, reading the generator group's backlog over every shard
            assert (
                await reserve_counted(scheduler, names, N.TASKS, _items(9), names.admitted, 0)
                == 9
            )
            assert await finish_counted(scheduler, names) == 1
            assert (
                await publish_counted_routed(
                    scheduler, names, N.TASKS, _items(3, "b"), names.admitted, 9
                )
                == 3
            )
            backlog = await group_state(scheduler, names, N.TASKS, "generator")
        finally:
            scheduler.close()
        # Then the tasks are all there, and no node refused it anything
        assert backlog.lag == 12
        assert await stream_length(admin, names, N.TASKS) == 12
        for node in redis_cluster.nodes:
            node_client = RedisClient(node.url)
            refused = node_client.sync.acl_log(count=128)
            node_client.close()
            assert [e for e in refused if e["username"] == creds.user] == []
    finally:
        admin.sync.execute_command("ACL", "DELUSER", creds.user)
        admin.close()
