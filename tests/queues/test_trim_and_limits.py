"""Trimming never loses needed work; size limits and the claim check (real Redis)."""

from __future__ import annotations

import pytest

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode
from streamrl.queues.payloads import REF_PREFIX, PayloadLimits, PayloadTooLarge
from streamrl.queues.streams import ConsumerSettings, Handoff, Producer, open_stream_consumer
from streamrl.testing.wait import wait_until

NO_TRIM_LOOP = ConsumerSettings(trim_interval_s=0, retain_acked=0)
SMALL = PayloadLimits(max_bytes=1000, claim_check_bytes=100, blob_ttl_s=600)


async def _ids(client: RedisClient, key: str) -> list[str]:
    return [eid.decode() for eid, _ in await client.call(client.sync.xrange, key)]


async def test_trim_deletes_only_acknowledged_entries(client: RedisClient, names: N.Names) -> None:
    # Given 10 entries: 1-4 acknowledged, 5-6 delivered but pending, 7-10 never delivered
    ids = await Producer(client, names).publish(N.TASKS, [b"%d" % i for i in range(10)])
    async with open_stream_consumer(client, names, N.TASKS, stage="g", settings=NO_TRIM_LOOP) as c:
        delivered = await c.read(6)
        for d in delivered[:4]:
            await c.complete(Handoff(d.entry_id, ""))

        # When the stream is trimmed
        deleted = await c.trim()

        # Then only the acknowledged entries are gone
        assert deleted == 4
        assert await _ids(client, c.stream) == ids[4:]
        # and the pending ones are still complete entries (not empty bodies)
        again = await c.reclaim(10) or []
        assert all(d.payload is not None for d in again)

        # When everything is read and acknowledged, only the last delivered entry remains
        for d in delivered[4:] + await c.read(10):
            await c.complete(Handoff(d.entry_id, ""))
        assert await c.trim() == 5
        assert await _ids(client, c.stream) == ids[-1:]


async def test_trim_respects_the_slowest_group_and_retention(
    client: RedisClient, names: N.Names
) -> None:
    ids = await Producer(client, names).publish(N.TASKS, [b"%d" % i for i in range(8)])
    keep3 = ConsumerSettings(trim_interval_s=0, retain_acked=3)
    async with (
        open_stream_consumer(client, names, N.TASKS, stage="g", settings=keep3) as fast,
        open_stream_consumer(
            client, names, N.TASKS, stage="r", group="replayer", settings=keep3
        ) as slow,
    ):
        for d in await fast.read(8):
            await fast.complete(Handoff(d.entry_id, ""))
        # the second group has acknowledged only the first two
        for d in await slow.read(2):
            await slow.complete(Handoff(d.entry_id, ""))
        assert await fast.trim() == 1  # below the slow group's last delivered id
        assert await _ids(client, fast.stream) == ids[1:]
        for d in await slow.read(8):
            await slow.complete(Handoff(d.entry_id, ""))
        assert await fast.trim() == 4  # the newest 3 are retained for replay
        assert await _ids(client, fast.stream) == ids[-3:]


async def test_oversize_message_refused_before_anything_is_written(
    client: RedisClient, names: N.Names
) -> None:
    producer = Producer(client, names, SMALL)
    with pytest.raises(PayloadTooLarge, match=r"1001 bytes .* limit of 1000 bytes"):
        await producer.publish(N.TASKS, [b"ok", b"x" * 1001])
    assert await client.call(client.sync.exists, names.stream(N.TASKS)) == 0

    await producer.publish(N.TASKS, [b"in"])
    settings = ConsumerSettings(trim_interval_s=0, limits=SMALL)
    async with open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as c:
        [d] = await c.read(1)
        out = names.stream(N.ROLLOUTS)
        with pytest.raises(PayloadTooLarge):
            await c.complete(Handoff(d.entry_id, names.dedup("g", "m"), [(out, b"y" * 2000)]))
        # the input is still pending (the caller dead-letters or retries it), nothing published
        assert (await client.call(client.sync.xpending, c.stream, c.group))["pending"] == 1
        assert await client.call(client.sync.exists, out) == 0


