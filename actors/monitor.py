"""Run monitor: evaluation rounds, learner metrics and queue depths, for progress and summaries.

The monitor consumes the ``evals`` stream with its own consumer group, as a handle-style
actor of the runtime (each result is recorded, appended to ``evals.jsonl`` in the run
directory, then acknowledged; what is not an evaluation result, or is one of a round the run
never opened (its ``eval_round`` counter), is dead-lettered; a round whose every item was
dead-lettered ends empty and is reported so) and follows
the ``metrics`` event stream. It only reads; it never changes the pipeline. On a sharded
run (``queues.shards``) it consumes the ``evals`` of every shard and its queue depths and
dead-letter count are sums over the shards (:mod:`queues.stats`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import trio

from streamrl.protocol import names as N
from streamrl.protocol.admission import counted
from streamrl.protocol.health import DomainHealth, domain_health
from streamrl.protocol.messages import (
    Executed,
    Rollout,
    StepMetrics,
    Task,
    Trajectory,
    carried_task,
)
from streamrl.protocol.pipeline import Stall, assess_stall, lag_flag, pipeline_state
from streamrl.queues.codec import DeadLetter, MessageError, decode
from streamrl.queues.operations import read_counter
from streamrl.queues.stats import GroupState, stream_length
from streamrl.queues.streams import EventReader
from streamrl.runtime.context import ActorContext
from streamrl.runtime.policies import Reject
from streamrl.runtime.serve import Result
from streamrl.runtime.tracking import Trackers, open_trackers


@dataclass
class EvalRound:
    round: int
    expected: int
    rewards: list[float] = field(default_factory=list)
    versions: set[int] = field(default_factory=set)
    lost: int = 0
    """Held-out samples whose item was dead-lettered on its way (a prompt too long for the
    model, a domain that fails): they count towards the round's end, not in its mean."""
    by_domain: dict[str, list[float]] = field(default_factory=dict)
    """domain -> rewards of its held-out items in this round."""

    @property
    def done(self) -> bool:
        return len(self.rewards) + self.lost >= self.expected

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rewards) if self.rewards else float("nan")

    @property
    def reward(self) -> float | None:
        """The round's mean reward for the summary: None for a round with no result (every
        item dead-lettered), not NaN (which ``json.dumps`` writes as invalid JSON)."""
        return self.mean if self.rewards else None

    def domain_means(self) -> dict[str, float]:
        return {d: statistics.fmean(r) for d, r in sorted(self.by_domain.items()) if r}


_KIND_OF_STREAM: dict[str, type[Any]] = {
    N.TASKS: Task, N.ROLLOUTS: Rollout, N.EXECUTED: Executed, N.EVALS: Trajectory,
}


PROGRESS_DOMAINS = 8
"""How many domains the progress line names one by one; past that, the spread and the lowest
and highest three (``streamrl status --all`` and the report have every domain)."""


def _domain_means_text(means: dict[str, float]) -> str:
    if len(means) <= PROGRESS_DOMAINS:
        return " ".join(f"{d} {m:.2f}" for d, m in means.items())
    ranked = sorted(means.items(), key=lambda dm: (dm[1], dm[0]))
    low = " ".join(f"{d} {m:.2f}" for d, m in ranked[:3])
    high = " ".join(f"{d} {m:.2f}" for d, m in ranked[-3:])
    return f"{len(means)} domains, lowest {low}; highest {high}"


def _round_text(r: EvalRound) -> str:
    """A completed round on the progress line: its mean at its first policy version, or,
    with no result (every item dead-lettered), how many were lost."""
    if r.rewards and r.versions:
        return f"{r.mean:.2f}@v{min(r.versions)}"
    return f"- (round {r.round}: all {r.lost} lost)"


def lost_eval_task(raw: bytes) -> Task | None:
    """The evaluation task a dead letter carries (of a round: ``eval_round >= 0``), or None
    (undecodable, or anything else)."""
    try:
        letter = decode(raw, DeadLetter)
        kind = _KIND_OF_STREAM.get(letter.stream)
        message = decode(letter.payload, kind) if kind else None
    except MessageError:
        return None
    task = carried_task(message)
    if task is None:
        return None
    return task if task.split == "eval" and task.eval_round >= 0 else None


def not_an_eval_result(traj: Trajectory) -> str | None:
    """Why ``traj`` cannot be recorded as a held-out result (None: it can)."""
    task = traj.rollout.task
    if task.split != "eval" or task.eval_round < 0:
        return f"split {task.split!r}, eval round {task.eval_round}"
    samples = traj.rollout.samples
    if not samples or len(traj.rewards) != len(samples):
        return f"{len(traj.rewards)} rewards for {len(samples)} samples"
    return None


