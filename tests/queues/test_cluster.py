"""The queue layer on a real 3-node Redis Cluster (the session's ``redis_cluster`` fixture).

Every test of the queue modules in ``RERUN`` (hand-off, batches, dead letters, reclaim,
heartbeat, blocking reads, trimming, claim check, a SIGKILLed consumer) runs here a second
time, unchanged, against the cluster: this module's ``redis_url`` is the cluster's
``redis+cluster://`` URL, so their ``client`` is a cluster client. The tests below add what
only a cluster shows: the keys of one hand-off in one slot, blocking reads on the node
owning the stream (also after the slot moved), shards on different nodes, hand-offs that
cross slots, a node restart, and the whole pipeline (``streamrl up``) on the cluster.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
import trio

from streamrl.protocol import names as N
from streamrl.queues import keys as K
from streamrl.queues.client import RedisClient
from streamrl.queues.server import ClusterProcess
from streamrl.queues.shards import open_sharded_consumer, publish_routed, unqualify
from streamrl.queues.streams import (
    ConsumerSettings,
    EventReader,
    Handoff,
    Producer,
    open_stream_consumer,
)
from streamrl.testing.wait import deadline
from tests.helpers import pending
from tests.queues import test_crash, test_handoff_batch, test_streams, test_trim_and_limits
from tests.up_run import run_up

RERUN = (test_streams, test_handoff_batch, test_trim_and_limits, test_crash)
for _module in RERUN:
    for _name, _test in vars(_module).items():
        if _name.startswith("test_") and callable(_test):
            assert _name not in globals(), f"{_name} collected twice"
            globals()[_name] = _test



pytestmark = pytest.mark.on_cluster  # redis_url: the cluster's (tests/conftest.py)


def _port(client: RedisClient, key: str) -> int:
    """The port of the primary owning ``key``'s slot."""
    assert client.cluster is not None
    return int(client.cluster.get_node_from_key(key).port)


def _run_where(client: RedisClient, ok: Callable[[N.Names], bool]) -> N.Names:
    """A fresh run name whose layout satisfies ``ok(names)`` (slots are fixed by the name)."""
    for _ in range(1000):
        names = N.Names(f"t{uuid.uuid4().hex[:10]}")
        if ok(names):
            return names
    raise AssertionError("no run name found")


def test_keys_of_one_handoff_share_a_slot(redis_cluster: ClusterProcess) -> None:
    r = redis.Redis(port=redis_cluster.nodes[0].port, password=redis_cluster.password)

    def slot(key: str) -> int:
        return int(r.execute_command("CLUSTER", "KEYSLOT", key))

    for names in (N.Names("r1"), N.Names("r1", shard=0), N.Names("r1", shard=7)):
        # a hand-off of every stage: input, dedup key, outputs, dead letters, blobs
        for stream in N.WORK_STREAMS:
            keys = [
                names.stream(stream),
                names.dedup("stage", "message-id"),
                names.stream(N.ROLLOUTS),
                names.stream(N.TRAJECTORIES),
                names.stream(N.EVALS),
                names.stream(N.DEAD),
                names.stream(stream) + ":blob:0123",
                names.counter("dropped_stale"),  # counters: written by the hand-off
            ]
            assert {slot(k) for k in keys} == {slot(names.stream(N.TASKS))}
            assert {K.key_slot(k) for k in keys} == {slot(names.stream(N.TASKS))}
        # run-global keys stay in the run's slot whatever the shard
        run_slot = slot(N.Names("r1").stream(N.TASKS))
        for key in (
            names.stream(N.WEIGHTS),
            names.stream(N.METRICS),
            names.policy_version,
            names.admitted,
            names.eval_round,
            names.stop,
            names.in_shard(None).dedup("learner", "step-1"),
        ):
            assert slot(key) == run_slot
    # the default layout is today's: one slot for everything
    assert N.Names("r1").stream(N.TASKS) == "streamrl:{r1}:s:tasks"
    # shards have their own slots
    assert len({slot(N.Names("r1", shard=k).stream(N.TASKS)) for k in range(8)}) == 8
    r.close()


