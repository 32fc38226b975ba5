"""A consumer process killed mid-message: its entry is reclaimed by another consumer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import trio

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.streams import ConsumerSettings, Handoff, Producer, open_stream_consumer
from streamrl.testing.wait import wait_until

REPO = Path(__file__).resolve().parents[2]

CONSUMER = textwrap.dedent("""
    import sys, trio
    from streamrl.queues.client import RedisClient
    from streamrl.protocol.names import Names
    from streamrl.queues.streams import open_stream_consumer

    async def main(url, run):
        async with open_stream_consumer(RedisClient(url), Names(run), "tasks", stage="g") as c:
            [d] = await c.read(1)
            print(d.entry_id, flush=True)
            await trio.sleep_forever()  # "handling" until killed

    trio.run(main, sys.argv[1], sys.argv[2])
""")


async def test_killed_consumer_work_is_reclaimed(
    client: RedisClient, names: N.Names, redis_url: str
) -> None:
    # Given a task taken by a consumer in another process
    await Producer(client, names).publish(N.TASKS, [b"work"])
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER, redis_url, names.run],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    entry_id = await trio.to_thread.run_sync(proc.stdout.readline)
    # When that process is killed mid-message
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # Then a live consumer reclaims it once it has been idle for min-idle, and finishes it
    settings = ConsumerSettings(reclaim_min_idle_ms=200)
    async with open_stream_consumer(client, names, N.TASKS, stage="g", settings=settings) as c:
        assert await c.read(1) == []  # nothing new: the entry is pending in the dead consumer
        [d] = await wait_until(lambda: c.reclaim(10), 10, what="the dead consumer's entry "
                               "was not reclaimed")
        assert d.entry_id == entry_id.strip() and d.payload == b"work" and d.deliveries == 2
        await c.complete(Handoff(d.entry_id, names.dedup("g", "x"), [(names.stream("out"), b"r")]))
    info = await client.call(client.sync.xpending, names.stream(N.TASKS), "generator")
    assert info["pending"] == 0
