"""Producer.publish_counted: entries and their count move together, compare-and-set."""

from __future__ import annotations

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.streams import Producer


async def test_publishes_and_counts_only_from_the_expected_count(
    client: RedisClient, names: N.Names
) -> None:
    producer = Producer(client, names)
    counter = names.admitted
    # Given nothing admitted yet: the counter is missing, which reads as 0
    assert await producer.publish_counted(N.TASKS, [b"a", b"b"], counter, 0) == 2
    # When the same call is replayed (its reply was lost) or another producer raced it
    assert await producer.publish_counted(N.TASKS, [b"a", b"b"], counter, 0) == 0
    # Then nothing more was added; a call from the current count goes through
    assert await producer.publish_counted(N.TASKS, [b"c"], counter, 2) == 1
    rows = await client.call(client.sync.xrange, names.stream(N.TASKS))
    assert [f[b"d"] for _, f in rows] == [b"a", b"b", b"c"]
    assert int(await client.call(client.sync.get, counter)) == 3
