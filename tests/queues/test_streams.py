"""Queue semantics against a real Redis: ack, hand-off once, reclaim, dead letters."""

from __future__ import annotations

import trio

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode
from streamrl.queues.streams import ConsumerSettings, Handoff, Producer, open_stream_consumer
from streamrl.testing.wait import deadline, wait_until
from tests.helpers import pending


async def test_handoff_publishes_and_acks(client: RedisClient, names: N.Names) -> None:
    # Given one task in the tasks stream
    await Producer(client, names).publish(N.TASKS, [b"hello"])
    async with open_stream_consumer(client, names, N.TASKS, stage="gen") as c:
        # When it is read and handed off to rollouts
        [d] = await c.read(10)
        assert d.payload == b"hello" and d.deliveries == 1
        out = names.stream(N.ROLLOUTS)
        await c.complete(Handoff(d.entry_id, names.dedup("gen", "m1"), [(out, b"world")]))
        # Then the output exists once and nothing is pending
        assert await client.call(client.sync.xlen, out) == 1
        assert await pending(client, c.stream, c.group) == 0


async def test_redelivered_message_publishes_once(client: RedisClient, names: N.Names) -> None:
    await Producer(client, names).publish(N.TASKS, [b"x"])
    settings = ConsumerSettings(reclaim_min_idle_ms=0)
    out = names.stream(N.ROLLOUTS)
    async with (
        open_stream_consumer(client, names, N.TASKS, stage="gen", settings=settings) as a,
        open_stream_consumer(client, names, N.TASKS, stage="gen", settings=settings) as b,
    ):
        [da] = await a.read(1)
        # b steals the entry while a is still (slowly) working on it
        [db] = await b.reclaim(10)
        assert db.entry_id == da.entry_id and db.deliveries == 2
        # both finish: the dedup key lets only the first publish
        await b.complete(Handoff(db.entry_id, names.dedup("gen", "same"), [(out, b"1")]))
        await a.complete(Handoff(da.entry_id, names.dedup("gen", "same"), [(out, b"1")]))
    assert await client.call(client.sync.xlen, out) == 1


async def test_own_pending_drained_first_after_restart(client: RedisClient, names: N.Names) -> None:
    await Producer(client, names).publish(N.TASKS, [b"a", b"b"])
    async with open_stream_consumer(client, names, N.TASKS, stage="g", consumer="c1") as c:
        first = await c.read(1)
    # the consumer "restarts" with the same name: it gets its unacked entry back first
    async with open_stream_consumer(client, names, N.TASKS, stage="g", consumer="c1") as c:
        again = await c.read(5)
        assert [d.entry_id for d in again] == [first[0].entry_id]
        assert again[0].deliveries == 2
        new = await c.read(5)
        assert [d.payload for d in new] == [b"b"]


async def test_dead_letter_keeps_payload_and_reason(client: RedisClient, names: N.Names) -> None:
    await Producer(client, names).publish(N.TASKS, [b"\xff\x00junk"])
    async with open_stream_consumer(client, names, N.TASKS, stage="g") as c:
        [d] = await c.read(1)
        await c.dead_letter(d, "cannot decode")
        assert await pending(client, c.stream, c.group) == 0
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.DEAD))
    letter = decode(fields[b"d"], DeadLetter)
    assert letter.payload == b"\xff\x00junk" and letter.error == "cannot decode"
    assert letter.stream == N.TASKS


async def test_blocking_read_cancels_promptly(client: RedisClient, names: N.Names) -> None:
    settings = ConsumerSettings(block_ms=30_000)
    async with open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as c:
        # When the read is cancelled after 0.3 s, then it returns then, not after block_ms
        with deadline(10, "a cancelled blocking read did not return"), trio.move_on_after(0.3):
            await c.read(1)


async def test_heartbeat_keeps_entry_from_reclaim(client: RedisClient, names: N.Names) -> None:
    await Producer(client, names).publish(N.TASKS, [b"long"])
    settings = ConsumerSettings(reclaim_min_idle_ms=300)
    async with (
        open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as a,
        open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as b,
    ):
        [d] = await a.read(1)
        for _ in range(4):
            await trio.sleep(0.15)
            await a.heartbeat([d.entry_id])
        assert await b.reclaim(10) == []
        # and once the heart-beats stop, it is taken over after min-idle
        taken = await wait_until(lambda: b.reclaim(10), 10, what="the idle entry not reclaimed")
        assert [x.entry_id for x in taken] == [d.entry_id]
