"""Operations on a sharded run (``queues.shards = 3``) on the real 3-node Redis Cluster: the
real verifier actor consumes every shard and hands off (or dead-letters) within the shard of
each input; ``streamrl status`` and ``streamrl dlq`` (the real CLI) sum and list over the
shards; a letter is requeued into its own shard and completes there; the real archiver
consumes every shard and ``streamrl replay`` finds every shard's groups, live and archived."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import trio

import streamrl.domains.arith.domain  # noqa: F401  (registers the arith domain)
from streamrl.actors import archiver
from streamrl.actors.verifier import Verifier, serve
from streamrl.cli.dlq import Selection, list_dead, run_dlq
from streamrl.cli.replay import Query, select
from streamrl.protocol import names as N
from streamrl.protocol.messages import Trajectory
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.payloads import PayloadLimits, resolve
from streamrl.queues.stats import group_state, stream_length
from streamrl.queues.streams import Producer, StreamConsumer, ensure_group
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until
from tests.ops.helpers import config, executed

SHARDS = 3
pytestmark = pytest.mark.on_cluster(shards=3)  # redis_url, names: tests/conftest.py


def _cli(redis_url: str, run: str, *args: str) -> subprocess.CompletedProcess[str]:
    sets = [f"run.name={run}", f"run.redis_url={redis_url}", f"queues.shards={SHARDS}"]
    return subprocess.run(
        [sys.executable, "-m", "streamrl", *args, *(a for s in sets for a in ("--set", s))],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def _serve_until(ctx: ActorContext, done: Callable[[], Awaitable[object]]) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, ctx)
        await wait_until(done, timeout=30)
        nursery.cancel_scope.cancel()


async def _entries(client: RedisClient, layout: N.Names, stream: str) -> list[bytes]:
    """Payloads of ``stream`` in one shard, claim-check references resolved."""
    rows = await client.call(client.sync.xrange, layout.stream(stream))
    entries = [(e.decode(), f.get(b"d")) for e, f in rows]
    resolved = await client.call(resolve, client.sync, entries, PayloadLimits())
    return [r.payload for r in resolved if r.payload is not None]


async def test_status_and_dlq_cover_every_shard(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given executed groups in every shard: a good one in each, a poison one (3 kB of stderr,
    # over a 2 kB limit) in shards 0 and 2
    good = {k: executed("7", ["7", "8"]) for k in range(SHARDS)}
    poison = {k: executed("42", ["42"], stderr="x" * 3000) for k in (0, 2)}
    for k, layout in enumerate(names.layouts()):
        await Producer(client, layout).publish(
            N.EXECUTED, [encode(good[k]), *([encode(poison[k])] if k in poison else [])]
        )
    small = config(tmp_path, redis_url, names.run, f"queues.shards={SHARDS}",
                   "queues.max_message_bytes=2000", "queues.claim_check_bytes=1000")  # fmt: skip
    assert ActorContext(small, client, names).names == names

    # When the real verifier actor runs on the run (every shard)
    async def settled() -> bool:
        done = await stream_length(client, names, N.TRAJECTORIES) == SHARDS
        return done and len(await list_dead(client, names)) == 2

    await _serve_until(ActorContext(small, client, names), settled)

    # Then each shard's good group was scored into that shard's trajectories, and each poison
    # group dead-lettered in its own shard
    for k, layout in enumerate(names.layouts()):
        [traj] = [decode(p, Trajectory) for p in await _entries(client, layout, N.TRAJECTORIES)]
        assert traj.rollout.task.id == good[k].rollout.task.id
        assert traj.rewards == [1.0, 0.0]
        assert len(await _entries(client, layout, N.DEAD)) == (1 if k in poison else 0)
    assert await client.call(client.sync.exists, N.Names(names.run).stream(N.TRAJECTORIES)) == 0

    # and one more entry is held by a consumer in shard 1, never acknowledged
    await Producer(client, names.in_shard(1)).publish(N.ROLLOUTS, [encode(good[1].rollout)])
    await ensure_group(client, names.in_shard(1).stream(N.ROLLOUTS), "executor")
    held = StreamConsumer(
        client, names.in_shard(1), N.ROLLOUTS, "executor", stage="executor", consumer="exec-1"
    )
    await held.read(1)
    held.close()

    # When `streamrl status` runs for the 3-shard run
    done = _cli(redis_url, names.run, "status", "--json", "--samples", "1")
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    # Then it sums over the shards
    groups = {g["stream"]: g for g in status["groups"]}
    assert status["shards"] == SHARDS and status["dead_letters"] == 2
    assert groups[N.EXECUTED]["dead_letters"] == 2
    assert (groups[N.EXECUTED]["length"], groups[N.EXECUTED]["pending"]) == (5, 0)
    assert (groups[N.TRAJECTORIES]["length"], groups[N.TRAJECTORIES]["lag"]) == (3, 3)
    rollouts = groups[N.ROLLOUTS]
    assert (rollouts["length"], rollouts["pending"], rollouts["max_deliveries"]) == (1, 1, 1)
    assert [(c["name"], c["pending"]) for c in rollouts["consumers"]] == [("exec-1", 1)]

    # When `streamrl dlq list` runs: both letters, ids qualified by their shard
    done = _cli(redis_url, names.run, "dlq", "list", "--json")
    assert done.returncode == 0, done.stderr
    listed = json.loads(done.stdout)
    assert sorted(e["id"].split(":")[0] for e in listed) == ["0", "2"]
    assert {e["stream"] for e in listed} == {N.EXECUTED}

    # When the limit is fixed and shard 2's letter is requeued by its id (through the CLI)
    [in_two] = [e["id"] for e in listed if e["id"].startswith("2:")]
    done = _cli(redis_url, names.run, "dlq", "requeue", in_two)
    assert done.returncode == 0, done.stderr
    assert [e.dead_id for e in await list_dead(client, names)] != [in_two]
    fixed = config(tmp_path, redis_url, names.run, f"queues.shards={SHARDS}")

    async def requeued_done() -> bool:
        return len(await _entries(client, names.in_shard(2), N.TRAJECTORIES)) == 2

    await _serve_until(ActorContext(fixed, client, names), requeued_done)
    # Then it completed in shard 2, and only shard 0's letter is left; purge removes it
    last = decode((await _entries(client, names.in_shard(2), N.TRAJECTORIES))[-1], Trajectory)
    assert last.rollout.task.id == poison[2].rollout.task.id and last.rewards == [1.0]
    [left] = await list_dead(client, names)
    assert left.dead_id.startswith("0:")
    assert await run_dlq(client, names, "purge", Selection(all=True), yes=True) == 0
    assert await list_dead(client, names) == []
    assert await stream_length(client, names, N.DEAD) == 0


async def test_archiver_and_replay_cover_every_shard(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given one verified group in the trajectories of every shard
    groups = {k: executed(str(k), [str(k), "x"]) for k in range(SHARDS)}
    for k, layout in enumerate(names.layouts()):
        out, *_ = await Verifier().handle(groups[k])  # the output, then its counters
        await Producer(client, layout).publish(N.TRAJECTORIES, [encode(out.message)])
    cfg = config(tmp_path, redis_url, names.run, f"queues.shards={SHARDS}")
    ctx = ActorContext(cfg, client, names)

    # When replay selects live: every shard's group, its entry id qualified by its shard
    live = await select(client, names, Query(), None)
    assert sorted(f.entry_id.split(":")[0] for f in live) == ["0", "1", "2"]
    for f in live:
        assert f.trajectory.rollout.task.id == groups[int(f.entry_id.split(":")[0])].rollout.task.id

    # When the real archiver runs on the run (its own group in every shard)
    root = archiver.archive_dir(cfg)

    async def archived() -> bool:
        rows = sum(pq.read_metadata(p).num_rows for p in root.rglob("*.parquet"))
        state = await group_state(client, names, N.TRAJECTORIES, archiver.GROUP)
        return rows == SHARDS and state.backlog == 0

    async with trio.open_nursery() as nursery:
        await nursery.start(archiver.serve, ctx)
        await wait_until(archived, timeout=30)
        nursery.cancel_scope.cancel()
    # and the live streams are gone (trimmed, or Redis lost)
    for layout in names.layouts():
        await client.call(client.sync.delete, layout.stream(N.TRAJECTORIES))

    # Then `streamrl replay list` finds every group in the archive, under the same ids
    done = _cli(redis_url, names.run, "replay", "list", "--source", "both",
                "--archive", str(root))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert sorted((r["entry_id"], r["source"]) for r in rows) == sorted(
        (f.entry_id, "archive") for f in live
    )
    # and an id range bounds the entry id within each shard
    first = min(f.entry_id.split(":")[1] for f in live)
    ranged = await select(None, names, Query(from_id=first, to_id=first), root)
    assert [f.entry_id.split(":")[1] for f in ranged] == [first] * len(ranged) != []
