"""``queues.reclaim_min_idle_ms_by_stream``: each input stream takes over the entries of dead
consumers after its own min-idle (real Redis, the consumers actors get from ``ActorContext``).
"""

from __future__ import annotations

from pathlib import Path

import trio

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from tests.helpers import run_config

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
    for stream in streams:
        async with ctx.consumer(stream, "dead", consumer="dead") as dead:
            await Producer(client, names).publish(stream, [stream.encode()])
            assert [d.payload for d in await dead.read(1)] == [stream.encode()]
    read_at = trio.current_time()

    async def take_over() -> dict[str, list[bytes | None]]:
        taken = {}
        for stream in streams:
            async with ctx.consumer(stream, "live", consumer="live") as live:
                taken[stream] = [d.payload for d in await live.reclaim(10)]
        return taken

    # When a live consumer of each stream looks for entries to take over after 0.6 s
    await trio.sleep(0.6)
    first = await take_over()
    first_at = trio.current_time() - read_at
    # Then only the task, idle past its 200 ms, was taken over; the rollout stays with the
    # dead consumer until its own 3 s
    assert first_at < ROLLOUTS_IDLE_MS / 1000, f"too slow a host to tell: {first_at:.2f} s"
    assert first == {N.TASKS: [b"tasks"], N.ROLLOUTS: [], N.EXECUTED: []}
    assert await _pending_owners(client, names, N.ROLLOUTS) == ["dead"]
    # And once the rollout has been idle past 3 s it is taken over too, while the executed
    # entry (the run-wide 60 s) still is not (the task, unacknowledged by "live", is idle
    # again and may be taken once more: not what this test is about)
    await trio.sleep(ROLLOUTS_IDLE_MS / 1000 - first_at + 0.2)
    second = await take_over()
    assert (second[N.ROLLOUTS], second[N.EXECUTED]) == ([b"rollouts"], [])
    assert await _pending_owners(client, names, N.ROLLOUTS) == ["live"]
    assert await _pending_owners(client, names, N.EXECUTED) == ["dead"]