async def test_blocking_read_on_another_node_cancels_promptly(
    client: RedisClient, redis_cluster: ClusterProcess
) -> None:
    # Given a stream owned by a node other than the first seed (which a plain client uses)
    seed = redis_cluster.nodes[0].port
    names = _run_where(client, lambda n: _port(client, n.stream(N.TASKS)) != seed)
    settings = ConsumerSettings(block_ms=30_000)
    async with open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as c:
        assert c._blocking.sync.connection_pool.connection_kwargs["port"] == _port(client, c.stream)
        # When a 30 s blocking read is cancelled after 0.3 s, then it returns then (CLIENT
        # UNBLOCK went to the node it blocks on), not after block_ms
        with deadline(10, "a cancelled blocking read did not return"), trio.move_on_after(0.3):
            await c.read(1)
        # and the connection still works: a new entry is read
        await Producer(client, names).publish(N.TASKS, [b"after"])
        [d] = await c.read(1)
        assert d.payload == b"after"


async def test_event_reader_on_cluster(client: RedisClient, names: N.Names) -> None:
    reader = EventReader(client, names, N.WEIGHTS, block_ms=10_000)
    try:
        assert await reader.latest() is None

        async def publish_later() -> None:
            await trio.sleep(0.2)
            await Producer(client, names).publish(N.WEIGHTS, [b"v1", b"v2"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish_later)
            with deadline(5, "the reader (block_ms 10 s) did not wake up on the event"):
                got = await reader.read()
        while len(got) < 2:
            got += await reader.read()  # continues from its offset
        assert [p for _, p in got] == [b"v1", b"v2"]
        assert (await reader.latest() or ("", b""))[1] == b"v2"
    finally:
        reader.close()


async def test_blocking_read_follows_a_moved_slot(
    client: RedisClient, redis_cluster: ClusterProcess
) -> None:
    # Given an event reader blocking on an (empty) stream's node, in a slot no other test's
    # run has keys in (a slot holding keys cannot be given to another node without them)
    def empty_slot(n: N.Names) -> bool:
        key = n.stream(N.WEIGHTS)
        owner = redis.Redis(port=_port(client, key), password=redis_cluster.password)
        try:
            return int(owner.execute_command("CLUSTER", "COUNTKEYSINSLOT", K.key_slot(key))) == 0
        finally:
            owner.close()

    names = _run_where(client, empty_slot)
    key = names.stream(N.WEIGHTS)
    reader = EventReader(client, names, N.WEIGHTS, block_ms=5000)
    try:
        # When the slot moves to another node (as after resharding or a failover)
        slot = K.key_slot(key)
        nodes = {
            n.port: redis.Redis(port=n.port, password=redis_cluster.password)
            for n in redis_cluster.nodes
        }
        ids = {port: r.execute_command("CLUSTER", "MYID").decode() for port, r in nodes.items()}
        source = _port(client, key)
        target = next(p for p in nodes if p != source)
        nodes[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[source])
        nodes[source].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
        for port in (target, source, *(p for p in nodes if p not in (source, target))):
            nodes[port].execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[target])

        async def publish_later() -> None:
            await trio.sleep(0.3)
            await Producer(client, names).publish(N.WEIGHTS, [b"moved"])

        # Then the blocking read follows the MOVED answer to the new owner and gets the event
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publish_later)
            got = await reader.read()
        assert [p for _, p in got] == [b"moved"]
        assert reader._blocking.sync.connection_pool.connection_kwargs["port"] == target
        for r in nodes.values():
            r.close()
    finally:
        reader.close()