class Summary(msgspec.Struct, kw_only=True):
    run: str
    minutes: float
    steps: int
    policy_version: int
    trajectories: int
    samples: int
    eval_reward_before: float | None
    eval_reward_after: float | None
    eval_rounds: list[dict[str, Any]]
    reward_first_steps: float | None
    reward_last_steps: float | None
    dropped_stale: int
    skipped_zero_variance: int = 0
    """Training groups the verifier skipped because their rewards were all equal (no GRPO
    signal; ``verifier.dynamic_sampling``, 0 without it). Groups generated for training =
    ``trajectories`` + ``dropped_stale`` + this + ``skipped_no_signal`` + dead-lettered ones."""
    skipped_no_signal: int = 0
    """Training groups the learner settled untrained because their whole batch had no
    learning signal (every group's rewards equal): no step, no version was made of them."""
    published_without_signal: int = 0
    """Groups of steps published without learning signal (``learner.step_without_signal``:
    wiring checks only); counted in ``steps`` and ``trajectories`` too, they taught nothing."""
    unjudged: int = 0
    """Training groups the verifier could not judge (dead-lettered as ``unjudged``, also in
    ``dead_letters`` and each domain's ``by_cause``): never trained, never a reward of 0."""
    dead_letters: int
    learner_step_seconds: float | None
    learner_busy_fraction: float | None
    trained_tokens_per_second: float | None
    eval_by_domain: dict[str, list[dict[str, Any]]] = {}
    """domain -> one point per completed round: round, policy_version, reward, items (the
    per-domain series over time; eval-only domains such as ``general`` included)."""
    domains: dict[str, dict[str, Any]] = {}
    """domain -> admitted, trained (groups forwarded to the learner), dead_letters (its
    dead-lettered training groups: count, by_stage, by_cause ``<stage>:<cause>``),
    quarantined (bool) and quarantine_reason (why, None when not), train_reward (mean of
    its scored training groups, None before any), eval (held-out reward per completed round,
    None for a round without it), forgetting (an eval-only domain's last round more than
    ``scheduler.forgetting_margin`` below its first): :mod:`streamrl.protocol.health`."""
    forgetting: list[str] = []
    """The eval-only domains flagged as forgetting."""
    engine: str = ""
    """The engine that generated the run's tokens (``generator.engine``: transformers, the
    in-process one; sglang, SGLang servers or serve-model; vllm, vLLM servers)."""
    engine_servers: int = 0
    """The inference servers it generated on (0: the in-process engine)."""
    rounds: list[dict[str, Any]] = []
    """A sequence's stages (``[[rounds.stage]]``, cli/rounds.py): name, start_version,
    end_version, before/after (held-out reward per domain), gates, outcome (passed,
    rolled_back, stopped; empty while running) and reason, rollback_version."""


def forgetting(rounds: list[EvalRound], eval_only: list[str], margin: float) -> list[str]:
    """The domains of ``eval_only`` whose held-out reward in the latest completed round that
    has them is more than ``margin`` below the first such round's."""
    flagged = []
    for d in eval_only:
        means = [statistics.fmean(r.by_domain[d]) for r in rounds if r.by_domain.get(d)]
        if len(means) > 1 and means[0] - means[-1] > margin:
            flagged.append(d)
    return flagged


def domain_rows(
    health: dict[str, DomainHealth], rounds: list[EvalRound], flagged: list[str]
) -> dict[str, dict[str, Any]]:
    """The summary's ``domains``: counters and the held-out series of each domain."""
    names = list(dict.fromkeys([*health, *(d for r in rounds for d in sorted(r.by_domain))]))
    rows = {}
    for d in names:
        h = health.get(d)
        held = h.quarantined if h else None
        rows[d] = {
            "admitted": h.admitted if h else 0,
            "trained": h.trained if h else 0,
            "dead_letters": {
                "count": h.failed if h else 0,
                "by_stage": h.failed_by_stage if h else {},
                "by_cause": dict(h.causes) if h else {},
            },
            "quarantined": held is not None,
            "quarantine_reason": held.describe() if held is not None else None,
            "train_reward": h.train_reward if h else None,
            "eval": [statistics.fmean(r.by_domain[d]) if r.by_domain.get(d) else None
                     for r in rounds],
            "forgetting": d in flagged,
        }
    return rows


