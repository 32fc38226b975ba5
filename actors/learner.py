"""Learner: verified groups become policy updates (``trajectories`` -> ``weights``).

Per step: read ``groups_per_step`` groups (while the step before trains), drop (acknowledge
and count) groups sampled more than ``max_staleness`` versions before the version they are
trained at, take one GRPO/PPO-clipped step, write the new weights
as ``weights/v{step}`` (Hugging Face safetensors), then publish the ``weights`` event and
the step's metrics and acknowledge the groups, in one atomic hand-off.

Guarantees (exactly-once effect): every group that reaches the learner is trained exactly
once, never partially, even across crashes of the learner or of Redis. The checkpoint of
step N is the weights directory ``v{N}`` (with the AdamW state) plus the ledger line of
step N listing its episode ids (:mod:`learner.checkpoint`), written ledger-first. A
restarted learner loads both, re-announces its latest step with its metrics (saved with
the weights; idempotent: the hand-off's dedup key) and acknowledges without training any
redelivered group whose episode is in the ledger, e.g. the groups of a step whose
acknowledgement was lost in a crash. Groups of a step that crashed before its weights were
complete are still pending and are trained again (that step never happened). The same
episode twice in one batch (a duplicate published after Redis lost a dedup key) is trained
once.

Sharded runs (``queues.shards`` > 1): the learner consumes ``trajectories`` in every shard
(one consumer name, ``learner-0``, in each, so a restart drains its own pending entries
everywhere). ``weights`` and ``metrics`` are run-global, so a step's announcement and the
acknowledgement of its groups (of several shards) cannot be one script: they are two
idempotent steps, ``publish_once`` under the step's dedup key in the run's slot, then the
acknowledgements shard by shard (:meth:`queues.shards.ShardedConsumer.ack_many`). A crash
in between leaves the groups pending; the restarted learner re-announces its latest step
(nothing is published twice) and acknowledges them, and the ledger keeps any of them from
being trained again.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import structlog
import torch
import trio

from streamrl.config.schema import Config
from streamrl.learner import distributed as dist_util
from streamrl.learner.batch import build_batch
from streamrl.learner.checkpoint import (
    Ledger,
    Snapshot,
    StepRecord,
    load_trainer_state,
    prune_trainer_states,
    save_state_dict,
)
from streamrl.learner.model import resolve_model
from streamrl.learner.train import StepStats, TrainConfig, Trainer, rng_state
from streamrl.learner.weights import latest_version, save_weights, version_dir
from streamrl.protocol import names as N
from streamrl.protocol.admission import run_drained
from streamrl.protocol.messages import (
    StepMetrics,
    Trajectory,
    WeightsPublished,
    new_id,
    now,
    training_group,
)
from streamrl.queues.codec import decode, encode
from streamrl.queues.operations import trim_events
from streamrl.queues.shards import Consumer
from streamrl.queues.stats import group_state
from streamrl.queues.streams import Delivery
from streamrl.runtime.context import ActorContext
from streamrl.runtime.metrics import (
    record_dropped_stale,
    record_learner_step,
    record_policy_version,
)
from streamrl.runtime.serve import dead_letter, decode_or_dead_letter

log = structlog.get_logger()

STAGE = "learner"
STEP_METRICS_FILE = "step_metrics.msgpack"
"""In each version directory: the step's metrics, so a re-announced step still reports them."""


def train_config(config: Config, device: str | None = None) -> TrainConfig:
    """The trainer's settings from the run's config (the learner's, and ``streamrl replay
    retrain``'s, which must take the very same step)."""
    cfg = config.learner
    return TrainConfig(
        lr=cfg.lr,
        clip_eps=cfg.clip_eps,
        max_grad_norm=cfg.max_grad_norm,
        micro_batch_size=cfg.micro_batch_size,
        grad_checkpointing=cfg.grad_checkpointing,
        seed=config.run.seed,
        num_threads=cfg.threads or None,
        tis_cap=cfg.tis_cap,
        recompute_old_logprobs=cfg.recompute_old_logprobs,
        kl_coef=cfg.kl_coef,
        device=device or cfg.device,
    )


def open_trainer(config: Config) -> tuple[Trainer, int, bool]:
    """``(trainer, version, resumed_optimizer)``: the latest version under the run's
    ``weights/`` (else the base model) with its optimiser and RNG state. Every rank of a
    distributed learner calls this on the same directory (one machine or a shared disk)."""
    root = config.run.path / "weights"
    base_dir = resolve_model(config.model.spec)
    version = latest_version(root) or 0
    start = version_dir(root, version) if version else base_dir
    device = config.learner.device
    if device == "cuda" and dist_util.is_distributed():
        device = f"cuda:{torch.cuda.current_device()}"
    trainer = Trainer.from_dir(start, train_config(config, device), ref_dir=base_dir)
    state = load_trainer_state(start) if version else None
    if state is not None:
        trainer.load_optimizer_state(state)
    return trainer, version, state is not None


