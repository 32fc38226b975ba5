"""Experiment tracking: the monitor forwards the metrics stream, each domain's figures and each
completed held-out round to TensorBoard, wandb (offline) and trackio, read back here from
what each library wrote; a backend that fails is logged and the monitor keeps following."""

from __future__ import annotations

import json
import sqlite3
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog
import trio

from streamrl.actors.monitor import Monitor
from streamrl.config.schema import ConfigError, load_config
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, Trajectory
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.operations import increment
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.messages import make_trajectory
from streamrl.testing.processes import descendants
from streamrl.testing.wait import wait_until
from tests.helpers import run_config


def _step(step: int, reward: float) -> bytes:
    return encode(StepMetrics(
        id=f"m{step}", created_at=0.0, policy_version=step, step=step, loss=0.1 * step,
        grad_norm=1.0, reward_mean=reward, groups=2, samples=8, tokens=64, dropped_stale=0,
        max_staleness_seen=1, step_seconds=0.5, wait_seconds=0.1, lr=1e-5, entropy=0.7,
    ))


def _held_out(round_no: int, domain: str, item: str, reward: float, version: int) -> Trajectory:
    traj = make_trajectory([1, 2], [[3]], [[-0.5]], [reward], weight_versions=version)
    task = msgspec.structs.replace(traj.rollout.task, split="eval", eval_round=round_no,
                                   domain=domain, item_id=item)
    return msgspec.structs.replace(traj, rollout=msgspec.structs.replace(traj.rollout, task=task))


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a wandb transaction log (``run-<id>.wandb``: a ``:W&B`` header, then
    LevelDB-log blocks of 32 KiB whose chunks make up protobuf ``Record``s)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the block's end
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            rec = pb.Record()
            rec.ParseFromString(chunks)
            chunks = b""
            yield rec


def _wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in _wandb_records(log) if r.WhichOneof("record_type") == "history"]


def _at(rows: list[dict[str, Any]], key: str) -> dict[int, float]:
    """``key``'s values by policy step in wandb's history rows."""
    return {r["policy_step"]: r[key] for r in rows if key in r}


async def test_the_monitor_tracks_steps_domains_and_rounds_in_every_backend(
    client: RedisClient, roles: dict[str, RedisClient], names: N.Names, redis_url: str,
    tmp_path: Path,
) -> None:
    log_dir = tmp_path / "tracking"
    config = run_config(tmp_path, redis_url, names.run, "scheduler.domains=['arith','math']",
                        "tracking.backends=['tensorboard','wandb','trackio']",
                        f"tracking.log_dir='{log_dir}'", "tracking.run_name='t1'")
    # Given arith with 2 trained groups of mean reward 0.75 (as the verifier's hand-offs count)
    for key, n in (("trained:arith", 2), ("resolved:arith:scored", 2),
                   ("resolved:arith:reward_milli", 1500)):
        await client.call(client.sync.incrby, names.counter(key), n)
    monitor = Monitor(ActorContext(config, roles["monitor"], names), tmp_path, eval_items=2)
    await monitor.refresh_domains()
    # When the monitor follows three learner steps, and a held-out round at v2 completes
    async with trio.open_nursery() as nursery:
        nursery.start_soon(monitor._serve_metrics)
        await wait_until(lambda: monitor.trackers.trackers, timeout=60)  # imports, under load
        await Producer(roles["learner"], names).publish(
            N.METRICS, [_step(s, r) for s, r in ((1, 0.25), (2, 0.5), (3, 0.75))])
        await wait_until(lambda: len(monitor.steps) == 3)
        await increment(client, names.eval_round)  # round 0, opened by the run
        await monitor.handle(_held_out(0, "arith", "a", 1.0, 2))
        await monitor.handle(_held_out(0, "math", "m", 0.5, 2))
        nursery.cancel_scope.cancel()
    assert monitor.trackers.trackers == []  # closed
    # and nothing they started outlives them (wandb's service process ends with its run)
    left = [d.cmdline for d in descendants()]
    assert not [c for c in left if "wandb-core" in c], left
    # Then TensorBoard has every step's fields, arith's figures and the round at v2
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir / "tensorboard" / "t1"))
    acc.Reload()
    tb = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert tb["learner/reward_mean"] == {1: 0.25, 2: 0.5, 3: 0.75}
    assert tb["learner/loss"] == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    assert tb["learner/entropy"] == pytest.approx({1: 0.7, 2: 0.7, 3: 0.7})
    assert tb["domain/arith/train_reward"] == {1: 0.75, 2: 0.75, 3: 0.75}
    assert tb["domain/arith/trained_groups"][3] == 2 and tb["domain/math/trained_groups"][3] == 0
    assert "domain/math/train_reward" not in tb  # none scored yet
    assert (tb["eval/reward"], tb["eval/arith/reward"], tb["eval/math/reward"]) == (
        {2: 0.75}, {2: 1.0}, {2: 0.5})
    # and wandb's offline run log holds the same, each row at its policy step
    rows = _wandb_history(log_dir / "wandb")
    assert _at(rows, "learner/reward_mean") == {1: 0.25, 2: 0.5, 3: 0.75}
    assert _at(rows, "domain/arith/train_reward") == {1: 0.75, 2: 0.75, 3: 0.75}
    assert _at(rows, "eval/math/reward") == {2: 0.5} and _at(rows, "eval/reward") == {2: 0.75}
    # and trackio's local store (project `streamrl`, run t1)
    with sqlite3.connect(log_dir / "trackio" / "streamrl.db") as db:
        logged = [(step, json.loads(m)) for step, m in db.execute(
            "SELECT step, metrics FROM metrics WHERE run_name = 't1' ORDER BY id")]
    assert {s: m["learner/reward_mean"] for s, m in logged if "learner/reward_mean" in m} == {
        1: 0.25, 2: 0.5, 3: 0.75}
    assert [(s, m["eval/arith/reward"]) for s, m in logged if "eval/arith/reward" in m] == [
        (2, 1.0)]


async def test_a_broken_tracker_is_logged_and_the_monitor_keeps_following(
    roles: dict[str, RedisClient], names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given tracking into a directory that cannot be created (a file stands in its way)
    (tmp_path / "blocked").write_text("not a directory")
    config = run_config(tmp_path, redis_url, names.run, "tracking.backends=['tensorboard']",
                        f"tracking.log_dir='{tmp_path / 'blocked' / 'tracking'}'")
    monitor = Monitor(ActorContext(config, roles["monitor"], names), tmp_path, eval_items=2)
    # When the monitor follows two learner steps
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(monitor._serve_metrics)
            await Producer(roles["learner"], names).publish(N.METRICS, [_step(1, 0.5),
                                                                        _step(2, 0.6)])
            await wait_until(lambda: len(monitor.steps) == 2, timeout=60)
            nursery.cancel_scope.cancel()
    # Then the backend's failure was logged, and every step was still followed
    assert [s.step for s in monitor.steps] == [1, 2]
    failed = [e for e in logs if e["event"].startswith("tracker did not open")]
    assert failed and failed[0]["backend"] == "tensorboard"


def test_an_unknown_backend_is_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="mlflow"):
        load_config(None, ["tracking.backends=['mlflow']"])
    with pytest.raises(ConfigError, match="twice"):
        load_config(None, ["tracking.backends=['wandb','wandb']"])
