"""Batched hand-offs (handoff_batch.lua via serve_flusher) against a real Redis: each hand-off of
a batch publishes once and acknowledges its entry, whatever the rest of the batch holds."""

from __future__ import annotations

import secrets

import pytest
import redis
import trio

from streamrl.protocol import names as N
from streamrl.protocol.roles import ROLES, apply_acls
from streamrl.queues.acl import Credentials, role_url
from streamrl.queues.client import RedisClient, encode_command
from streamrl.queues.payloads import PayloadLimits, PayloadTooLarge
from streamrl.queues.streams import (
    ConsumerSettings,
    Delivery,
    Handoff,
    Producer,
    StreamConsumer,
    open_stream_consumer,
)
from streamrl.testing.wait import wait_until
from tests.helpers import entry_idle_ms, pending


async def _payloads(client: RedisClient, key: str) -> list[bytes]:
    return [fields[b"d"] for _, fields in await client.call(client.sync.xrange, key)]


async def _gone(client: RedisClient, key: str) -> bool:
    return not await client.call(client.sync.exists, key)


async def _idle_past(client: RedisClient, c: StreamConsumer, entry_id: str, ms: int) -> bool:
    return await entry_idle_ms(client, c.stream, c.group, entry_id) >= ms


async def test_batch_with_duplicates_publishes_only_new_and_acks_all(
    client: RedisClient, names: N.Names
) -> None:
    # Given logical messages a and c already handed off from earlier entries
    await Producer(client, names).publish(N.TASKS, [b"a", b"c", b"a", b"b", b"c", b"d"])
    out = names.stream(N.ROLLOUTS)

    def handoff(d: Delivery) -> Handoff:
        assert d.payload is not None
        return Handoff(d.entry_id, names.dedup("g", d.payload.decode()), [(out, d.payload)])

    async with open_stream_consumer(client, names, N.TASKS, stage="g") as c:
        ds = await c.read(10)
        await c.complete_many([handoff(d) for d in ds[:2]])
        # When entries a, b, c, d are handed off in one batch
        await c.complete_many([handoff(d) for d in ds[2:]])
        # Then only b and d are published, and every entry is acknowledged
        assert await _payloads(client, out) == [b"a", b"c", b"b", b"d"]
        assert await pending(client, c.stream, c.group) == 0
        assert c.statistics_counts["completed"] == 6


async def test_batch_mixes_no_output_many_outputs_and_repeated_streams(
    client: RedisClient, names: N.Names
) -> None:
    await Producer(client, names).publish(N.TASKS, [b"x", b"y"])
    rollouts, evals = names.stream(N.ROLLOUTS), names.stream(N.EVALS)
    async with open_stream_consumer(client, names, N.TASKS, stage="g") as c:
        x, y = await c.read(10)
        await c.complete_many(
            [
                Handoff(x.entry_id, ""),  # acknowledged only, no dedup key written
                Handoff(y.entry_id, names.dedup("g", "y"), [(rollouts, b"1"), (evals, b"2")]),
            ]
        )
        assert await _payloads(client, rollouts) == [b"1"]
        assert await _payloads(client, evals) == [b"2"]
        assert await pending(client, c.stream, c.group) == 0
        assert await client.call(client.sync.exists, "") == 0


async def test_concurrent_completes_are_split_into_flush_batches(
    client: RedisClient, names: N.Names
) -> None:
    # Given more concurrent hand-offs than one flush may carry
    await Producer(client, names).publish(N.TASKS, [str(i).encode() for i in range(7)])
    out = names.stream(N.ROLLOUTS)
    settings = ConsumerSettings(flush_batch=3)
    async with open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as c:
        ds = await c.read(10)
        # When each is completed from its own task
        async with trio.open_nursery() as nursery:
            for d in ds:
                h = Handoff(d.entry_id, names.dedup("g", d.entry_id), [(out, d.payload or b"")])
                nursery.start_soon(c.complete, h)
        # Then all are published once and acknowledged
        assert sorted(await _payloads(client, out)) == sorted(d.payload for d in ds)
        assert await pending(client, c.stream, c.group) == 0


def test_encoded_commands_are_what_redis_py_sends() -> None:
    # The hand-off script call and the read skip redis-py's packing: same bytes on the wire
    args = ["EVALSHA", "ab" * 20, 2, "streamrl:{r}:s:x", "é", b"\x00\r\n", b"", -5, 0, 1.5, 2**70]
    assert encode_command(args) == b"".join(redis.Connection().pack_command(*args))
    with pytest.raises(TypeError):
        encode_command(["SET", "k", True])  # refused, as redis-py refuses it


async def test_handoff_loads_its_script_again_when_the_server_forgot_it(
    client: RedisClient, names: N.Names
) -> None:
    # Given a consumer that has handed off once, and a server that then lost its scripts
    await Producer(client, names).publish(N.TASKS, [b"a", b"b"])
    out = names.stream(N.ROLLOUTS)
    async with open_stream_consumer(client, names, N.TASKS, stage="g") as c:
        a, b = await c.read(10)
        await c.complete(Handoff(a.entry_id, names.dedup("g", "a"), [(out, b"A")]))
        await client.execute("SCRIPT", "FLUSH")
        # When it hands off again
        await c.complete(Handoff(b.entry_id, names.dedup("g", "b"), [(out, b"B")]))
        # Then the script was loaded again and applied: published once, acknowledged
        assert await _payloads(client, out) == [b"A", b"B"]
        assert await pending(client, c.stream, c.group) == 0


