"""Learner: verified groups become policy updates (``trajectories`` -> ``weights``).

Per step: read ``groups_per_step`` groups (while the step before trains), drop (acknowledge
and count) groups sampled more than ``max_staleness`` versions before the version they are
trained at, take one GRPO/PPO-clipped step, write the new weights
as ``weights/v{step}`` (Hugging Face safetensors), then publish the ``weights`` event and
the step's metrics and acknowledge the groups, in one atomic hand-off.

A batch without learning signal (every group's rewards equal: every advantage zero; the
trainer skips it, :attr:`learner.train.StepStats.skipped`) is no step: no version, no
metrics, no checkpoint. Its groups are acknowledged and counted (``count:no_signal``: the
summary's ``skipped_no_signal`` and the progress line), each freeing its admission slot
(a count in admission's D), so the scheduler replaces them; every rank skips alike. With
``learner.step_without_signal`` (wiring checks with a model that earns no reward) it is
published anyway, its metrics marked ``no_signal``.

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

Supervised fine-tuning (``learner.mode = "sft"``): the learner does not read ``trajectories``;
each step takes the next ``learner.sft.examples_per_step`` positions of its data set's
order (:mod:`learner.sft_data`: a function of the seed and the examples) and trains them
with the token cross-entropy, then checkpoints, publishes and announces the version exactly
as an RL step does. The ledger line of step N lists its examples' ids, which carry their
positions, so a restarted learner continues at the position after the last one its ledger
holds: every position is trained exactly once, in order, across crashes (a step that crashed
before its weights were complete is cut from the ledger and taken again).

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

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import outcome
import structlog
import torch
import trio

from streamrl.actors.weight_sync import ServerSync
from streamrl.config.schema import Config, LoraConfig
from streamrl.learner import distributed as dist_util
from streamrl.learner import fsdp
from streamrl.learner.batch import build_batch
from streamrl.learner.checkpoint import (
    Ledger,
    Snapshot,
    StepRecord,
    load_trainer_state,
    prune_trainer_states,
    save_state_dict,
)
from streamrl.learner.lora import LoraExport, LoraSettings
from streamrl.learner.sft_data import SFTData, load_sft_data, next_position
from streamrl.learner.train import Mode, StepStats, TrainConfig, Trainer, rng_state
from streamrl.learner.weights import latest_version, save_weights, version_dir
from streamrl.models import load_tokenizer, model_limits, resolve_model, vocab_size
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
from streamrl.runtime.batches import BatchRuntime, BatchSettings, Held, Settlement, open_batches
from streamrl.runtime.context import ActorContext
from streamrl.runtime.metrics import (
    record_dropped_stale,
    record_learner_step,
    record_policy_version,
    record_step_overdue,
)
from streamrl.runtime.policies import Policies
from streamrl.runtime.serve import Count, Output

log = structlog.get_logger()
T = TypeVar("T")

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
        updates_per_step=cfg.updates_per_step,
        max_tokens_per_micro_batch=cfg.max_tokens_per_micro_batch,
        logprob_chunk_tokens=cfg.logprob_chunk_tokens,
        grad_checkpointing=cfg.grad_checkpointing,
        shared_prefix=cfg.shared_prefix,
        seed=config.run.seed,
        num_threads=cfg.threads or None,
        tis_cap=cfg.tis_cap,
        recompute_old_logprobs=cfg.recompute_old_logprobs,
        kl_coef=cfg.kl_coef,
        clip_eps_high=cfg.clip_eps_high or None,
        objective=cfg.objective,
        aggregation=cfg.aggregation,
        aggregation_tokens=cfg.aggregation_tokens,
        advantage_std=cfg.advantage_std,
        is_mode=cfg.is_mode,
        is_level=cfg.is_level,
        is_low=cfg.is_low,
        kl_estimator=cfg.kl_estimator,
        kl_in_reward=cfg.kl_in_reward,
        entropy_coef=cfg.entropy_coef,
        overlong_filter=cfg.overlong_filter,
        length_penalty_tokens=cfg.length_penalty_tokens,
        warmup_steps=cfg.warmup_steps,
        lr_decay=cfg.lr_decay,
        lr_decay_steps=cfg.lr_decay_steps or cfg.max_steps * cfg.updates_per_step,
        min_lr_ratio=cfg.min_lr_ratio,
        device=device or cfg.device,
        parallelism=cfg.parallelism,
        lora=lora_settings(cfg.lora),
    )


def lora_settings(cfg: LoraConfig) -> LoraSettings | None:
    """``[learner.lora]`` as the trainer's settings (None: full fine-tuning)."""
    if not cfg.enabled:
        return None
    return LoraSettings(rank=cfg.rank, alpha=cfg.alpha, dropout=cfg.dropout,
                        target_modules=tuple(cfg.target_modules), publish=cfg.publish)


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
    settings = train_config(config, device)
    if settings.lora is None:
        trainer = Trainer.from_dir(start, settings, ref_dir=base_dir)
    else:  # the base as loaded, the adapters from the version (adapter/ when merged)
        trainer = Trainer.from_dir(base_dir, settings)
        if version:
            trainer.load_adapter(start)
    if version and (start / fsdp.SHARDED_DIR).is_dir():  # written by FSDP ranks: resharded
        trainer.load_sharded(start)
        return trainer, version, True
    # AdamW state saved whole (DDP, one process) does not load into sharded parameters: an
    # FSDP run resuming such a version starts a fresh optimiser (logged: resumed_optimizer)
    state = load_trainer_state(start) if version and trainer.fsdp is None else None
    if state is not None:
        trainer.load_optimizer_state(state)
    return trainer, version, state is not None