async def test_claim_check_roundtrip_and_blob_deleted_with_its_entry(
    client: RedisClient, names: N.Names
) -> None:
    # Given a long payload (over the claim-check threshold) handed on to rollouts
    big = bytes(range(256)) * 2  # 512 bytes > 100
    await Producer(client, names, SMALL).publish(N.TASKS, [big])
    raw = await client.call(client.sync.xrange, names.stream(N.TASKS))
    ref = raw[0][1][b"d"]
    assert ref.startswith(REF_PREFIX)  # the stream holds a reference only
    blob_key = ref[len(REF_PREFIX) :].decode()
    assert 0 < await client.call(client.sync.ttl, blob_key) <= 600

    settings = ConsumerSettings(trim_interval_s=0, retain_acked=0, limits=SMALL)
    async with open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as c:
        [d] = await c.read(1)
        assert d.payload == big
        out = names.stream(N.ROLLOUTS)
        await c.complete(Handoff(d.entry_id, names.dedup("g", "m"), [(out, big[::-1])]))
        # When the acknowledged entry is trimmed, its blob goes with it
        assert await c.trim() == 0  # the last delivered entry stays
        await Producer(client, names, SMALL).publish(N.TASKS, [b"next"])
        [d2] = await c.read(1)
        await c.complete(Handoff(d2.entry_id, ""))
        assert await c.trim() == 1
        assert await client.call(client.sync.exists, blob_key) == 0
    async with open_stream_consumer(client, names, N.ROLLOUTS, stage="x", settings=settings) as c:
        [d] = await c.read(1)
        assert d.payload == big[::-1]


async def test_unusable_entries_carry_a_reason(client: RedisClient, names: N.Names) -> None:
    key = names.stream(N.TASKS)
    await client.call(client.sync.xadd, key, {b"d": b"z" * 1500})  # a foreign oversize write
    gone = f"{key}:blob:gone"
    await client.call(client.sync.xadd, key, {b"d": REF_PREFIX + gone.encode()})  # expired
    await client.call(client.sync.xadd, key, {b"other": b"1"})  # no payload field
    settings = ConsumerSettings(trim_interval_s=0, limits=SMALL)
    async with open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as c:
        oversize, missing, nofield = await c.read(3)
        assert oversize.payload is None and "over the limit of 1000" in (oversize.error or "")
        assert missing.payload is None and f"blob {gone} is missing" in (missing.error or "")
        assert nofield.payload is None and "no payload" in (nofield.error or "")
        await c.dead_letter(oversize, oversize.error or "")
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.DEAD))
    letter = decode(fields[b"d"], DeadLetter)
    assert letter.payload == b"z" * 1500 and "over the limit" in letter.error


async def test_trim_forgets_idle_consumers_without_pending_work(
    client: RedisClient, names: N.Names
) -> None:
    await Producer(client, names).publish(N.TASKS, [b"a", b"b"])
    settings = ConsumerSettings(trim_interval_s=0, forget_consumers_idle_ms=1)
    async with (
        open_stream_consumer(client, names, N.TASKS, stage="g", consumer="gone") as gone,
        open_stream_consumer(client, names, N.TASKS, stage="g", consumer="busy") as busy,
        open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as trimmer,
    ):
        [d] = await gone.read(1)
        await gone.complete(Handoff(d.entry_id, ""))
        await busy.read(1)  # still holds one pending entry

        async def consumers() -> list[dict]:
            return await client.call(client.sync.xinfo_consumers, trimmer.stream, trimmer.group)

        async def gone_idle() -> bool:  # past forget_consumers_idle_ms, by the server's clock
            return any(r["name"] == b"gone" and r["idle"] > 1 for r in await consumers())

        await wait_until(gone_idle, 10, what="the consumer done with its work was not idle")
        await trimmer.trim()
        assert [r["name"] for r in await consumers()] == [b"busy"]
