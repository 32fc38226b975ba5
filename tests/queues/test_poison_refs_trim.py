"""Trimming deletes an entry's claim-check blob only when its reference names a blob of the
trimmed stream: a forged reference naming another key (a counter, another stream) does not
make the trim delete that key, nor fail (as the consumer's ACL user, it may not delete it)."""

from __future__ import annotations

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.payloads import REF_PREFIX
from streamrl.queues.streams import ConsumerSettings, Handoff, open_stream_consumer

NO_TRIM_LOOP = ConsumerSettings(trim_interval_s=0, retain_acked=0)


async def test_trim_deletes_no_key_a_forged_reference_names(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient]
) -> None:
    # Given the run's admitted counter, another stream's blob, a blob of tasks, and entries
    # of tasks referencing each of them (written by the scheduler), then one more entry
    blob = names.stream(N.TASKS) + ":blob:own"
    other = names.stream(N.ROLLOUTS) + ":blob:other"
    for key in (names.admitted, other, blob):
        await client.call(client.sync.set, key, b"7")
    scheduler = roles["scheduler"]
    for key in (names.admitted, other, blob):
        await scheduler.call(scheduler.sync.xadd, names.stream(N.TASKS),
                             {b"d": REF_PREFIX + key.encode()})
    await scheduler.call(scheduler.sync.xadd, names.stream(N.TASKS), {b"d": b"last"})

    # When the generator (as its role's user) acknowledges all four and trims the stream
    async with open_stream_consumer(
        roles["generator"], names, N.TASKS, stage="generator", settings=NO_TRIM_LOOP
    ) as c:
        for d in await c.read(10):
            await c.complete(Handoff(d.entry_id, ""))
        deleted = await c.trim()

    # Then the three referencing entries are trimmed, the stream's own blob with them, and
    # the keys outside the stream's blob prefix are untouched
    assert deleted == 3
    assert await client.call(client.sync.get, names.admitted) == b"7"
    assert await client.call(client.sync.get, other) == b"7"
    assert not await client.call(client.sync.exists, blob)
