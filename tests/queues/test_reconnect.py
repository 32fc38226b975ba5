"""Redis going away for a moment (a restart) is ridden out: calls are retried with backoff
until it is back, and raised only after the reconnect timeout."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import trio

from streamrl.protocol import names as N
from streamrl.queues.client import Reconnect, RedisClient
from streamrl.queues.server import ServerProcess
from streamrl.queues.streams import (
    ConsumerSettings,
    EventReader,
    Handoff,
    Producer,
    open_stream_consumer,
)


@pytest.fixture
def dedicated(tmp_path: Path) -> Iterator[tuple[ServerProcess, RedisClient]]:
    """A Redis of this test's own (AOF), to stop and start, and a client that waits for it."""
    server = ServerProcess(data_dir=tmp_path / "redis").start()
    client = RedisClient(server.url, reconnect=Reconnect(timeout_s=30))
    yield server, client
    client.close()
    server.stop()


async def _restart_after(server: ServerProcess, delay_s: float) -> None:
    await trio.sleep(delay_s)
    await trio.to_thread.run_sync(server.start)


async def test_a_call_made_while_redis_restarts_waits_for_it(
    dedicated: tuple[ServerProcess, RedisClient], names: N.Names
) -> None:
    # Given a dedicated Redis (AOF) holding one entry, and then stopped
    server, client = dedicated
    await Producer(client, names).publish(N.TASKS, [b"before"])
    server.stop()
    # When a call is made while it is down, and it comes back a second later
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_restart_after, server, 1.0)
        length = await client.call(client.sync.xlen, names.stream(N.TASKS))
    # Then the call returned once Redis was back, with the data of before
    assert length == 1


async def test_a_blocked_consumer_reads_on_after_a_restart(
    dedicated: tuple[ServerProcess, RedisClient], names: N.Names
) -> None:
    # Given a consumer blocked on an empty stream
    server, client = dedicated
    settings = ConsumerSettings(block_ms=300)
    async with open_stream_consumer(
        client, names, N.TASKS, stage="g", settings=settings
    ) as consumer:
        assert await consumer.read(1) == []
        # When Redis restarts under it and an entry is published afterwards
        server.stop()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_restart_after, server, 1.0)
            got = await consumer.read(1)  # fails over and over until Redis is back
        await Producer(client, names).publish(N.TASKS, [b"after"])
        with trio.fail_after(10):
            while not got:
                got = await consumer.read(1)
        # Then it is read and handed off as usual
        [delivery] = got
        assert delivery.payload == b"after"
        await consumer.complete(Handoff(delivery.entry_id, names.dedup("g", "x")))
    pending = await client.call(client.sync.xpending, names.stream(N.TASKS), "generator")
    assert pending["pending"] == 0


async def test_an_event_reader_made_while_redis_is_down_reads_once_it_is_back(
    dedicated: tuple[ServerProcess, RedisClient], names: N.Names
) -> None:
    # Given a Redis that is down when an actor makes its blocking reader (an actor that was
    # still starting when Redis restarted)
    server, client = dedicated
    server.stop()
    reader = EventReader(client, names, N.WEIGHTS, block_ms=200)
    # When it reads while Redis comes back a second later, and an event is published
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_restart_after, server, 1.0)
        got = await reader.read()
    await Producer(client, names).publish(N.WEIGHTS, [b"v1"])
    with trio.fail_after(10):
        while not got:
            got = await reader.read()
    # Then the reader was made without a connection and reads the event
    assert [payload for _, payload in got] == [b"v1"]
    reader.close()


async def test_calls_give_up_after_the_reconnect_timeout(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    # Given a Redis that is gone for good (the client's backoff on trio's simulated clock:
    # the refused connections are real, the waits between them take no time)
    server = ServerProcess(data_dir=tmp_path / "redis").start()
    server.stop()
    client = RedisClient(server.url, reconnect=Reconnect(timeout_s=30, backoff_s=0.05))
    tries = 0

    def ping() -> bool:  # (in a worker thread)
        nonlocal tries
        tries += 1
        assert tries < 1000, "the client never gave up"
        return bool(client.sync.ping())

    # When a call is made, then it raises the connection error once the timeout has passed
    # since the first failure, after retrying until then
    started = trio.current_time()
    with pytest.raises(redis.ConnectionError):
        await client.call(ping)
    assert tries > 2 and trio.current_time() - started == pytest.approx(30)
    client.close()
