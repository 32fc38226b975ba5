"""The archiver: every trajectory (training and evaluation groups) kept on disk as Parquet,
beyond the streams' retention, so old runs can be replayed (``streamrl replay --source
archive``) and reported on.

Guarantees:
- at-least-once into the archive: the archiver reads ``trajectories`` and ``evals`` through
  its own consumer group (``archiver``, beside the learner's and the monitor's, which it
  never disturbs) and acknowledges entries only after the Parquet file holding them is
  written, fsynced and renamed into place; a crash in between archives them again in a
  later file, and readers drop the duplicates (same trajectory id);
- the streams' trimming keeps every entry its group still needs, so while the archiver's
  group exists no trajectory is trimmed before it is archived (an archiver that stays down
  holds trimming back: delete its group with ``XGROUP DESTROY`` to let go);
- one file per flush: ``<dir>/<stream>/<first entry id>_<n>.parquet``; the full message is
  in the ``payload`` column (MessagePack, the wire format), the other columns are for
  selecting without decoding.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import trio

from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, Trajectory
from streamrl.protocol.pipeline import pipeline_state
from streamrl.queues.codec import MessageError, decode
from streamrl.queues.streams import EventReader
from streamrl.runtime import metrics
from streamrl.runtime.batches import BatchSettings, Held, Settlement, open_batches, serve_batches
from streamrl.runtime.context import ActorContext

log = structlog.get_logger()

GROUP = "archiver"
STREAMS = (N.TRAJECTORIES, N.EVALS)
COLUMNS = (
    "entry_id", "stream", "trajectory_id", "episode_id", "created_at", "policy_version",
    "domain", "split", "item_id", "reward_mean", "rewards", "payload",
)  # fmt: skip


def archive_dir(ctx_config: Any) -> Path:
    configured = ctx_config.ops.archive_dir
    return Path(configured) if configured else ctx_config.run.path / "archive"


def row(stream: str, entry_id: str, payload: bytes) -> dict[str, Any]:
    """One archive row; raises MessageError for a payload that is not a Trajectory."""
    return trajectory_row(stream, entry_id, decode(payload, Trajectory), payload)


def trajectory_row(stream: str, entry_id: str, t: Trajectory, payload: bytes) -> dict[str, Any]:
    """One archive row of ``t``, decoded from ``payload``."""
    task = t.rollout.task
    return {
        "entry_id": entry_id,
        "stream": stream,
        "trajectory_id": t.id,
        "episode_id": t.episode_id,
        "created_at": t.created_at,
        "policy_version": t.policy_version,
        "domain": task.domain,
        "split": task.split,
        "item_id": task.item_id,
        "reward_mean": sum(t.rewards) / len(t.rewards) if t.rewards else 0.0,
        "rewards": list(t.rewards),
        "payload": payload,
    }


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` to ``path`` atomically (temporary file, fsync, rename, fsync dir)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({c: [r[c] for r in rows] for c in COLUMNS})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".parquet.tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def archive(stream: str, root: Path, batch: list[Held[Trajectory]]) -> Settlement:
    """Write ``batch`` to one Parquet file, durably; its acknowledgement (the runtime's, after
    this returns) is all that settling it takes."""
    rows = [trajectory_row(stream, h.entry_id, h.message, h.delivery.payload or b"")
            for h in batch]  # fmt: skip
    path = root / stream / f"{rows[0]['entry_id']}_{len(rows)}.parquet"
    await trio.to_thread.run_sync(write_parquet, path, rows)
    log.info("archived", stream=stream, rows=len(rows))
    return Settlement()


async def serve_stream(
    ctx: ActorContext, stream: str, root: Path, batch: int,
    *, task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:  # fmt: skip
    """Archive ``stream`` through the batch runtime (runtime/batches.py): an observer group
    (what does not decode, or is past the delivery limit, is acknowledged and logged: the
    stage that consumes the stream dead-letters it), a crashed archiver's entries reclaimed,
    up to ``batch`` entries per file (fewer after ``queues.block_ms`` with some in hand),
    acknowledged in one call once the file is durable; until shutdown."""
    q = ctx.config.queues
    settings = BatchSettings(
        heartbeat_interval_s=q.heartbeat_interval_s,
        reclaim_interval_s=q.reclaim_interval_s,
        observer=True,
    )
    policies = ctx.policies(time_limit_s=0)
    async with (
        ctx.consumer(stream, GROUP, group=GROUP) as consumer,
        open_batches(consumer, GROUP, Trajectory, policies, settings) as runtime,
    ):
        await serve_batches(
            runtime, partial(archive, stream, root), size=batch,
            deadline_s=q.block_ms / 1000, until=ctx.shutdown, task_status=task_status,
        )  # fmt: skip


async def serve_run_metrics(
    ctx: ActorContext, interval_s: float = 5.0, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Run-wide Prometheus metrics from this process: the learner's step metrics (staleness,
    busy fraction) as they are announced, and every work stream's lag and pending count."""
    reader = EventReader(ctx.client, ctx.names, N.METRICS, block_ms=ctx.config.queues.block_ms)
    task_status.started()

    async def follow_steps() -> None:
        while True:
            for _, payload in await reader.read():
                try:
                    metrics.record_step(ctx.names.run, decode(payload, StepMetrics))
                except MessageError as exc:
                    log.warning("undecodable step metrics", error=str(exc))

    async def sample_queues() -> None:
        while True:
            for state in await pipeline_state(ctx.client, ctx.names):
                metrics.record_queue(ctx.names.run, state.stream, state.lag, state.pending)
            await trio.sleep(interval_s)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follow_steps)
            nursery.start_soon(sample_queues)
            await ctx.shutdown.wait()  # draining: the archive streams finish on their own
            nursery.cancel_scope.cancel()
    finally:
        reader.close()


async def serve(
    ctx: ActorContext, *, batch: int = 256, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Archive ``trajectories`` and ``evals`` until cancelled (or shutdown is set); with
    metrics on (``ops.metrics_port``), also serve the run-wide metrics."""
    root = archive_dir(ctx.config)
    async with trio.open_nursery() as nursery:
        for stream in STREAMS:
            await nursery.start(serve_stream, ctx, stream, root, batch)
        if ctx.config.ops.metrics_port:
            await nursery.start(serve_run_metrics, ctx)
        task_status.started()