def distributed_step(
    trainer: Trainer, trajectories: list[Trajectory], mode: Mode = "rl"
) -> StepStats:
    """Rank 0's step: send the groups to the other ranks (a no-op alone), then step."""
    dist_util.broadcast_payloads([encode(t) for t in trajectories])
    return trainer.step(trajectories, mode=mode)


def open_sft_data(config: Config) -> SFTData:
    """The examples of ``learner.sft`` rendered with the model's tokenizer: ids within its
    vocabulary, at most ``max_tokens`` (default: its positions) each. Raises
    :class:`learner.sft_data.RowError` naming the first bad row (unless ``skip_bad_rows``)."""
    cfg = config.learner.sft
    model_dir = resolve_model(config.model.spec)
    positions = model_limits(config.model.spec)[1]
    data = load_sft_data(
        cfg.data, load_tokenizer(model_dir), vocab=vocab_size(model_dir),
        max_tokens=min(cfg.max_tokens or positions, positions), split=cfg.split,
        seed=config.run.seed * 1_000_003 + cfg.seed, skip_bad_rows=cfg.skip_bad_rows,
    )  # fmt: skip
    for why in data.refused:
        log.warning("sft row left out", reason=why[:500])
    log.info("sft data", data=cfg.data, examples=len(data.examples), refused=len(data.refused),
             fingerprint=data.fingerprint)  # fmt: skip
    return data


def follow(config: Config) -> int:
    """Ranks > 0 of a distributed learner: take every step rank 0 takes, on the groups it
    broadcasts, until it broadcasts an empty step (its end). No Redis; under FSDP each rank
    joins rank 0's snapshot after each step (the gather of the weights, and its own shards
    of the checkpoint). Returns the number of steps taken."""
    trainer, _, _ = open_trainer(config)
    snapshot = fsdp.ShardedSnapshot(config.run.path / "weights") if trainer.fsdp else None
    optimizer = trainer.optimizer if config.learner.checkpoint_optimizer else None
    steps = 0
    while payloads := dist_util.broadcast_payloads(None):
        stats = trainer.step([decode(p, Trajectory) for p in payloads], mode=config.learner.mode)
        if stats.skipped and not config.learner.step_without_signal:
            continue  # no signal: rank 0 publishes nothing, so takes no snapshot either
        if snapshot is not None:
            snapshot.take(trainer.model, optimizer, trainer.steps, rng_state())
        steps += 1
    return steps