def eval_series(rounds: list[EvalRound]) -> dict[str, list[dict[str, Any]]]:
    """Per-domain held-out reward over completed rounds (policy version: the round's
    lowest weight version)."""
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rounds:
        for domain, rewards in sorted(r.by_domain.items()):
            series.setdefault(domain, []).append({
                "round": r.round,
                "policy_version": min(r.versions) if r.versions else None,
                "reward": statistics.fmean(rewards),
                "items": len(rewards),
            })
    return series


def step_scalars(m: StepMetrics, health: dict[str, DomainHealth]) -> dict[str, float]:
    """What a tracker records at a learner step: every numeric field of ``m`` (``learner/``),
    and each trained domain's train reward (once it has one) and trained groups so far."""
    scalars = {f"learner/{k}": float(v) for k, v in msgspec.structs.asdict(m).items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)
               and k not in ("step", "v", "attempt", "created_at")}
    for d, h in sorted(health.items()):
        scalars[f"domain/{d}/trained_groups"] = float(h.trained)
        if h.train_reward is not None:
            scalars[f"domain/{d}/train_reward"] = h.train_reward
    return scalars


def round_scalars(r: EvalRound) -> dict[str, float]:
    """What a tracker records for a completed held-out round (at its policy version)."""
    scalars = {f"eval/{d}/reward": m for d, m in r.domain_means().items()}
    if r.rewards:
        scalars["eval/reward"] = r.mean
    return scalars