async def test_shards_on_different_nodes_hand_off_within_each(client: RedisClient) -> None:
    # Given a run whose two shards live on different nodes
    names = _run_where(
        client,
        lambda n: (
            _port(client, n.in_shard(0).stream(N.TASKS))
            != _port(client, n.in_shard(1).stream(N.TASKS))
        ),
    )
    # and tasks routed to the shards by domain (stable hash)
    domains = [f"domain-{i}" for i in range(12)]
    items = [(d, d.encode()) for d in domains]
    ids = await publish_routed(client, names, N.TASKS, items, shards=2)
    by_shard = {k: [d for d in domains if K.shard_for(d, 2) == k] for k in (0, 1)}
    assert by_shard[0] and by_shard[1]
    assert [unqualify(i)[0] for i in ids] == [K.shard_for(d, 2) for d in domains]

    # When one consumer covering both shards hands every task off to rollouts, naming its
    # outputs and dedup keys with the unsharded names (as the actor runtime does)
    async with open_sharded_consumer(
        client, names, N.TASKS, range(2), stage="gen", settings=ConsumerSettings(block_ms=5000)
    ) as c:
        seen: list[bytes] = []
        with trio.fail_after(20):
            while len(seen) < len(items):
                for d in await c.read(5):
                    assert d.payload is not None
                    seen.append(d.payload)
                    out = c.names.stream(N.ROLLOUTS)
                    await c.complete(
                        Handoff(
                            d.entry_id, c.names.dedup("gen", d.payload.decode()), [(out, d.payload)]
                        )
                    )
        assert sorted(seen) == sorted(p for _, p in items)

    # Then each task's rollout is in its own shard, next to its input, and nothing is pending
    for k in (0, 1):
        shard = names.in_shard(k)
        rollouts = await client.call(client.sync.xrange, shard.stream(N.ROLLOUTS))
        assert sorted(f[b"d"].decode() for _, f in rollouts) == sorted(by_shard[k])
        assert await client.call(client.sync.exists, shard.dedup("gen", by_shard[k][0])) == 1
        assert await pending(client, shard.stream(N.TASKS), "generator") == 0
    assert await client.call(client.sync.exists, names.stream(N.ROLLOUTS)) == 0


async def test_sharded_read_never_returns_more_than_asked_and_loses_nothing(
    client: RedisClient, names: N.Names
) -> None:
    # Given entries waiting in both shards
    for k in (0, 1):
        await Producer(client, names.in_shard(k)).publish(
            N.TASKS, [f"{k}-{i}".encode() for i in range(3)]
        )
    async with open_sharded_consumer(client, names, N.TASKS, (0, 1), stage="g") as c:
        # When read one at a time
        got = []
        for _ in range(6):
            batch = await c.read(1)
            assert len(batch) == 1
            got += batch
        # Then every entry came back exactly once, none stuck in a pending list unreturned
        assert sorted(d.payload for d in got) == sorted(
            f"{k}-{i}".encode() for k in (0, 1) for i in range(3)
        )
        with trio.move_on_after(1):
            assert await c.read(5) == []
        for d in got:
            await c.complete(Handoff(d.entry_id, ""))
    for k in (0, 1):
        assert await pending(client, names.in_shard(k).stream(N.TASKS), "generator") == 0