Batch = list[Held[Trajectory]]


class Learner:
    def __init__(self, ctx: ActorContext, consumer: Consumer) -> None:
        self.ctx = ctx
        self.cfg = ctx.config.learner
        self.staleness = ctx.staleness()
        self.consumer = consumer
        self.distributed = dist_util.is_distributed()
        self.root = ctx.config.run.path / "weights"
        self.base_dir = resolve_model(ctx.config.model.spec)
        self.trainer, self.version, self.resumed_optimizer = open_trainer(ctx.config)
        self.ledger = Ledger.open(self.root, self.version)
        self.sft = open_sft_data(ctx.config) if self.cfg.mode == "sft" else None
        self.sft_position = next_position(self.ledger.consumed, self.sft) if self.sft else 0
        """The first position of the SFT data set's order not trained yet."""
        self.dropped_stale = 0
        self.snapshot: Snapshot | fsdp.ShardedSnapshot | None = None
        self.collecting = self.version
        """The version the batch being collected will be trained at."""
        self._refill = trio.Event()
        self.claimed: set[str] = set()
        """Episodes of the steps collected, training or being checkpointed (not yet in the
        ledger)."""
        self.duplicates_skipped = 0
        self.server_sync: ServerSync | None = None
        """Set while :meth:`serve` runs with ``weight_sync = "broadcast"``."""
        self.batches: BatchRuntime[Trajectory]
        """Set while :meth:`serve` runs."""

    def batch_runtime(self) -> AbstractAsyncContextManager[BatchRuntime[Trajectory]]:
        """The batch runtime on the learner's consumer: the one decode -> dead-letter path
        and delivery limit, held groups heart-beaten, lost deliveries taken back (the
        learner is its group's only consumer). Retries with isolation of a failing group in
        one process; a distributed learner fails loudly instead (its other ranks take every
        step with it: a retried or probed step would leave them behind)."""
        policies = self.ctx.policies(time_limit_s=0)
        if self.distributed:
            policies = Policies(dataclasses.replace(policies.retry, max_retries=0))
        q = self.ctx.config.queues
        settings = BatchSettings(heartbeat_interval_s=q.heartbeat_interval_s, sole_consumer=True)
        return open_batches(self.consumer, STAGE, Trajectory, policies, settings)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> bool:
        """Train until the run ends; returns whether it released the other ranks of a
        distributed learner (broadcast the end; False in one process, and when it did not
        end normally: the other ranks then still wait in a step's broadcast)."""
        async with self.batch_runtime() as self.batches, self._server_sync():
            await self._serve(task_status)
        if not self.distributed:
            return False
        await trio.to_thread.run_sync(dist_util.broadcast_payloads, [])  # the end
        return True

    @contextlib.asynccontextmanager
    async def _server_sync(self) -> AsyncIterator[None]:
        """``learner.weight_sync = "broadcast"``: the weight-update group with the inference
        servers, for the time the learner serves (:mod:`actors.weight_sync`)."""
        if self.cfg.weight_sync != "broadcast" or not self.ctx.config.generator.server_urls:
            yield
            return
        timeout = httpx.Timeout(self.cfg.broadcast_timeout_s, connect=10.0)
        async with httpx.AsyncClient(timeout=timeout) as client:
            self.server_sync = ServerSync(self.ctx.config, client)
            await self.server_sync.open()
            try:
                yield
            finally:
                self.server_sync = None

    async def _serve(self, task_status: Any) -> None:
        await self._finish_interrupted_step()
        record_policy_version(self.ctx.names.run, self.version)
        task_status.started()
        log.info(
            "learner ready",
            mode=self.cfg.mode,
            policy_version=self.version,
            trained_groups=len(self.ledger.consumed),
            resumed_optimizer=self.resumed_optimizer,
            **({"sft_position": self.sft_position} if self.sft else {}),
        )
        if self.sft is not None:
            await self._train_sft(self.sft)
            return
        # Step N+1 runs while step N's checkpoint is written and announced (from a snapshot
        # of the weights); at most one step is being published at a time, in order. The
        # groups of step N+1 are collected while step N trains (``_prefetch``).
        batches, received = trio.open_memory_channel[Batch](0)
        async with trio.open_nursery() as reading:
            reading.start_soon(self._prefetch, batches)
            async with received:
                await self._train(received)
            reading.cancel_scope.cancel()  # at max_steps: nothing more to collect

    async def _train(self, batches: trio.MemoryReceiveChannel[Batch]) -> None:
        """Take a step on each batch (a failing group isolated and dead-lettered by the
        runtime: :meth:`runtime.batches.BatchRuntime.handle`), publishing each step while the
        next one trains, until ``max_steps``."""
        published = trio.Event()
        published.set()
        async with trio.open_nursery() as nursery:
            while not self.cfg.max_steps or self.version < self.cfg.max_steps:
                t0 = time.monotonic()
                collected = await batches.receive()
                waited = time.monotonic() - t0
                stats, batch = await self.batches.handle(collected, self._step, self.probe)
                self.claimed -= {h.message.episode_id for h in collected if h not in batch}
                skip = stats is not None and stats.skipped and not self.cfg.step_without_signal
                if skip:  # no learning signal: its groups settled, no version
                    await self._skip_no_signal(batch)
                if stats is None or skip:  # every group dead-lettered, or no signal: no step
                    self.collecting -= 1
                    self._refill.set()
                    continue
                await published.wait()  # the shadow model is free again
                state = await trio.to_thread.run_sync(self._snapshot)
                self.version += 1
                published = trio.Event()
                nursery.start_soon(
                    self._publish_step, [h.message for h in batch], [h.entry_id for h in batch],
                    stats, waited, self.version, state, published,
                )

    async def _train_sft(self, data: SFTData) -> None:
        """Take a step on each next ``examples_per_step`` positions of the SFT data set,
        publishing each step while the next one trains, until ``max_steps``. A step that
        raises stops the learner (the rows were checked at start: it is our failure); its
        restart takes the same positions again."""
        published = trio.Event()
        published.set()
        n = self.cfg.sft.examples_per_step
        async with trio.open_nursery() as nursery:
            while not self.cfg.max_steps or self.version < self.cfg.max_steps:
                examples = data.trajectories(self.sft_position, n, self.version)
                stats = await self._step(examples)
                self.sft_position += n
                await published.wait()  # the shadow model is free again
                state = await trio.to_thread.run_sync(self._snapshot)
                self.version += 1
                published = trio.Event()
                nursery.start_soon(self._publish_step, examples, [], stats, 0.0, self.version,
                                   state, published)  # fmt: skip

    async def _step(self, trajectories: list[Trajectory]) -> StepStats:
        mode = self.cfg.mode
        if self.distributed:
            work = partial(distributed_step, self.trainer, trajectories, mode)
        else:
            work = partial(self.trainer.step, trajectories, mode=mode)
        return await self._watched(work, len(trajectories))

    @property
    def probe(self) -> Callable[[Trajectory], Awaitable[None]] | None:
        """How the runtime isolates a group that fails the step: a probe step on it alone,
        in one process. None in a distributed learner (it fails loudly instead): a probe is
        rank 0's alone, and its collectives would wait for ranks that only take the steps
        rank 0 broadcasts (different collectives on different ranks: a hang)."""
        return None if self.distributed else self._probe

    async def _probe(self, trajectory: Trajectory) -> None:
        """The step's forward and backward passes on one group, the weights untouched."""

        def probe() -> None:
            self.trainer.step([trajectory], apply=False)

        await self._watched(probe, 1)

    async def _watched(self, work: Callable[[], T], groups: int) -> T:
        """``work`` (a step, or a probe of one group) run to its end in a worker thread (it
        cannot be cancelled), reported if it still runs ``learner.step_deadline_s`` after it
        began: an error log line and ``streamrl_learner_steps_overdue``, then its duration
        when it ends. Under torchrun a rank waiting in a collective that another rank skipped
        waits for ever; nothing else would say so."""
        deadline = self.cfg.step_deadline_s
        started = trio.current_time()
        overdue = False

        async def watch() -> None:
            nonlocal overdue
            await trio.sleep(deadline)
            overdue = True
            record_step_overdue(self.ctx.names.run)
            log.error("learner step past its deadline", deadline_s=deadline, groups=groups,
                      policy_version=self.version, distributed=self.distributed)  # fmt: skip

        async def run() -> T:
            return await trio.to_thread.run_sync(work, abandon_on_cancel=False)

        async with trio.open_nursery() as nursery:
            if deadline > 0:
                nursery.start_soon(watch)
            result = await outcome.acapture(run)  # its exception re-raised outside the nursery
            nursery.cancel_scope.cancel()
        if overdue:
            log.warning("overdue learner step finished", groups=groups,
                        seconds=round(trio.current_time() - started, 3))  # fmt: skip
        return result.unwrap()

    async def _prefetch(self, batches: trio.MemorySendChannel[Batch]) -> None:
        """Collect each step's groups while the step before it trains, so a learner whose
        groups are ready does not wait for reading, decoding and checking them. The groups
        are judged for staleness at the version they will be trained at (one more than now,
        while a step runs; a step that dead-lettered all its groups is no step, so the next
        batch comes one version earlier); each batch is handed over only when the learner
        takes it."""
        async with batches:
            while True:
                if self.cfg.max_steps and self.collecting >= self.cfg.max_steps:
                    self._refill = trio.Event()
                    await self._refill.wait()
                    continue
                batch = await self._collect(self.cfg.groups_per_step, self.collecting)
                self.claimed |= {h.message.episode_id for h in batch}
                await batches.send(batch)
                self.collecting += 1

    async def _collect(self, n: int, version: int) -> Batch:
        """``n`` trainable groups to train at ``version``; fewer only for the last step of a
        run with ``scheduler.max_train_groups``, once no further group can arrive (see
        :meth:`_run_drained`): groups dropped upstream (zero variance, dead letters, stale)
        would otherwise leave a part-filled last batch waiting forever."""

        async def accept(held: Held[Trajectory], batch: Sequence[Held[Trajectory]]) -> bool:
            return await self._accept(held, {h.message.episode_id for h in batch}, version)

        batch = await self.batches.collect(n, accept=accept, enough=self._run_drained)
        if len(batch) < n:
            log.info("final partial step", groups=len(batch), groups_per_step=n)
        return batch

    async def _run_drained(self) -> bool:
        """Whether no training group can reach the learner any more: admission closed and
        nothing left upstream (:func:`streamrl.protocol.admission.run_drained`)."""
        limit = self.ctx.config.scheduler.max_train_groups
        return await run_drained(self.ctx.client, self.ctx.names, limit)

    async def _accept(self, held: Held[Trajectory], in_batch: set[str], version: int) -> bool:
        """Skip groups already trained (or taken for a step not yet checkpointed), check
        staleness against ``version``; anything not trainable is settled (acknowledged or
        dead-lettered) here."""
        traj = held.message
        if training_group(traj) is None:  # an evaluation result, or a task of another split
            task = traj.rollout.task
            reason = f"not a training group: split {task.split!r}, eval round {task.eval_round}"
            await self.batches.dead_letter(held, reason, frees_ticket=False)
            return False
        try:  # what the training step would refuse (killing the learner), refused here alone
            build_batch([traj])
        except ValueError as exc:
            await self.batches.dead_letter(held, f"malformed group: {exc}")
            return False
        seen = self.ledger.consumed, self.claimed, in_batch
        if any(traj.episode_id in ids for ids in seen):
            self.duplicates_skipped += 1
            await self._settle(held, "duplicates_skipped", f"duplicate-{held.entry_id}")
            log.warning("skipped group already trained", episode_id=traj.episode_id)
            return False
        if self.staleness.too_stale(traj, version):
            staleness = self.staleness.staleness(traj, version)
            self.dropped_stale += 1
            record_dropped_stale(self.ctx.names.run)
            await self._settle(
                held, "dropped_stale", f"stale-{traj.episode_id}", frees_slot=True
            )
            log.warning("dropped stale group", episode_id=traj.episode_id, staleness=staleness)
            return False
        return True

    async def _skip_no_signal(self, batch: Batch) -> None:
        """Settle the groups of a batch without learning signal: acknowledged, counted in
        ``no_signal`` once each, their admission slots freed; no version is made of them."""
        for held in batch:
            await self._settle(held, "no_signal", f"nosignal-{held.message.episode_id}",
                               frees_slot=True)
            self.claimed.discard(held.message.episode_id)
        log.info("no signal: no step", groups=len(batch), policy_version=self.version,
                 reward_mean=[sum(h.message.rewards) / len(h.message.rewards) for h in batch])

    async def _settle(
        self, held: Held[Trajectory], counter: str, once: str, *, frees_slot: bool = False
    ) -> None:
        """Acknowledge a group that is not trained (a duplicate, stale), taking it out of the
        admission record and adding one to ``counter`` with its acknowledgement, in one
        script. The count is guarded by the dedup key ``once`` (``dedup:learner:*``): a
        replayed settlement (the entry redelivered or reclaimed, a repeated call) counts
        nothing. Duplicates count once per entry. A stale drop (``frees_slot``: a count in
        admission's D) counts only if this settlement took the group out of the admission
        record: a group settled already (dead-lettered upstream, counted in ``dead_groups``;
        dropped by an earlier entry of it) or never admitted frees no second slot."""
        dedup = self.consumer.names.dedup("learner", once)
        await self.batches.settle([held.entry_id], Settlement(
            dedup, counts=[Count(counter)], tickets=[held.message.episode_id],
            only_settling=frees_slot,
        ))  # fmt: skip

    def _snapshot(self) -> dict[str, Any] | None:
        optimizer = self.trainer.optimizer if self.cfg.checkpoint_optimizer else None
        if self.trainer.fsdp is not None:  # a collective: the other ranks take it too
            if self.snapshot is None:
                self.snapshot = fsdp.ShardedSnapshot(self.root)
            self.snapshot.take(self.trainer.model, optimizer, self.trainer.steps, rng_state())
            return None
        if self.snapshot is None:
            self.snapshot = Snapshot(self.trainer.policy)
        return self.snapshot.take(self.trainer.policy, optimizer, self.trainer.steps, rng_state())

    async def _publish_step(
        self,
        trajectories: list[Trajectory],
        entry_ids: list[str],
        stats: StepStats,
        waited: float,
        version: int,
        state: dict[str, Any] | None,
        done: trio.Event,
    ) -> None:
        """Checkpoint, announce and acknowledge one step: its groups (``entry_ids``: their
        entries in ``trajectories``; none for SFT examples)."""
        record = StepRecord(
            version=version,
            episode_ids=[t.episode_id for t in trajectories],
            trajectory_ids=[t.id for t in trajectories],
            entry_ids=entry_ids,
        )
        staleness = [self.staleness.staleness(t, version - 1) for t in trajectories]
        metrics = StepMetrics(
            id=new_id(),
            created_at=now(),
            policy_version=version,
            step=version,
            loss=stats.loss,
            grad_norm=stats.grad_norm,
            reward_mean=stats.reward_mean,
            groups=len(trajectories),
            samples=sum(len(t.rewards) for t in trajectories),
            tokens=stats.tokens,
            dropped_stale=self.dropped_stale,
            max_staleness_seen=max(staleness, default=0),
            step_seconds=stats.seconds,
            wait_seconds=waited,
            lr=stats.lr,
            entropy=stats.entropy,
            clip_frac=stats.clip_frac,
            is_clip_frac=stats.is_clip_frac,
            kl_ref=stats.kl_ref,
            mismatch_kl=stats.mismatch_kl,
            mismatch_ratio_min=stats.mismatch_ratio_min,
            mismatch_ratio_mean=stats.mismatch_ratio_mean,
            mismatch_ratio_max=stats.mismatch_ratio_max,
            no_signal=stats.skipped,
        )
        path = await trio.to_thread.run_sync(self._checkpoint, record, metrics, state)
        if self.server_sync is not None:  # the servers on this version before it is announced
            assert self.snapshot is not None and self.snapshot.model is not None
            await self.server_sync.push(self.snapshot.model, str(path), version)
        await self._announce(version, str(path), record.entry_ids, metrics, record.episode_ids)
        record_learner_step(
            self.ctx.names.run, metrics, trajectories, staleness,
            kl_ref=stats.kl_ref, approx_kl=stats.approx_kl,
        )
        self.claimed -= set(record.episode_ids)  # in the ledger now
        done.set()
        await self._trim_events()
        log.info(
            "step",
            policy_version=version,
            loss=stats.loss,
            reward_mean=stats.reward_mean,
            grad_norm=stats.grad_norm,
            entropy=round(stats.entropy, 4),
            mismatch_kl=round(stats.mismatch_kl, 6),
            mismatch_ratio=(round(stats.mismatch_ratio_min, 4), round(stats.mismatch_ratio_max, 4)),
            clip_frac=round(stats.clip_frac, 4),
            no_signal=stats.skipped,
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
            if isinstance(self.snapshot, fsdp.ShardedSnapshot):
                self.snapshot.move_into(directory)
            elif state is not None:
                save_state_dict(state, directory)

        lora = self.trainer.config.lora
        path = save_weights(
            self.snapshot.model if lora is None else LoraExport(self.snapshot.model, lora.publish),
            self.base_dir,
            self.root,
            record.version,
            self.cfg.keep_last,
            extra=extra,
        )
        prune_trainer_states(self.root, keep=record.version)
        fsdp.prune_sharded(self.root, keep=record.version)
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
        outputs = [Output(N.WEIGHTS, event)]
        if metrics is not None:
            outputs.append(Output(N.METRICS, metrics))
        dedup = self.ctx.names.dedup("learner", f"step-{version}")
        await self.batches.settle(entry_ids, Settlement(dedup, outputs, tickets=groups))

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


async def serve(ctx: ActorContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> bool:
    """The learner actor; returns :meth:`Learner.serve`'s (whether the other ranks were
    released)."""
    # One learner per run: a fixed consumer name, so a restarted learner drains its own
    # pending entries (the groups it was collecting) first.
    async with ctx.consumer(N.TRAJECTORIES, "learner", consumer="learner-0") as consumer:
        learner = await trio.to_thread.run_sync(Learner, ctx, consumer)
        return await learner.serve(task_status=task_status)


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
    released = False
    try:
        if dist_util.rank() == 0:
            released = bool(trio.run(run_actor, "learner", config))
        else:
            follow(config)
            released = True  # rank 0 released it
    finally:
        if distributed:
            if released:  # every rank tears down together: a gloo rank whose peer already
                # closed its connections can abort in its IO thread while it destroys its
                # group ("terminate called without an active exception", SIGABRT, seen once
                # in CI). Only after rank 0's release: before it, the other ranks wait in a
                # step's broadcast, which a barrier must not meet.
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