def distributed_step(trainer: Trainer, trajectories: list[Trajectory]) -> StepStats:
    """Rank 0's step: send the groups to the other ranks (a no-op alone), then step."""
    dist_util.broadcast_payloads([encode(t) for t in trajectories])
    return trainer.step(trajectories)


def follow(config: Config) -> int:
    """Ranks > 0 of a distributed learner: take every step rank 0 takes, on the groups it
    broadcasts, until it broadcasts an empty step (its end). No Redis, no disk writes.
    Returns the number of steps taken."""
    trainer, _, _ = open_trainer(config)
    steps = 0
    while payloads := dist_util.broadcast_payloads(None):
        trainer.step([decode(p, Trajectory) for p in payloads])
        steps += 1
    return steps


class Learner:
    def __init__(self, ctx: ActorContext, consumer: Consumer) -> None:
        self.ctx = ctx
        self.cfg = ctx.config.learner
        self.staleness = ctx.staleness()
        self.consumer = consumer
        self.root = ctx.config.run.path / "weights"
        self.base_dir = resolve_model(ctx.config.model.spec)
        self.trainer, self.version, self.resumed_optimizer = open_trainer(ctx.config)
        self.ledger = Ledger.open(self.root, self.version)
        self.dropped_stale = 0
        self.snapshot: Snapshot | None = None
        self.held: set[str] = set()
        """Entry ids of the groups collected, training or being published (not yet
        acknowledged): this learner's share of its pending list."""
        self.claimed: set[str] = set()
        """Episodes of the steps collected, training or being checkpointed (not yet in the
        ledger)."""
        self.duplicates_skipped = 0

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        await self._finish_interrupted_step()
        record_policy_version(self.ctx.names.run, self.version)
        task_status.started()
        log.info(
            "learner ready",
            policy_version=self.version,
            trained_groups=len(self.ledger.consumed),
            resumed_optimizer=self.resumed_optimizer,
        )
        # Step N+1 runs while step N's checkpoint is written and announced (from a snapshot
        # of the weights); at most one step is being published at a time, in order. The
        # groups of step N+1 are collected while step N trains (``_prefetch``).
        published = trio.Event()
        published.set()
        batches, received = trio.open_memory_channel[list[tuple[Delivery, Trajectory]]](0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._prefetch, batches)
            async with received:
                while not self.cfg.max_steps or self.version < self.cfg.max_steps:
                    t0 = time.monotonic()
                    batch = await received.receive()
                    waited = time.monotonic() - t0
                    stats = await trio.to_thread.run_sync(
                        distributed_step,
                        self.trainer,
                        [t for _, t in batch],
                        abandon_on_cancel=False,
                    )
                    await published.wait()  # the shadow model is free again
                    state = await trio.to_thread.run_sync(self._snapshot)
                    self.version += 1
                    published = trio.Event()
                    nursery.start_soon(
                        self._publish_step, batch, stats, waited, self.version, state, published
                    )
        if dist_util.is_distributed():  # the end: release the other ranks
            await trio.to_thread.run_sync(dist_util.broadcast_payloads, [])

    async def _prefetch(self, batches: trio.MemorySendChannel[Any]) -> None:
        """Collect each step's groups while the step before it trains, so a learner whose
        groups are ready does not wait for reading, decoding and checking them. The groups
        are judged for staleness at the version they will be trained at (one more than now,
        while a step runs); each batch is handed over only when the learner takes it."""
        async with batches:
            version = self.version
            while not self.cfg.max_steps or version < self.cfg.max_steps:
                batch = await self._collect(self.cfg.groups_per_step, version)
                self.claimed |= {t.episode_id for _, t in batch}
                await batches.send(batch)
                version += 1

    async def _collect(self, n: int, version: int) -> list[tuple[Delivery, Trajectory]]:
        """``n`` trainable groups to train at ``version``; fewer only for the last step of a
        run with ``scheduler.max_train_groups``, once no further group can arrive (see
        :meth:`_run_drained`): groups dropped upstream (zero variance, dead letters, stale)
        would otherwise leave a part-filled last batch waiting forever."""
        batch: list[tuple[Delivery, Trajectory]] = []
        while len(batch) < n:
            deliveries = await self.consumer.read(n - len(batch))
            for d in deliveries:
                if d.entry_id in self.held:  # read again by a rewind (below): already ours
                    continue
                traj = await self._accept(d, {t.episode_id for _, t in batch}, version)
                if traj is not None:
                    batch.append((d, traj))
                    self.held.add(d.entry_id)
            if not deliveries and await self._lost_deliveries():
                self.consumer.rewind()
                continue
            if not deliveries and batch and len(batch) < n and await self._run_drained():
                log.info("final partial step", groups=len(batch), groups_per_step=n)
                break
        return batch

    async def _lost_deliveries(self) -> bool:
        """Whether entries are pending on this learner that it does not hold: delivered to it
        in Redis, but the reply never arrived (Redis restarted during the read). A restarted
        learner reads its pending list first; a running one rewinds to it here, when idle,
        or they would stay pending and a last part-filled step would close the run without
        them."""
        c, names = self.ctx.client, self.ctx.names
        own = await group_state(c, names, N.TRAJECTORIES, N.GROUP_OF_STREAM[N.TRAJECTORIES])
        if own.pending <= len(self.held):
            return False
        log.warning("taking back pending groups whose delivery was lost",
                    pending=own.pending, held=len(self.held))
        return True

    async def _run_drained(self) -> bool:
        """Whether no training group can reach the learner any more: admission closed and
        nothing left upstream (:func:`streamrl.protocol.admission.run_drained`)."""
        limit = self.ctx.config.scheduler.max_train_groups
        return await run_drained(self.ctx.client, self.ctx.names, limit)

    async def _accept(self, d: Delivery, in_batch: set[str], version: int) -> Trajectory | None:
        """Decode, skip groups already trained (or taken for a step not yet checkpointed),
        check staleness against ``version``; anything not trainable is settled (acknowledged
        or dead-lettered) here."""
        traj: Trajectory | None = await decode_or_dead_letter(self.consumer, STAGE, d, Trajectory)
        if traj is None:
            return None
        if training_group(traj) is None:  # an evaluation result, or a task of another split
            task = traj.rollout.task
            reason = f"not a training group: split {task.split!r}, eval round {task.eval_round}"
            await dead_letter(self.consumer, STAGE, d, reason)
            return None
        try:  # what the training step would refuse (killing the learner), refused here alone
            build_batch([traj])
        except ValueError as exc:
            await dead_letter(self.consumer, STAGE, d, f"malformed group: {exc}", traj)
            return None
        seen = self.ledger.consumed, self.claimed, in_batch
        if any(traj.episode_id in ids for ids in seen):
            self.duplicates_skipped += 1
            await self._settle(d, traj, "duplicates_skipped", f"duplicate-{d.entry_id}")
            log.warning("skipped group already trained", episode_id=traj.episode_id)
            return None
        if self.staleness.too_stale(traj, version):
            staleness = self.staleness.staleness(traj, version)
            self.dropped_stale += 1
            record_dropped_stale(self.ctx.names.run)
            await self._settle(
                d, traj, "dropped_stale", f"stale-{traj.episode_id}", frees_slot=True
            )
            log.warning("dropped stale group", episode_id=traj.episode_id, staleness=staleness)
            return None
        return traj

    async def _settle(
        self, d: Delivery, traj: Trajectory, counter: str, once: str, *, frees_slot: bool = False
    ) -> None:
        """Acknowledge a group that is not trained (a duplicate, stale), taking it out of the
        admission record and adding one to ``counter`` with its acknowledgement, in one
        script. The count is guarded by the dedup key ``once`` (``dedup:learner:*``): a
        replayed settlement (the entry redelivered or reclaimed, a repeated call) counts
        nothing. Duplicates count once per entry. A stale drop (``frees_slot``: a count in
        admission's D) counts only if this settlement took the group out of the admission
        record: a group settled already (dead-lettered upstream, counted in ``dead_groups``;
        dropped by an earlier entry of it) or never admitted frees no second slot."""
        names = self.consumer.names
        await self.consumer.ack_many(
            [d.entry_id], names.dedup("learner", once), [], settled=[traj.episode_id],
            counters=[(names.counter(counter), 1)], only_settling=frees_slot,
        )

    def _snapshot(self) -> dict[str, Any] | None:
        if self.snapshot is None:
            self.snapshot = Snapshot(self.trainer.model)
        optimizer = self.trainer.optimizer if self.cfg.checkpoint_optimizer else None
        return self.snapshot.take(self.trainer.model, optimizer, self.trainer.steps, rng_state())

    async def _publish_step(
        self,
        batch: list[tuple[Delivery, Trajectory]],
        stats: StepStats,
        waited: float,
        version: int,
        state: dict[str, Any] | None,
        done: trio.Event,
    ) -> None:
        record = StepRecord(
            version=version,
            episode_ids=[t.episode_id for _, t in batch],
            trajectory_ids=[t.id for _, t in batch],
            entry_ids=[d.entry_id for d, _ in batch],
        )
        staleness = [self.staleness.staleness(t, version - 1) for _, t in batch]
        metrics = StepMetrics(
            id=new_id(),
            created_at=now(),
            policy_version=version,
            step=version,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            reward_mean=stats.reward_mean,
            groups=len(batch),
            samples=sum(len(t.rewards) for _, t in batch),
            tokens=stats.tokens,
            dropped_stale=self.dropped_stale,
            max_staleness_seen=max(staleness, default=0),
            step_seconds=stats.seconds,
            wait_seconds=waited,
        )
        path = await trio.to_thread.run_sync(self._checkpoint, record, metrics, state)
        await self._announce(version, str(path), record.entry_ids, metrics, record.episode_ids)
        record_learner_step(
            self.ctx.names.run, metrics, [t for _, t in batch], staleness,
            kl_ref=stats.kl_ref, approx_kl=stats.approx_kl,
        )
        self.claimed -= set(record.episode_ids)  # in the ledger now
        self.held -= set(record.entry_ids)  # acknowledged
        done.set()
        await self._trim_events()
        log.info(
            "step",
            policy_version=version,
            loss=stats.loss,
            reward_mean=stats.reward_mean,
            grad_norm=stats.grad_norm,
            step_s=round(stats.seconds, 2),
            wait_s=round(waited, 2),
        )

    def _checkpoint(
        self, record: StepRecord, metrics: StepMetrics, state: dict[str, Any] | None
    ) -> Path:
        """Ledger line first, then the weights (and optimiser state) of ``record.version``
        from the snapshot, with the step's metrics (announced again if we crash before
        announcing them)."""
        assert self.snapshot is not None
        self.ledger.append(record)

        def extra(directory: Path) -> None:
            (directory / STEP_METRICS_FILE).write_bytes(encode(metrics))
            if state is not None:
                save_state_dict(state, directory)

        path = save_weights(
            self.snapshot.model,
            self.base_dir,
            self.root,
            record.version,
            self.cfg.keep_last,
            extra=extra,
        )
        prune_trainer_states(self.root, keep=record.version)
        return path

    async def _announce(
        self,
        version: int,
        path: str,
        entry_ids: list[str],
        metrics: StepMetrics | None,
        groups: list[str],
    ) -> None:
        """Publish the step's weights event and metrics and acknowledge its groups (taken
        out of the admission record with their acknowledgement), once."""
        event = WeightsPublished(
            id=new_id(), created_at=now(), policy_version=version, version=version, path=path
        )
        outputs = [(self.ctx.names.stream(N.WEIGHTS), encode(event))]
        if metrics is not None:
            outputs.append((self.ctx.names.stream(N.METRICS), encode(metrics)))
        await self.consumer.ack_many(
            entry_ids,
            self.ctx.names.dedup("learner", f"step-{version}"),
            outputs,
            settled=list(groups) if groups else None,
        )

    async def _trim_events(self) -> None:
        """Event streams have no consumer group to trim by: keep the newest N of each."""
        keys = [self.ctx.names.stream(s) for s in (N.WEIGHTS, N.METRICS)]
        await trim_events(self.ctx.client, keys, self.ctx.config.queues.retain_events)

    async def _finish_interrupted_step(self) -> None:
        """Re-announce the latest saved step: a no-op unless we crashed before announcing."""
        if not self.version:
            return
        last = self.ledger.last()
        current = last is not None and last.version == self.version
        entry_ids = last.entry_ids if last is not None and current else []
        groups = last.episode_ids if last is not None and current else []
        path = version_dir(self.root, self.version)
        saved = path / STEP_METRICS_FILE
        metrics = decode(saved.read_bytes(), StepMetrics) if saved.exists() else None
        await self._announce(self.version, str(path), entry_ids, metrics, groups)


async def serve(ctx: ActorContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    # One learner per run: a fixed consumer name, so a restarted learner drains its own
    # pending entries (the groups it was collecting) first.
    async with ctx.consumer(N.TRAJECTORIES, "learner", consumer="learner-0") as consumer:
        learner = await trio.to_thread.run_sync(Learner, ctx, consumer)
        await learner.serve(task_status=task_status)


def main(argv: list[str] | None = None) -> int:
    """``torchrun --nproc-per-node N -m streamrl.actors.learner --config FILE [--set k=v]``: rank
    0 is the learner actor (Redis, checkpoints, publishing), the other ranks follow it.
    Without torchrun it is the plain single-process learner."""
    import argparse

    from streamrl.config.schema import load_config
    from streamrl.runtime.logs import configure_logging
    from streamrl.runtime.process import run_actor

    parser = argparse.ArgumentParser(prog="python -m streamrl.actors.learner")
    parser.add_argument("--config", default=None)
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.overrides)
    distributed = dist_util.init_from_env()
    configure_logging(actor=f"learner-rank{dist_util.rank()}" if distributed else "learner")
    try:
        if dist_util.rank() == 0:
            trio.run(run_actor, "learner", config)
        else:
            follow(config)
    finally:
        if distributed:
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
