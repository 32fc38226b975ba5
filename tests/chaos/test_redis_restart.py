"""Redis restarted in the middle of a run (AOF on): the actors ride it out and the run
completes with every group trained exactly once and nothing acknowledged lost."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import trio

from queues.client import RedisClient
from queues.server import ServerProcess
from tests.chaos.harness import (
    LedgerView,
    Recorder,
    Scenario,
    check_run,
    inspect_run,
    open_pipeline,
    progress,
    wait_finished,
)


@pytest.mark.slow
async def test_redis_restart_mid_run_loses_nothing(tmp_path: Path) -> None:
    # Given a dedicated Redis (appendonly yes, appendfsync everysec) and 200 groups in flight
    server = ServerProcess(data_dir=tmp_path / "redis").start()
    scenario = Scenario(server.url, f"restart{uuid.uuid4().hex[:8]}", tmp_path / "run", items=200)
    client = RedisClient(server.url)
    recorder = Recorder(client, scenario.names)
    started = time.monotonic()
    try:
        async with open_pipeline(scenario) as pipeline:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(recorder.serve)
                with trio.fail_after(240):
                    while len(LedgerView.read(scenario.weights_root).episode_ids) < 50:
                        await trio.sleep(0.2)
                    before = await progress(client, scenario)
                    # When Redis shuts down (SIGTERM: a clean SHUTDOWN) and starts again on the
                    # same port and data directory two seconds later
                    await trio.to_thread.run_sync(server.stop)
                    await trio.sleep(2.0)
                    await trio.to_thread.run_sync(server.start)
                    await pipeline.apply_users()  # ACL users are not persisted by Redis
                    after = await progress(client, scenario)
                    print(f"restarted Redis at {time.monotonic() - started:.0f}s")
                    print(f"  before: {before}\n  after:  {after}")
                    await wait_finished(client, scenario, timeout_s=180)
                nursery.cancel_scope.cancel()
            await pipeline.stop()
        report = await inspect_run(client, scenario, recorder)
    finally:
        client.close()
        server.stop()
    print(f"{time.monotonic() - started:.0f}s, {len(report.metrics)} learner steps")

    # Then every actor rode the restart out in its first process
    restarted = [a for a in pipeline.actors if len(a.pids) != 1]
    assert {a.name: a.pids for a in restarted} == {}, "\n".join(
        f"--- {a.name} log tail:\n{a.log_tail(6000)}" for a in restarted
    )
    # and every admitted group was trained exactly once, nothing pending, no dead letter
    check_run(scenario, pipeline, report, planted=[])
