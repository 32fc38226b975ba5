"""A stall is reported: when nothing is acknowledged anywhere for ``ops.stall_after_s`` while
work is queued, ``streamrl status`` and ``up``'s progress line say "stalled" and why; a lag
Redis reports that the stream cannot have is flagged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import trio

from streamrl.actors.monitor import Monitor
from streamrl.cli.status import render, snapshot
from streamrl.protocol import names as N
from streamrl.protocol.messages import Task
from streamrl.protocol.pipeline import assess_stall, pipeline_state
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import ConsumerSettings, Producer, ensure_group, open_stream_consumer
from streamrl.runtime.context import open_context
from streamrl.runtime.policies import Policies
from streamrl.runtime.serve import ActorRuntime, Output, RuntimeSettings
from streamrl.testing.wait import wait_until
from tests.actors.test_runtime import _task
from tests.ops.helpers import config


class Generating:
    """Stands in for the generator: one rollout per task."""

    stage = "generator"
    input_stream = N.TASKS
    input_type = Task

    async def handle(self, task: Task) -> list[Output]:
        return [Output(N.ROLLOUTS, task)]


def _status(redis_url: str, run: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", "status", *extra, "--samples", "1",
         "--set", f"run.name={run}", "--set", f"run.redis_url={redis_url}",
         "--set", "ops.stall_after_s=1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


async def test_a_stalled_pipeline_is_reported_with_its_reason(
    client: RedisClient,
    roles: dict[str, RedisClient],
    names: N.Names,
    redis_url: str,
    tmp_path: Path,
) -> None:
    # Given 3 rollouts taken by an executor that never finishes them, and 5 tasks queued for a
    # generator (the real runtime, as the generator role's user) that may not feed more than
    # 2 into rollouts
    producer = Producer(client, names)
    await ensure_group(client, names.stream(N.ROLLOUTS), "executor")
    await producer.publish(N.ROLLOUTS, [encode(_task(i)) for i in range(3)])
    await client.call(client.sync.xreadgroup, "executor", "stuck-executor",
                      {names.stream(N.ROLLOUTS): ">"}, count=3)  # fmt: skip
    await producer.publish(N.TASKS, [encode(_task(i)) for i in range(5)])
    settings = RuntimeSettings(
        downstream=(N.ROLLOUTS, "executor"), max_downstream_backlog=2, backpressure_poll_s=0.2
    )
    async with (
        open_stream_consumer(roles["generator"], names, N.TASKS, stage="generator",
                             settings=ConsumerSettings(block_ms=100)) as consumer,
        trio.open_nursery() as nursery,
    ):  # fmt: skip
        await nursery.start(ActorRuntime(consumer, Generating(), Policies(), settings).serve)
        # When nothing is acknowledged for longer than ops.stall_after_s (1 s), once the
        # generator has paused on the backlog
        async def stalled_and_paused() -> bool:
            stall = (await snapshot(client, names, stall_after_s=1)).stall
            return stall is not None and any("generator paused" in r for r in stall.reasons)

        await wait_until(stalled_and_paused, 20, what="no stall with the generator paused")
        done = await trio.to_thread.run_sync(_status, redis_url, names.run)
        as_json = await trio.to_thread.run_sync(_status, redis_url, names.run, "--json")
        # and up's monitor (as its role's user) takes its samples
        cfg = config(tmp_path, redis_url, names.run, "ops.stall_after_s=1")
        async with open_context(cfg, "monitor") as ctx, trio.open_nursery() as watching:
            monitor = Monitor(ctx, tmp_path, eval_items=1)
            await watching.start(monitor.serve)
            await wait_until(lambda: monitor.stall, 20, what="the monitor saw no stall")
            line = monitor.progress_line()
            watching.cancel_scope.cancel()
        # and the operator's and the monitor's own roles may see all of it
        as_admin = await snapshot(roles["admin"], names, stall_after_s=1)
        states = await pipeline_state(roles["monitor"], names)
        as_monitor = await assess_stall(roles["monitor"], names, states, stall_after_s=1)
        nursery.cancel_scope.cancel()

    # Then status says it is stalled, and why: the generator is paused on the rollouts
    # backlog, whose 3 entries are in progress with nobody acknowledging them
    assert done.returncode == 0, done.stderr
    print(done.stdout)
    stalled = done.stdout.splitlines()[1]
    assert stalled.startswith("STALLED: nothing acknowledged for "), done.stdout
    assert "while 8 entries are queued" in stalled
    assert "generator paused on backpressure: rollouts backlog 3 > 2" in stalled
    assert "executor: 3 entries in progress, none acknowledged" in stalled
    stall = json.loads(as_json.stdout)["stall"]
    assert stall["queued"] == 8 and stall["idle_s"] >= 1.0
    assert any("generator paused" in r for r in stall["reasons"])
    for seen in (as_admin.stall, as_monitor):
        assert seen is not None
        assert "generator paused on backpressure: rollouts backlog 3 > 2" in seen.reasons
    # and so does up's progress line
    print(line)
    assert "STALLED: nothing acknowledged for" in line
    assert "generator paused on backpressure: rollouts backlog 3 > 2" in line


async def test_no_stall_while_work_is_acknowledged(client: RedisClient, names: N.Names) -> None:
    # Given work queued and acknowledged a moment ago (a rollout published)
    await Producer(client, names).publish(N.TASKS, [encode(_task())])
    await Producer(client, names).publish(N.ROLLOUTS, [encode(_task())])
    # Then nothing is stalled, whatever is queued
    snap = await snapshot(client, names, stall_after_s=60)
    assert snap.stall is None
    # and nothing at all is stalled when nothing is queued, however long it has been quiet
    empty = N.Names(names.run + "x")
    assert (await snapshot(client, empty, stall_after_s=0.001)).stall is None


async def test_a_lag_larger_than_the_stream_is_flagged(
    client: RedisClient, roles: dict[str, RedisClient], names: N.Names
) -> None:
    # Given a group that has read all of 10 entries, 5 of them trimmed since, whose
    # entries-read Redis has lost (as Redis 7.0 does on loading a rewritten AOF)
    key = names.stream(N.ROLLOUTS)
    await ensure_group(client, key, "executor")
    await Producer(client, names).publish(N.ROLLOUTS, [encode(_task(i)) for i in range(10)])
    rows = await client.call(client.sync.xreadgroup, "executor", "e1", {key: ">"}, count=10)
    ids = [eid for eid, _ in rows[0][1]]
    await client.call(client.sync.xack, key, "executor", *ids)
    await client.call(client.sync.xtrim, key, minid=ids[5].decode(), approximate=False)
    await client.execute("XGROUP", "SETID", key, "executor", ids[-1], "ENTRIESREAD", 0)
    (g,) = await client.call(client.sync.xinfo_groups, key)
    assert g["lag"] == 10  # what Redis says of a 5-entry stream

    # When the operator looks (as the admin role)
    snap = await snapshot(roles["admin"], names, stall_after_s=60)

    # Then the lag is 0 (nothing follows the last-delivered id), Redis's figure is flagged
    rollouts = next(x for x in snap.groups if x.stream == N.ROLLOUTS)
    assert (rollouts.length, rollouts.lag, rollouts.reported_lag) == (5, 0, 10)
    flag = "rollouts: Redis reports lag 10, more than the stream's 5 entries"
    assert rollouts.lag_flag is not None and rollouts.lag_flag.startswith(flag)
    text = render(snap)
    assert f"! {flag}" in text
    assert "     0!" in text.splitlines()[3]