async def test_oversize_output_in_batch_queues_nothing(client: RedisClient, names: N.Names) -> None:
    await Producer(client, names).publish(N.TASKS, [b"ok", b"big"])
    out = names.stream(N.ROLLOUTS)
    limits = PayloadLimits(max_bytes=100, claim_check_bytes=50)
    settings = ConsumerSettings(limits=limits)
    async with open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as c:
        ok, big = await c.read(10)
        with pytest.raises(PayloadTooLarge):
            await c.complete_many(
                [
                    Handoff(ok.entry_id, names.dedup("g", "ok"), [(out, b"fine")]),
                    Handoff(big.entry_id, names.dedup("g", "big"), [(out, b"x" * 101)]),
                ]
            )
        assert await client.call(client.sync.xlen, out) == 0
        assert await pending(client, c.stream, c.group) == 2


async def test_failed_output_leaves_it_pending_and_unmarked(
    client: RedisClient, names: N.Names
) -> None:
    # Given two entries; the output key of the second holds a string (XADD fails there)
    await Producer(client, names).publish(N.TASKS, [b"a", b"b"])
    out, broken = names.stream(N.ROLLOUTS), names.stream(N.EVALS)
    await client.call(client.sync.set, broken, "not a stream")
    with pytest.raises(BaseExceptionGroup) as failed:
        async with open_stream_consumer(client, names, N.TASKS, stage="g", consumer="c1") as c:
            a, b = await c.read(10)
            await c.complete_many(
                [
                    Handoff(a.entry_id, names.dedup("g", "a"), [(out, b"A")]),
                    Handoff(b.entry_id, names.dedup("g", "b"), [(broken, b"B")]),
                ]
            )
    assert failed.group_contains(redis.ResponseError, match="WRONGTYPE")
    # Then the first is published and acknowledged; the second is neither, nor marked done
    assert await _payloads(client, out) == [b"A"]
    await wait_until(  # its dedup key dropped (with a 1 ms expiry)
        lambda: _gone(client, names.dedup("g", "b")), 10, what="the dedup key was not dropped")
    # and once the key is fixed, its redelivery publishes it
    await client.call(client.sync.delete, broken)
    async with open_stream_consumer(client, names, N.TASKS, stage="g", consumer="c1") as c:
        [again] = await c.read(10)
        assert again.entry_id == b.entry_id and again.deliveries == 2
        await c.complete(Handoff(again.entry_id, names.dedup("g", "b"), [(broken, b"B")]))
        assert await _payloads(client, broken) == [b"B"]
        assert await pending(client, c.stream, c.group) == 0


async def test_reclaim_reports_delivery_counts_past_own_entries_in_range(
    client: RedisClient, names: N.Names
) -> None:
    # Given a's entries at both ends of a range holding many entries b is working on
    await Producer(client, names).publish(N.TASKS, [str(i).encode() for i in range(100)])
    settings = ConsumerSettings(reclaim_min_idle_ms=200)
    async with (
        open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as a,
        open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as b,
    ):
        [first] = await a.read(1)
        own = await b.read(98)
        [last] = await a.read(1)
        await wait_until(lambda: _idle_past(client, a, last.entry_id, 200), 10,
                         what="a's entries did not pass min-idle")
        await b.heartbeat([d.entry_id for d in own])
        # When b reclaims the idle ones
        taken = await b.reclaim(100)
        # Then it gets a's two entries, each delivered twice
        assert [(d.entry_id, d.deliveries) for d in taken] == [
            (first.entry_id, 2),
            (last.entry_id, 2),
        ]


async def test_failed_output_drops_dedup_key_within_role_acl(
    client: RedisClient, names: N.Names
) -> None:
    # Given a generator connected as its ACL user (it may SET its dedup keys, not DEL them)
    credentials = {
        r: Credentials(f"streamrl-{names.run}-{r}", secrets.token_hex(16)) for r in ROLES
    }
    await apply_acls(client, names, credentials)
    generator = RedisClient(role_url(client.url.url, credentials["generator"]))
    try:
        await Producer(client, names).publish(N.TASKS, [b"t"])
        rollouts = names.stream(N.ROLLOUTS)
        await client.call(client.sync.set, rollouts, "not a stream")
        # When its hand-off fails at the XADD
        with pytest.raises(BaseExceptionGroup) as failed:
            async with open_stream_consumer(generator, names, N.TASKS, stage="generator") as c:
                [d] = await c.read(1)
                dedup = names.dedup("generator", "t")
                await c.complete(Handoff(d.entry_id, dedup, [(rollouts, b"r")]))
        assert failed.group_contains(redis.ResponseError, match="WRONGTYPE")  # not NOPERM
        # Then its dedup key is gone, so a redelivery will publish
        await wait_until(lambda: _gone(client, names.dedup("generator", "t")), 10,
                         what="the dedup key was not dropped")
    finally:
        generator.close()
        users = [c.user for c in credentials.values()]
        await client.call(client.sync.execute_command, "ACL", "DELUSER", *users)
