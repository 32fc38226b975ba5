"""``queues.reclaim_min_idle_ms_by_stream``: each input stream takes over the entries of dead
consumers after its own min-idle (real Redis, the consumers actors get from ``ActorContext``).
"""

from __future__ import annotations

from pathlib import Path

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until
from tests.helpers import entry_idle_ms, run_config

TASKS_IDLE_MS, ROLLOUTS_IDLE_MS = 200, 3000


async def _pending_owners(client: RedisClient, names: N.Names, stream: str) -> list[str]:
    rows = await client.call(
        client.sync.xpending_range, names.stream(stream), N.GROUP_OF_STREAM[stream], "-", "+", 10
    )
    owners = [r["consumer"] for r in rows]
    return [o.decode() if isinstance(o, bytes) else str(o) for o in owners]


async def test_each_stream_reclaims_after_its_own_min_idle(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a run whose tasks are taken over after 200 ms idle, rollouts after 3 s, and every
    # other stream after the run-wide 60 s
    config = run_config(
        tmp_path, redis_url, names.run,
        "queues.reclaim_min_idle_ms=60000",
        f"queues.reclaim_min_idle_ms_by_stream={{tasks = {TASKS_IDLE_MS}, "
        f"rollouts = {ROLLOUTS_IDLE_MS}}}",
    )  # fmt: skip
    ctx = ActorContext(config, client, names)
    streams = (N.TASKS, N.ROLLOUTS, N.EXECUTED)
    assert [ctx.consumer_settings(s).reclaim_min_idle_ms for s in streams] == [
        TASKS_IDLE_MS, ROLLOUTS_IDLE_MS, 60000
    ]  # fmt: skip
    # and one entry on each, read by a consumer that then died (no ack, no heart-beat)
    read: dict[str, str] = {}
    for stream in streams:
        async with ctx.consumer(stream, "dead", consumer="dead") as dead:
            await Producer(client, names).publish(stream, [stream.encode()])
            [d] = await dead.read(1)
            assert d.payload == stream.encode()
            read[stream] = d.entry_id

    async def idle_ms(stream: str) -> int:  # by the server's clock, as reclaims go
        return await entry_idle_ms(
            client, names.stream(stream), N.GROUP_OF_STREAM[stream], read[stream])

    async def idle_past(stream: str, ms: int) -> bool:
        return await idle_ms(stream) >= ms

    async def take_over() -> dict[str, list[bytes | None]]:
        taken = {}
        for stream in streams:
            async with ctx.consumer(stream, "live", consumer="live") as live:
                taken[stream] = [d.payload for d in await live.reclaim(10)]
        return taken

    # When a live consumer of each stream looks for entries to take over once the task has
    # been idle past its 200 ms
    await wait_until(lambda: idle_past(N.TASKS, TASKS_IDLE_MS), 10,
                     what="the task was not idle past its min-idle")
    first = await take_over()
    rollout_idle = await idle_ms(N.ROLLOUTS)
    # Then only the task was taken over; the rollout stays with the dead consumer until its
    # own 3 s
    assert rollout_idle < ROLLOUTS_IDLE_MS, f"too slow a host to tell: {rollout_idle} ms"
    assert first == {N.TASKS: [b"tasks"], N.ROLLOUTS: [], N.EXECUTED: []}
    assert await _pending_owners(client, names, N.ROLLOUTS) == ["dead"]
    # And once the rollout has been idle past 3 s it is taken over too, while the executed
    # entry (the run-wide 60 s) still is not (the task, unacknowledged by "live", is idle
    # again and may be taken once more: not what this test is about)
    await wait_until(lambda: idle_past(N.ROLLOUTS, ROLLOUTS_IDLE_MS), 20,
                     what="the rollout was not idle past its min-idle")
    second = await take_over()
    assert (second[N.ROLLOUTS], second[N.EXECUTED]) == ([b"rollouts"], [])
    assert await _pending_owners(client, names, N.ROLLOUTS) == ["live"]
    assert await _pending_owners(client, names, N.EXECUTED) == ["dead"]
