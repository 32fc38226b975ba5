"""Scheduler: samples tasks from the configured domains and admits them into ``tasks``.

Admission guarantees:
- staleness: training group number k is admitted only once the learner's policy version V
  satisfies ``k < (V + max_staleness + 1) * groups_per_step + D`` (D: groups that will
  never be trained: dropped as stale by the learner or settled by it in a batch without
  learning signal, skipped for zero reward variance by the verifier, or dead-lettered at
  any stage and not requeued; each is replaced once),
  so every admitted group can still be
  trained within ``max_staleness`` versions of the policy that samples it; the count of
  admitted groups lives in Redis, so a restarted scheduler keeps the bound. With
  ``max_staleness = 0`` this is the synchronous mode's batch barrier: the next batch is
  admitted only once the learner published the version trained on the previous one;
- backpressure: nothing is added while the generator group's backlog (lag + pending)
  exceeds ``max_backlog``, the tasks of the held-out round this scheduler published last
  not counted (:meth:`Scheduler.held_out_queued`): training is admitted beside a round, so
  the learner's first step does not wait for the whole first round (a scheduler restarted
  during a round counts that round's tasks as backlog);
- limit: at most ``max_train_groups`` training groups per run (0: no limit);
- supervised runs: none while ``learner.mode = "sft"`` (the learner trains on its data set;
  the held-out rounds go on, so the run is evaluated as it learns);
- the staleness and limit bounds are exact: tasks and the counter move together in one
  compare-and-set script, which adds nothing when replayed or when the counter has moved;
  each count in D is written by the atomic hand-off that causes it, under its dedup key
  (the verifier's ``zero_variance``, the learner's ``dropped_stale`` and ``no_signal``, a
  dead letter's ``dead_groups``), so a replayed hand-off (redelivery, reclaim, a repeated
  script call) does not count a group twice; on a sharded run these counters are per shard, in the
  shard's slot with its hand-offs, and summed here;
  on a sharded run (``queues.shards`` > 1) tasks are routed to the shard of their episode
  and the counter stays run-global (``admitted``), so they cannot share a script: the
  admission is counted together with a write-ahead record of its tasks, then published
  into each shard once (:func:`queues.shards.publish_counted_routed`); a scheduler that
  died in between has the rest published at its next start. The backlog is the generator
  group's, summed over the shards;
- evaluation: a held-out round (greedy, one sample per item) is published at version 0 and
  every ``eval_every`` versions; evaluation bypasses the staleness bound;
- domains: which domain each training task comes from is decided by
  :class:`actors.scheduling.FairShare` (weights, priorities and in-flight caps from the
  ``[domain.<name>]`` tables; with ``scheduler.adaptive``, re-weighted toward the target
  ratios of trained samples from the verifier's per-domain counters); a domain's items in
  epochs without replacement (:class:`actors.scheduling.EpochOrder`), and a domain with
  difficulty levels moves up one when its recent train reward passes its curriculum
  threshold (:class:`actors.scheduling.Climb`), unless that level has no usable item: the
  domain is then held below it for the run, and why is recorded for ``streamrl status``
  (:mod:`protocol.curriculum`);
- quarantine: a domain with ``quarantine_after`` of its last ``quarantine_window`` groups
  dead-lettered (:class:`actors.scheduling.Quarantine`, fed the dead-letter script's
  per-domain counters) is quarantined in Redis (:mod:`protocol.quarantine`, run-global, so a
  restarted scheduler keeps it) and gets no new training tasks, its share going to the
  others, until the operator lifts it (``streamrl domains lift``); its held-out items are
  still published in every round, so that each round can end.
Once the run's stop flag is set, no more training tasks are admitted.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import msgspec
import structlog
import trio

from streamrl.actors.scheduling import (
    Climb,
    EpochOrder,
    FairShare,
    Quarantine,
    Share,
    reward_counters,
    stable_seed,
)
from streamrl.config.schema import Config
from streamrl.domains.registry import get_domain
from streamrl.models import load_tokenizer, model_limits
from streamrl.protocol import curriculum as C
from streamrl.protocol import names as N
from streamrl.protocol import quarantine as Q
from streamrl.protocol.admission import (
    admission_state,
    counted,
    domain_counts,
    staleness_room,
)
from streamrl.protocol.messages import Sampling, Task, WeightsPublished, new_id, now
from streamrl.protocol.versions import VersionFollower
from streamrl.queues.codec import encode
from streamrl.queues.operations import increment, read_counter
from streamrl.queues.shards import finish_counted, publish_counted_routed
from streamrl.queues.stats import group_state, still_queued
from streamrl.queues.streams import EventReader
from streamrl.runtime import metrics
from streamrl.runtime.context import ActorContext

log = structlog.get_logger()


def make_task(
    domain: str,
    item: Any,
    *,
    split: str,
    group_size: int,
    sampling: Sampling,
    version: int,
    eval_round: int = -1,
) -> Task:
    spec = msgspec.to_builtins(item)
    return Task(
        id=new_id(),
        created_at=now(),
        policy_version=version,
        domain=domain,
        item_id=str(spec.get("id", "")),
        split=split,
        prompt=str(spec.get("prompt", "")),
        spec=spec,
        group_size=group_size,
        sampling=sampling,
        eval_round=eval_round,
    )


def domain_sampling(config: Config, name: str, temperature: float) -> Sampling:
    """Sampling for tasks of domain ``name``: its own token budget if its table sets one."""
    budget = config.domain_config(name).max_new_tokens or config.scheduler.max_new_tokens
    return Sampling(max_new_tokens=budget, temperature=temperature)


def shares(config: Config) -> list[Share]:
    return [
        Share(name, weight=d.weight, priority=d.priority, max_inflight=d.max_inflight)
        for name in config.scheduler.domains
        for d in [config.domain_config(name)]
    ]


CURRICULUM_CHECK_S = 5.0
HEALTH_CHECK_S = 1.0
"""How often the scheduler checks its domains' failures and the operator's lifts."""


def climbs(config: Config) -> dict[str, Climb]:
    """The curriculum of every trained domain with one (``[domain.<name>.curriculum]``
    threshold > 0, and difficulty levels: a ``levels()`` method returning more than 1)."""
    out = {}
    for name in config.scheduler.domains:
        cur = config.domain_config(name).curriculum
        levels = getattr(get_domain(name), "levels", None)
        if cur.threshold > 0 and levels is not None and levels() > 1:
            out[name] = Climb(levels(), cur.threshold, cur.min_groups)
    return out


def eval_domains(config: Config) -> list[str]:
    """The domains of a held-out round: the trained ones, then the evaluation-only ones."""
    names = config.scheduler.domains + config.scheduler.eval_domains
    return list(dict.fromkeys(names))


_BUDGETS: dict[str, tuple[Any, int]] = {}
_FITTING: dict[tuple[str, str, str, int, int], list[Any]] = {}


def fitting_items(config: Config, name: str, items: list[Any], what: str) -> list[Any]:
    """``items`` of domain ``name`` without those whose first prompt (rendered with the
    model's chat template) plus the domain's ``max_new_tokens`` is over the model's positions
    (``scheduler.drop_overlong``; the dropped ones are logged). ``what``: which items (the
    split, or a curriculum level), for the log and the cache."""
    if not config.scheduler.drop_overlong or not items:
        return items
    spec = config.model.spec
    max_new = domain_sampling(config, name, 0.0).max_new_tokens
    key = (spec, name, what, len(items), max_new)
    if key not in _FITTING:
        if spec not in _BUDGETS:
            tokenizer_dir, positions = model_limits(spec)
            _BUDGETS[spec] = (load_tokenizer(tokenizer_dir), positions)
        tokenizer, positions = _BUDGETS[spec]
        domain = get_domain(name)
        keep = [it for it in items
                if len(domain.render_prompt(it, tokenizer)) + max_new <= positions]  # fmt: skip
        if len(keep) < len(items):
            log.warning("items dropped: prompt + max_new_tokens over the model's positions",
                        domain=name, items=what, dropped=len(items) - len(keep),
                        kept=len(keep), positions=positions, max_new_tokens=max_new)  # fmt: skip
        _FITTING[key] = keep
    return _FITTING[key]


def eval_items(config: Config, name: str) -> list[Any]:
    """The held-out items of ``name`` in each round: its first ``eval_items`` (the domain's
    own, else ``scheduler.eval_items``) of those that fit the model, all it has when it has
    fewer."""
    n = config.domain_config(name).eval_items or config.scheduler.eval_items
    return fitting_items(config, name, get_domain(name).load_items("eval"), "eval")[:n]


def train_items(config: Config, name: str, level: int | None = None) -> list[Any]:
    """The train items of ``name`` (of curriculum ``level`` when given) that fit the model;
    raises ValueError when none does."""
    domain = get_domain(name)
    if level is None:
        items, what = domain.load_items("train"), "train"
    else:
        items, what = domain.level_items(level), f"train level {level}"  # type: ignore[attr-defined]
    kept = fitting_items(config, name, items, what)
    if items and not kept:
        raise ValueError(f"domain {name!r}: none of its {len(items)} {what} items fits the "
                         f"model ({config.model.spec}) with max_new_tokens; shorten its "
                         f"prompts (max_prompt_chars) or lower its max_new_tokens")
    return kept


def eval_round_size(config: Config) -> int:
    """Tasks in one held-out round."""
    return sum(len(eval_items(config, d)) for d in eval_domains(config))


async def publish_eval_round(
    ctx: ActorContext, round_no: int, version: int, *, skip: frozenset[str] = frozenset()
) -> int:
    """Publish one held-out evaluation round (none of the ``skip`` domains: quarantined);
    returns the number of tasks."""
    return len(await publish_eval_entries(ctx, round_no, version, skip=skip))


async def publish_eval_entries(
    ctx: ActorContext, round_no: int, version: int, *, skip: frozenset[str] = frozenset()
) -> list[str]:
    """:func:`publish_eval_round`, returning the entry ids of its tasks."""
    tasks = []
    for name in (d for d in eval_domains(ctx.config) if d not in skip):
        sampling = domain_sampling(ctx.config, name, 0.0)
        items = eval_items(ctx.config, name)
        tasks += [
            make_task(
                name,
                it,
                split="eval",
                group_size=1,
                sampling=sampling,
                version=version,
                eval_round=round_no,
            )
            for it in items
        ]
    ids = await ctx.publish_work(N.TASKS, [(t.episode_id, encode(t)) for t in tasks])
    log.info("eval round published", round=round_no, policy_version=version, tasks=len(tasks))
    return ids


async def latest_version(reader: EventReader, follower: VersionFollower | None = None) -> int:
    """The policy version the run's weights events reach (:mod:`protocol.versions`: an event
    far ahead of the chain of versions is refused); ``follower`` keeps following from it."""
    return await (follower or VersionFollower()).catch_up(reader)


class Scheduler:
    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.config.scheduler
        self.items = {d: train_items(ctx.config, d) for d in self.cfg.domains}
        self.orders = {d: self._order(d) for d in self.cfg.domains}
        self.climbs = climbs(ctx.config)
        self.next_climb_check = 0.0
        self.sampling = {
            d: domain_sampling(ctx.config, d, self.cfg.temperature) for d in self.cfg.domains
        }
        self.fair = FairShare(
            shares(ctx.config), adaptive=self.cfg.adaptive, min_pass=self.cfg.min_pass
        )
        self.blocked: str | None = None
        """Which bound held the last :meth:`admissible` at zero (``metrics.BLOCKED_REASONS``),
        None when it was not."""
        self.health = Quarantine(self.cfg.quarantine_after, self.cfg.quarantine_window)
        self.quarantined: frozenset[str] = frozenset()
        self.next_health_check = 0.0
        self.held_out: list[str] = []
        """Entry ids of the held-out round this scheduler published last, while some are
        still queued for the generators: they do not count against ``max_backlog``."""

    def sample(self, version: int) -> Task | None:
        """The next training task (its domain by fair share); None if every domain is at
        its in-flight cap."""
        domain = self.fair.pick()
        if domain is None:
            return None
        item = self.items[domain][self.orders[domain].next()]
        return make_task(
            domain,
            item,
            split="train",
            group_size=self.cfg.group_size,
            sampling=self.sampling[domain],
            version=version,
        )

    def _order(self, domain: str) -> EpochOrder:
        """Epochs without replacement over the domain's train items (its own seed)."""
        seed = stable_seed(self.ctx.config.run.seed, self.ctx.config.domain_config(domain).seed,
                           domain, len(self.items[domain]))
        return EpochOrder(len(self.items[domain]), seed)

    async def observe_curriculum(self) -> None:
        """Move each curriculum domain up a level once its recent train reward passed its
        threshold (:class:`actors.scheduling.Climb`; read every few seconds): its train items
        are then those of the new level."""
        if trio.current_time() < self.next_climb_check:
            return
        self.next_climb_check = trio.current_time() + CURRICULUM_CHECK_S
        for name, climb in self.climbs.items():
            groups_counter, reward_counter = reward_counters(name)
            groups = await self.counted(groups_counter)
            reward = await self.counted(reward_counter) / 1000
            if climb.observe(groups, reward):
                try:
                    self.items[name] = train_items(self.ctx.config, name, climb.level)
                except ValueError as exc:  # no usable item there: it stays below, for good
                    await self.hold_back(name, climb, str(exc))
                    continue
                self.orders[name] = self._order(name)
                failures = getattr(get_domain(name), "generation_failures", None)
                failed = len(failures(climb.level)) if failures is not None else 0
                log.info("curriculum level up", domain=name, level=climb.level,
                         items=len(self.items[name]), failed_to_generate=failed)

    async def hold_back(self, name: str, climb: Climb, reason: str) -> None:
        """Keep ``name`` at the level below ``climb.level`` for the rest of the run, and say
        why where ``streamrl status`` reads it (:mod:`protocol.curriculum`)."""
        levels = climb.levels
        climb.level -= 1
        climb.levels = climb.level + 1
        log.warning("curriculum level not taken", domain=name, level=climb.level + 1,
                    reason=reason)  # fmt: skip
        held = C.Held(level=climb.level, levels=levels, reason=reason, at=time.time())
        await C.hold(self.ctx.client, self.ctx.names, name, held)

    async def observe_domains(self) -> None:
        """Feed the per-domain counters (resolved, trained groups) to the share, and the
        failures to the quarantine (:meth:`observe_health`)."""
        c = self.ctx
        resolved, trained = await domain_counts(c.client, c.names, list(self.cfg.domains))
        self.fair.observe(resolved, trained)
        if self.cfg.quarantine_after:
            await self.observe_health(resolved)

    async def observe_health(self, resolved: dict[str, int]) -> None:
        """Quarantine the domains past their failure threshold, and cap the in-flight groups
        of those on probation (:meth:`actors.scheduling.Quarantine.caps`); every
        ``HEALTH_CHECK_S`` read the quarantine back, taking in again the domains the operator
        lifted (they start over: their recent failures forgotten)."""
        c = self.ctx
        if trio.current_time() >= self.next_health_check:
            self.next_health_check = trio.current_time() + HEALTH_CHECK_S
            held = await Q.quarantined(c.client, c.names)
            for name in self.quarantined - held.keys():
                self.health.reset(name)
                log.info("domain quarantine lifted", domain=name)
            self.quarantined = frozenset(d for d in held if d in self.items)
        failed = await Q.failed_counts(c.client, c.names, list(self.cfg.domains))
        for name in self.health.observe(resolved, failed):
            if name in self.quarantined:
                continue
            bad, groups = self.health.recent(name)
            why = Q.Why(failed=bad, groups=groups, at=time.time(),
                        causes=await Q.failure_causes(c.client, c.names, name))
            await Q.quarantine(c.client, c.names, name, why)
            self.quarantined |= {name}
            log.warning("domain quarantined", domain=name, why=why.describe())
        self.fair.exclude(self.quarantined)
        self.fair.limit(self.health.caps())

    async def admissible(self, version: int) -> tuple[int, int]:
        """``(how many training groups may be admitted now, how many were admitted so far)``."""
        c = self.ctx
        state = await admission_state(
            c.client, c.names, dynamic_sampling=c.config.verifier.dynamic_sampling
        )
        admitted = state.admitted
        if state.stopped:
            self.blocked = "stopped"
            return 0, admitted
        if c.config.learner.mode == "sft":  # it trains on its data set: held-out rounds only
            self.blocked = "sft"
            return 0, admitted
        by_staleness = staleness_room(state, version, c.staleness())
        limit = self.cfg.max_train_groups
        by_limit = limit - admitted if limit else by_staleness
        backlog = await group_state(c.client, c.names, N.TASKS, N.GROUP_OF_STREAM[N.TASKS])
        by_backlog = self.cfg.max_backlog - max(0, backlog.backlog - await self.held_out_queued())
        bounds = {"limit": by_limit} if limit else {}
        bounds |= {"staleness": by_staleness, "backlog": by_backlog}
        count = max(0, min(bounds.values()))
        self.blocked = None if count else min(bounds, key=bounds.__getitem__)
        return count, admitted

    async def held_out_queued(self) -> int:
        """How many tasks of the last held-out round are still queued for the generators
        (undelivered or pending: :func:`queues.stats.still_queued`); 0 once none is."""
        c = self.ctx
        if not self.held_out:
            return 0
        queued = await still_queued(
            c.client, c.names, N.TASKS, N.GROUP_OF_STREAM[N.TASKS], self.held_out
        )
        if not queued:
            self.held_out = []
        return queued

    async def counted(self, name: str) -> int:
        """Counter ``name`` of the run, summed over the shards."""
        return await counted(self.ctx.client, self.ctx.names, name)

    async def admit(self, count: int, version: int, admitted: int) -> int:
        """Publish ``count`` tasks and add them to the admitted counter in one script, only if
        the counter still reads ``admitted`` (else nothing; the caller re-checks), so the
        bounds computed from it hold exactly across restarts and replayed calls; the same
        script adds them per domain (``admitted_by_domain``, for status and the summary).
        Returns the number admitted."""
        c = self.ctx
        sampled = [t for t in (self.sample(version) for _ in range(count)) if t is not None]
        if not sampled:
            return 0
        tally = (c.names.admitted_by_domain, Counter(t.domain for t in sampled))
        if c.names.sharded:
            added = await publish_counted_routed(
                c.client,
                c.names,
                N.TASKS,
                [(t.episode_id, encode(t)) for t in sampled],
                c.names.admitted,
                admitted,
                c.payload_limits(),
                dedup_ttl_s=c.config.queues.dedup_ttl_s,
                record=True,
                tally=tally,
            )
        else:
            tasks = [encode(t) for t in sampled]
            added = await c.producer().publish_counted(
                N.TASKS, tasks, c.names.admitted, admitted,
                members=[t.episode_id for t in sampled], tally=tally,
            )
        if added:  # all of them or none
            metrics.record_admitted(c.names.run, (t.domain for t in sampled))
        return added

    async def finish_admissions(self) -> None:
        """Sharded runs: publish what a scheduler that died mid-admission counted but did not
        publish yet (a no-op otherwise)."""
        c = self.ctx
        if c.names.sharded:
            finished = await finish_counted(
                c.client, c.names, c.payload_limits(), dedup_ttl_s=c.config.queues.dedup_ttl_s
            )
            if finished:
                log.info("finished interrupted admissions", admissions=finished)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        c = self.ctx
        reader = EventReader(c.client, c.names, N.WEIGHTS, block_ms=c.config.queues.block_ms)
        try:
            await self.finish_admissions()
            follower = VersionFollower()
            version = await latest_version(reader, follower)
            next_eval = await self._eval_if_due(version, None)
            task_status.started()
            while True:
                if (self.cfg.adaptive or self.cfg.quarantine_after
                        or any(s.max_inflight for s in self.fair.shares)):
                    await self.observe_domains()
                if self.climbs:
                    await self.observe_curriculum()
                count, admitted = await self.admissible(version)
                metrics.record_admission(c.names.run, count, self.blocked)
                if count and await self.admit(count, version, admitted):
                    log.info("admitted", groups=count, policy_version=version)
                # Wait for the next policy version (or re-check the backlog after block_ms).
                follower.take_all(await reader.read_events(WeightsPublished))
                version = follower.version
                next_eval = await self._eval_if_due(version, next_eval)
        finally:
            reader.close()

    async def _eval_if_due(self, version: int, next_eval: int | None) -> int | None:
        """Start a round if one is due; returns the version at which the next one is. Rounds
        fall at the start of the run and at the first version at or past each multiple of
        ``eval_every``, so a restarted scheduler (no memory but the round counter) keeps the
        cadence: counting from the version it restarted at, one that restarts more often than
        every ``eval_every`` versions would never evaluate again."""
        every = self.cfg.eval_every
        if next_eval is None:  # at start: evaluate unless a round already ran for this run
            c = self.ctx
            if await read_counter(c.client, c.names.eval_round) == 0:
                await self._start_round(version)
        elif every and version >= next_eval:
            await self._start_round(version)
        else:
            return next_eval
        return (version // every + 1) * every if every else None

    async def _start_round(self, version: int) -> None:
        c = self.ctx
        round_no = await increment(c.client, c.names.eval_round) - 1
        # every eval domain, quarantined ones too: the monitor ends a round when each of its
        # items was scored or dead-lettered (actors/monitor.py EvalRound.lost), and expects
        # the whole round (a round without the quarantined domains would never end there)
        self.held_out = await publish_eval_entries(c, round_no, version)
        metrics.record_eval_round(c.names.run)


async def serve(ctx: ActorContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    await Scheduler(ctx).serve(task_status=task_status)