class Monitor:
    stage = "monitor"
    input_stream = N.EVALS
    input_type = Trajectory

    def __init__(self, ctx: ActorContext, run_dir: Path, eval_items: int) -> None:
        self.ctx = ctx
        self.run_dir = run_dir
        self._log_path = run_dir / "evals.jsonl"
        self.eval_items = eval_items
        self.rounds: dict[int, EvalRound] = {}
        self.steps: list[StepMetrics] = []
        self.queues: list[GroupState] = []
        self.stall: Stall | None = None
        self.dead = 0
        self.zero_variance = 0
        self.no_signal = 0
        self.health: dict[str, DomainHealth] = {}
        sched = ctx.config.scheduler
        self.trained_domains = list(sched.domains)
        self.eval_only = [d for d in sched.eval_domains if d not in sched.domains]
        self.forgetting_margin = sched.forgetting_margin
        self.started = time.monotonic()
        self._round_changed = trio.Event()
        self._seen: set[tuple[int, str, str]] = set()  # (round, domain, item id) recorded
        self.trackers = Trackers([])  # open while the metrics are followed (config.tracking)
        self._tracked_rounds: set[int] = set()
        self._opened = 0  # rounds the run opened (names.eval_round), as last read

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self._serve_evals)
            nursery.start_soon(self._serve_metrics)
            for layout in self.ctx.names.layouts():
                nursery.start_soon(self._serve_dead_letters, layout)
            task_status.started()
            while True:
                self.queues = await pipeline_state(self.ctx.client, self.ctx.names)
                self.stall = await assess_stall(
                    self.ctx.client, self.ctx.names, self.queues,
                    stall_after_s=self.ctx.config.ops.stall_after_s,
                    max_backlog=self.ctx.config.scheduler.max_backlog,
                )  # fmt: skip
                self.dead = await stream_length(self.ctx.client, self.ctx.names, N.DEAD)
                await self.refresh_domains()
                await trio.sleep(1.0)

    async def refresh_domains(self) -> None:
        """Read every trained domain's figures (:mod:`streamrl.protocol.health`) and the
        run's counts of groups skipped for equal rewards (the verifier's) and in batches
        without signal (the learner's)."""
        self.health = await domain_health(self.ctx.client, self.ctx.names,
                                          self.trained_domains)
        self.zero_variance = await counted(self.ctx.client, self.ctx.names, "zero_variance")
        self.no_signal = await counted(self.ctx.client, self.ctx.names, "no_signal")

    def published_without_signal(self) -> int:
        """Groups of the steps the learner published without learning signal."""
        return sum(s.groups for s in self.steps if s.no_signal)

    def unjudged(self) -> int:
        """Training groups the verifier could not judge (every trained domain's)."""
        return sum(h.causes.get("verifier:unjudged", 0) for h in self.health.values())

    def forgetting(self) -> list[str]:
        """The eval-only domains flagged as forgetting so far."""
        return forgetting(self.completed_rounds(), self.eval_only, self.forgetting_margin)

    async def _serve_evals(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Record every evaluation result, through the runtime (decode, dead letters, delivery
        limit, reclaim of a crashed monitor's entries, hand-off)."""
        self._load_earlier(self._log_path)
        await self.ctx.serve(self, concurrency=64, time_limit_s=60.0, task_status=task_status)

    async def handle(self, traj: Trajectory) -> list[Result]:
        """Record one held-out result (the runtime acknowledges it); one that is not an
        evaluation result is dead-lettered (:class:`runtime.policies.Reject`)."""
        problem = not_an_eval_result(traj)
        if problem:
            raise Reject(f"not an evaluation result: {problem}")
        if not await self.opened(traj.rollout.task.eval_round):
            raise Reject(f"evaluation round {traj.rollout.task.eval_round} was never opened")
        self._record(traj, self._log_path)
        return []

    async def opened(self, round_no: int) -> bool:
        """Whether the run opened round ``round_no`` (the ``eval_round`` counter, incremented
        before a round is published: read again only for a round past the last read)."""
        if round_no >= self._opened:
            self._opened = await read_counter(self.ctx.client, self.ctx.names.eval_round)
        return 0 <= round_no < self._opened

    def _load_earlier(self, log_path: Path) -> None:
        """The rounds an earlier monitor of this run recorded (a resumed ``streamrl up``),
        so the summary's "before" is still the run's first round."""
        if not log_path.exists():
            return
        for line in log_path.read_text().splitlines():
            try:
                row = json.loads(line)
                self._add(row["round"], row["item_id"], row["domain"], [row["reward"]],
                          [row["weight_version"]])
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash

    def _add(
        self, round_no: int, item_id: str, domain: str, rewards: list[float], versions: list[int]
    ) -> bool:
        """Count one held-out result in its round, once (a redelivered result is not)."""
        if (round_no, domain, item_id) in self._seen:
            return False
        self._seen.add((round_no, domain, item_id))
        r = self.rounds.setdefault(round_no, EvalRound(round_no, self.eval_items))
        r.rewards.extend(rewards)
        r.by_domain.setdefault(domain, []).extend(rewards)
        r.versions.update(versions)
        return True

    def _record(self, traj: Trajectory, log_path: Path) -> None:
        task = traj.rollout.task
        versions = [s.weight_version for s in traj.rollout.samples]
        if not self._add(task.eval_round, task.item_id, task.domain, list(traj.rewards), versions):
            return
        r = self.rounds[task.eval_round]
        with log_path.open("a") as f:
            f.write(
                json.dumps(
                    {
                        "round": task.eval_round,
                        "item_id": task.item_id,
                        "domain": task.domain,
                        "reward": traj.rewards[0],
                        "weight_version": traj.rollout.samples[0].weight_version,
                        "text": traj.rollout.samples[0].text,
                    }
                )
                + "\n"
            )
        if r.done:
            self._round_done()

    def _round_done(self) -> None:
        self._round_changed.set()
        self._round_changed = trio.Event()
        self._track_rounds()

    def _track_rounds(self) -> None:
        """Give the trackers each completed round not given yet, at its policy version."""
        for r in self.completed_rounds():
            if r.round not in self._tracked_rounds and self.trackers.trackers:
                self._tracked_rounds.add(r.round)
                self.trackers.log(min(r.versions) if r.versions else 0, round_scalars(r))

    async def _serve_metrics(self) -> None:
        """Follow the learner's steps; with ``tracking.backends``, forward each step, the
        domains' figures and each completed round to the trackers (:mod:`runtime.tracking`:
        one that fails is logged and dropped, the monitor carries on)."""
        reader = EventReader(self.ctx.client, self.ctx.names, N.METRICS)
        if self.ctx.config.tracking.backends:
            hparams = msgspec.to_builtins(self.ctx.config)
            hparams["run"].pop("redis_url", None)  # it may hold a password
            self.trackers = await trio.to_thread.run_sync(open_trackers, self.ctx.config,
                                                          hparams)
            self._track_rounds()
        try:
            while True:
                # an undecodable (forged) metrics event is logged and passed over: an event
                # stream has no dead letters, and the monitor must not crash-loop on it
                steps = await reader.read_events(StepMetrics)
                self.steps.extend(steps)
                for m in steps:
                    self.trackers.log(m.step, step_scalars(m, self.health))
        finally:
            reader.close()
            trackers, self.trackers = self.trackers, Trackers([])
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(trackers.close)

    async def _serve_dead_letters(self, layout: N.Names) -> None:
        """Count the held-out items dead-lettered on their way as lost in their round, so a
        round (and the final evaluation) ends when every item was scored or lost."""
        reader = EventReader(self.ctx.client, layout, N.DEAD)
        try:
            while True:
                for _, raw in await reader.read():
                    task = lost_eval_task(raw)
                    if task is not None and await self.opened(task.eval_round):
                        self.lose(task)
        finally:
            reader.close()

    def lose(self, task: Task) -> bool:
        """Count the held-out item of ``task`` (:func:`lost_eval_task`, in an opened round)
        as lost, once; not if it was scored."""
        key = (task.eval_round, task.domain, task.item_id)
        if key in self._seen:
            return False
        self._seen.add(key)
        r = self.rounds.setdefault(task.eval_round, EvalRound(task.eval_round, self.eval_items))
        r.lost += max(1, task.group_size)
        if r.done:
            self._round_done()
        return True

    async def wait_round(self, round_no: int) -> EvalRound:
        while not (round_no in self.rounds and self.rounds[round_no].done):
            await self._round_changed.wait()
        return self.rounds[round_no]

    # ------------------------------------------------------------------ views
    def completed_rounds(self) -> list[EvalRound]:
        return [r for _, r in sorted(self.rounds.items()) if r.done]

    def progress_line(self) -> str:
        elapsed = time.monotonic() - self.started
        last = self.steps[-1] if self.steps else None
        rounds = self.completed_rounds()
        evals = " ".join(_round_text(r) for r in rounds[-4:]) or "-"
        if rounds and rounds[-1].domain_means():
            evals += " (" + _domain_means_text(rounds[-1].domain_means()) + ")"
        recent = self.steps[-5:]
        reward = (  # no step yet: a dash, not "nan"
            f"{statistics.fmean(s.reward_mean for s in recent):.2f} (last {len(recent)} steps)"
            if recent else "- (no learner step yet)"
        )
        span = sum(s.step_seconds + s.wait_seconds for s in recent)
        sps = sum(s.samples for s in recent) / span if span else 0.0
        depth = " ".join(f"{q.stream}={q.lag}+{q.pending}" for q in self.queues)
        return (
            f"[{int(elapsed // 60):02d}:{int(elapsed % 60):02d}] "
            f"policy v{last.step if last else 0} | reward {reward} | "
            f"eval {evals} | {sps:.2f} samples/s | queues (lag+pending) {depth} | "
            f"dead {self.dead}"
            + (f" | no signal {n}" if (n := self.no_signal + self.published_without_signal())
               else "")
            + (f" | unjudged {n}" if (n := self.unjudged()) else "")
            + "".join(f" | {flag}" for q in self.queues if (flag := lag_flag(q)))
            + "".join(f" | forgetting: {d}" for d in self.forgetting())
            + (f" | {self.stall.describe()}" if self.stall else "")
        )

    def summary(self, run: str) -> Summary:
        rounds = self.completed_rounds()
        steps = self.steps
        k = max(1, min(5, len(steps) // 3)) if steps else 0
        busy = sum(s.step_seconds for s in steps)
        total = busy + sum(s.wait_seconds for s in steps)
        gen_tokens = sum(s.tokens for s in steps)
        return Summary(
            run=run,
            minutes=round((time.monotonic() - self.started) / 60, 2),
            steps=len(steps),
            policy_version=steps[-1].step if steps else 0,
            trajectories=sum(s.groups for s in steps),
            samples=sum(s.samples for s in steps),
            eval_reward_before=rounds[0].reward if rounds else None,
            eval_reward_after=rounds[-1].reward if len(rounds) > 1 else None,
            eval_rounds=[
                {
                    "round": r.round,
                    "reward": r.reward,
                    "versions": sorted(r.versions),
                    "items": len(r.rewards),
                    "by_domain": r.domain_means(),
                }
                for r in rounds
            ],
            eval_by_domain=eval_series(rounds),
            domains=domain_rows(self.health, rounds, self.forgetting()),
            forgetting=self.forgetting(),
            reward_first_steps=statistics.fmean(s.reward_mean for s in steps[:k]) if k else None,
            reward_last_steps=statistics.fmean(s.reward_mean for s in steps[-k:]) if k else None,
            dropped_stale=steps[-1].dropped_stale if steps else 0,
            skipped_zero_variance=self.zero_variance,
            skipped_no_signal=self.no_signal,
            published_without_signal=self.published_without_signal(),
            unjudged=self.unjudged(),
            dead_letters=self.dead,
            learner_step_seconds=statistics.median(s.step_seconds for s in steps)
            if steps
            else None,
            learner_busy_fraction=busy / total if total else None,
            trained_tokens_per_second=gen_tokens / total if total else None,
        )