async def test_cross_slot_handoff_is_two_idempotent_steps(client: RedisClient) -> None:
    # Given trajectories in two shards on different nodes, and a learner-style step that
    # acknowledges groups of both and announces run-global weights and metrics
    def three_nodes(n: N.Names) -> bool:
        keys = [n.in_shard(0).stream(N.TASKS), n.in_shard(1).stream(N.TASKS), n.prefix]
        return len({_port(client, k) for k in keys}) == 3

    names = _run_where(client, three_nodes)
    for k in (0, 1):
        await Producer(client, names.in_shard(k)).publish(N.TRAJECTORIES, [f"g{k}".encode()])
    outputs = [(names.stream(N.WEIGHTS), b"v1"), (names.stream(N.METRICS), b"m1")]
    dedup = names.dedup("learner", "step-1")
    async with open_sharded_consumer(client, names, N.TRAJECTORIES, (0, 1), stage="learner") as c:
        got = []
        while len(got) < 2:
            got += await c.read(2)
        # A single-shard consumer cannot do this in one script on a cluster
        single = c.consumers[0]
        with pytest.raises(redis.exceptions.RedisClusterException):
            await single.ack_many([unqualify(got[0].entry_id)[1]], dedup, outputs)
        # When the step is announced, and announced again (a restarted learner)
        await c.ack_many([d.entry_id for d in got], dedup, outputs)
        await c.ack_many([d.entry_id for d in got], dedup, outputs)
    # Then the events went out once and both groups are acknowledged
    assert await client.call(client.sync.xlen, names.stream(N.WEIGHTS)) == 1
    assert await client.call(client.sync.xlen, names.stream(N.METRICS)) == 1
    for k in (0, 1):
        assert await pending(client, names.in_shard(k).stream(N.TRAJECTORIES), "learner") == 0
    # and publish_once refuses keys of different slots outright (also on a single server)
    with pytest.raises(ValueError, match="one hash slot"):
        await Producer(client, names).publish_once(
            names.in_shard(0).dedup("x", "y"), [(N.WEIGHTS, b"v")]
        )


async def test_node_restart_keeps_queued_work_and_scripts_reload(
    client: RedisClient, names: N.Names, redis_cluster: ClusterProcess
) -> None:
    # Given an entry read but not acknowledged, on some node
    await Producer(client, names).publish(N.TASKS, [b"a", b"b"])
    async with open_stream_consumer(client, names, N.TASKS, stage="g", consumer="c1") as c:
        [first] = await c.read(1)
        await c.complete(
            Handoff(first.entry_id, names.dedup("g", "a"), [(names.stream("out"), b"A")])
        )
    node = next(n for n in redis_cluster.nodes if n.port == _port(client, names.stream(N.TASKS)))
    # When that node is restarted (AOF reloaded, script cache empty)
    await trio.to_thread.run_sync(node.stop)
    await trio.to_thread.run_sync(node.start)
    await trio.to_thread.run_sync(redis_cluster.wait_ok)
    # Then the stream, its group and the pending entry are back, and the hand-off script
    # (reloaded on NOSCRIPT) still works
    async with open_stream_consumer(client, names, N.TASKS, stage="g", consumer="c1") as c:
        [again] = await c.read(5)
        assert again.payload == b"b"
        await c.complete(
            Handoff(again.entry_id, names.dedup("g", "b"), [(names.stream("out"), b"B")])
        )
    assert await client.call(client.sync.xlen, names.stream("out")) == 2
    assert await pending(client, names.stream(N.TASKS), "generator") == 0


@pytest.mark.system
def test_pipeline_end_to_end_on_cluster(redis_cluster: ClusterProcess, tmp_path: Path) -> None:
    # Given the whole pipeline (real actor processes, tiny model) pointed at the cluster
    # When: two learner steps, then the final evaluation
    done = run_up(redis_cluster.url, tmp_path, {"learner.max_steps": "2"}, prefix="e2ec",
                  max_minutes=6, timeout_s=600)
    run, summary = done.run, done.summary
    # Then it completed: two policy versions, both evaluations, no dead letters
    assert summary["steps"] >= 2 and summary["policy_version"] >= 2
    assert summary["eval_reward_before"] is not None and summary["eval_reward_after"] is not None
    assert summary["dead_letters"] == 0
    client = RedisClient(redis_cluster.url)
    try:
        names = N.Names(run)
        assert client.sync.xlen(names.stream(N.WEIGHTS)) >= 2
        for stream in (N.TASKS, N.ROLLOUTS, N.EXECUTED, N.EVALS):
            key = names.stream(stream)
            assert client.sync.xpending(key, N.GROUP_OF_STREAM[stream])["pending"] == 0
    finally:
        client.close()
