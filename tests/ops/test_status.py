"""``streamrl status``: the JSON schema, the bottleneck on a staged backlog, and a fast,
clear failure when Redis is down."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamrl.cli.status import bottleneck, sample, snapshot
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, WeightsPublished, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import Producer, StreamConsumer, ensure_group
from tests.ops.helpers import config, executed

NUM = (int, float)
GROUP_SCHEMA = {
    "stream": str, "group": str, "length": int, "lag": int, "pending": int, "backlog": int,
    "oldest_pending_age_s": (float, type(None)), "max_deliveries": int, "dead_letters": int,
    "consumers": list, "reported_lag": (int, type(None)), "lag_flag": (str, type(None)),
}
TOP_SCHEMA = {
    "run": str, "at": float, "policy_version": int, "steps_per_min": (float, type(None)),
    "dead_letters": int, "groups": list, "bottleneck": (str, type(None)), "growth": dict,
    "shards": int, "stall": (dict, type(None)), "quarantined": dict, "domains": list,
    "domains_total": int, "forgetting": list, "fleet": dict, "held_back": dict,
    "rounds": list,
}


def _check(obj: dict, schema: dict) -> None:
    assert set(obj) == set(schema), set(obj) ^ set(schema)
    for key, kind in schema.items():
        assert isinstance(obj[key], kind), (key, obj[key])


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "streamrl", *args], capture_output=True, text=True, timeout=timeout
    )


async def test_status_json_schema_through_the_cli(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a rollouts entry delivered to an executor twice and never acknowledged
    await Producer(client, names).publish(N.ROLLOUTS, [encode(executed("1", ["1"]).rollout)])
    await ensure_group(client, names.stream(N.ROLLOUTS), "executor")
    consumer = StreamConsumer(client, names, N.ROLLOUTS, "executor", stage="executor",
                              consumer="exec-1")
    [d] = await consumer.read(1)
    await client.call(client.sync.xclaim, names.stream(N.ROLLOUTS), "executor", "exec-1", 0,
                      [d.entry_id])
    consumer.close()

    # When status runs as a command
    done = _cli("status", "--json", "--samples", "1", "--set", f"run.name={names.run}",
                "--set", f"run.redis_url={redis_url}")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)

    # Then it has the schema, and the rollouts group shows the pending entry and its consumer
    _check(status, TOP_SCHEMA)
    assert [g["stream"] for g in status["groups"]] == list(N.WORK_STREAMS)
    for g in status["groups"]:
        _check(g, GROUP_SCHEMA)
        for c in g["consumers"]:
            _check(c, {"name": str, "pending": int, "idle_s": NUM})
    rollouts = status["groups"][1]
    assert (rollouts["length"], rollouts["lag"], rollouts["pending"]) == (1, 0, 1)
    assert rollouts["max_deliveries"] == 2
    assert rollouts["oldest_pending_age_s"] is not None
    assert [c["name"] for c in rollouts["consumers"]] == ["exec-1"]


async def test_bottleneck_is_the_most_downstream_growing_backlog(
    client: RedisClient, names: N.Names
) -> None:
    producer = Producer(client, names)
    group = executed("1", ["1"])
    # Given a standing tasks backlog (upstream, constant) ...
    await producer.publish(N.TASKS, [encode(group.rollout.task)] * 3)
    first = await snapshot(client, names)
    # ... and executed entries piling up between samples (the verifier is slow)
    samples = [first]
    for _ in range(2):
        await producer.publish(N.EXECUTED, [encode(group)] * 2)
        samples.append(await snapshot(client, names))
    stage, growth = bottleneck(samples)
    assert stage == "verifier"
    assert growth == {N.TASKS: 0, N.ROLLOUTS: 0, N.EXECUTED: 4, N.TRAJECTORIES: 0}

    # When the rollouts backlog also grows, the verifier is still the most downstream one
    await producer.publish(N.ROLLOUTS, [encode(group.rollout)])
    await producer.publish(N.EXECUTED, [encode(group)])
    assert bottleneck([*samples, await snapshot(client, names)])[0] == "verifier"
    # A backlog that drains is no bottleneck; nothing growing: None
    assert bottleneck([samples[-1], samples[0]]) == (None, {k: -v for k, v in growth.items()})
    assert (await sample(client, names, 2, 0.01)).bottleneck is None


def test_status_fails_fast_when_redis_is_down(tmp_path: Path) -> None:
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # (status gives up after its own reconnect window, OPS_RECONNECT's 3 s, where the
    # actors' default waits 60 s for Redis to come back)
    try:
        done = _cli("status", "--set", f"run.redis_url=redis://127.0.0.1:{port}/0", timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("status did not give up on an unreachable Redis within 30 s")
    assert done.returncode == 2
    assert "cannot reach Redis at redis://127.0.0.1" in done.stderr


def test_status_without_url_is_a_clear_error(tmp_path: Path) -> None:
    # (a work_dir of its own: with none given, a finished embedded run in the checkout's
    # runs/ would be opened, which is what status should do there)
    done = _cli("status", "--set", "run.redis_url=", "--set", f"run.work_dir={tmp_path}")
    assert done.returncode == 2 and "run.redis_url is empty" in done.stderr


@pytest.mark.parametrize("action", ["list"])
def test_dlq_cli_lists(action: str, redis_url: str, names: N.Names, tmp_path: Path) -> None:
    cfg = config(tmp_path, redis_url, names.run)
    done = _cli("dlq", action, "--json", "--set", f"run.name={cfg.run.name}",
                "--set", f"run.redis_url={redis_url}")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


async def test_policy_version_and_step_rate(client: RedisClient, names: N.Names) -> None:
    # Given three learner steps a minute apart and version 3 published
    base_ms = int(time.time() * 1000) - 300_000
    for i in range(3):
        step = StepMetrics(
            id=new_id(), created_at=now(), policy_version=i + 1, step=i + 1, loss=0.0,
            grad_norm=0.0, reward_mean=0.0, groups=1, samples=2, tokens=4, dropped_stale=0,
            max_staleness_seen=0, step_seconds=1.0, wait_seconds=1.0,
        )
        await client.call(client.sync.xadd, names.stream(N.METRICS), {"d": encode(step)},
                          id=f"{base_ms + i * 60_000}-0")
    await Producer(client, names).publish(N.WEIGHTS, [encode(WeightsPublished(
        id=new_id(), created_at=now(), policy_version=3, version=3, path="/w/v000003"))])
    snap = await snapshot(client, names)
    assert snap.policy_version == 3
    assert snap.steps_per_min == pytest.approx(1.0)


def test_watch_prints_a_snapshot_per_interval(redis_url: str, names: N.Names) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "status", "--watch", "--json", "--interval", "0.2",
         "--set", f"run.name={names.run}", "--set", f"run.redis_url={redis_url}"],
        stdout=subprocess.PIPE, text=True,
    )
    assert proc.stdout is not None
    try:
        lines = [json.loads(proc.stdout.readline()) for _ in range(3)]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert [s["run"] for s in lines] == [names.run] * 3
    assert lines[0]["at"] < lines[1]["at"] < lines[2]["at"]
    assert lines[2]["bottleneck"] is None and set(lines[2]["growth"]) == {
        N.TASKS, N.ROLLOUTS, N.EXECUTED, N.TRAJECTORIES}
