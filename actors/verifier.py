"""Verifier: turns execution results into rewards (``executed`` -> ``trajectories``/``evals``).

The domain's verifier scores every completion in [0, 1]; it never raises for what the model
wrote (a verifier bug is a handler failure: retried, then dead-lettered). Training groups go
to the learner, held-out evaluation groups to the ``evals`` stream.

A reward of 0 means the answer was judged wrong; a sample the domain could not judge (its
``score`` raised :class:`~streamrl.domains.base.VerifierFailed`: a test script that wrote no
reward, a crashed harness, a third-party scorer that raised) is no reward at all. Its group
(training or held-out) is dead-lettered at once, without retries (:class:`Unjudged`, cause
``unjudged``, the error naming each unjudged sample and why): never trained, its admission
slot freed, counted against its domain (``count:failed:<d>:verifier:unjudged``: what
``streamrl status``, the summary's ``domains`` and the quarantine read); a held-out group
counts as lost in its round, not as a zero. ``streamrl replay show`` shows these groups.

Every training group is counted per domain as resolved, and as trained if forwarded
(``count:resolved:<domain>``, ``count:trained:<domain>``; the scheduler's adaptive share and
in-flight caps read them, with or without dynamic sampling). Dynamic sampling
(``verifier.dynamic_sampling``): a training group whose rewards are all equal carries no GRPO
signal (every advantage is zero); it is acknowledged without output and counted
(``count:zero_variance``), resolved but not trained. The counters are results of the handler
(:class:`runtime.serve.Count`), added by the runtime's hand-off in the same script as its
outputs and under the same dedup key: a replayed hand-off (redelivery, reclaim, a repeated
script call) counts a group once, so the staleness bound the scheduler computes from
``zero_variance`` stays exact.

Scoring is isolated and bounded: a group's ``score`` calls run in a pre-forked worker
*process* (:mod:`runtime.workers`, ``verifier.scorer_processes`` of them) under a deadline
(``verifier.score_timeout_s``). A scorer that hangs past it, or kills its process
(``os._exit``, a segfault, the OOM killer), has its worker SIGKILLed and replaced and costs
that message one failure of the retry policy (retried, then dead-lettered): never a stuck
slot, never a dead verifier; other messages are scored by the other workers meanwhile. A
scorer that raises is a handler failure too (retried, then dead-lettered). A thread is not
a boundary: the old worker thread could not be interrupted by any time limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import trio

from streamrl.actors.executor import from_outcome
from streamrl.actors.scheduling import reward_counters
from streamrl.domains.base import VerifierFailed
from streamrl.protocol import names as N
from streamrl.protocol.messages import (
    ExecOutcome,
    Executed,
    Sample,
    Trajectory,
    new_id,
    now,
)
from streamrl.runtime.context import ActorContext, domain_item
from streamrl.runtime.policies import Reject
from streamrl.runtime.serve import Count, Output, Result
from streamrl.runtime.workers import WorkerPool, open_worker_pool

log = structlog.get_logger()


SCORER_PRELOAD = (__name__,)  # what every scorer job needs imported (score_group's module)


class Unjudged(Reject):
    """A group with a sample its domain could not judge: dead-lettered at once, as
    ``unjudged``."""

    cause = "unjudged"


def score_group(executed_msgpack: bytes) -> list[float | str]:
    """Every sample's reward, or (a str) why its domain could not judge it
    (:class:`VerifierFailed`). Runs in a scorer worker process (:mod:`runtime.workers`)."""
    executed = msgspec.msgpack.decode(executed_msgpack, type=Executed)
    domain, item = domain_item(executed.rollout.task)
    by_turns = getattr(domain, "score_episode", None)  # a reward that depends on the turns

    def judge(sample: Sample, outcome: ExecOutcome) -> float | str:
        try:
            if by_turns and sample.turns:
                return float(by_turns(item, sample.turns, from_outcome(outcome)))
            return float(domain.score(item, sample.text, from_outcome(outcome)))
        except VerifierFailed as exc:
            return str(exc) or type(exc).__name__

    samples, outcomes = executed.rollout.samples, executed.outcomes
    return [judge(s, o) for s, o in zip(samples, outcomes, strict=True)]


def judged(scores: list[float | str]) -> list[float]:
    """The rewards of a group every sample of which was judged; else :class:`Unjudged`
    naming each sample that was not, and why."""
    unjudged = [f"sample {i}: {why}" for i, why in enumerate(scores) if isinstance(why, str)]
    if unjudged:
        raise Unjudged("; ".join(unjudged))
    return [float(r) for r in scores]


class Verifier:
    stage = "verifier"
    input_stream = N.EXECUTED
    input_type = Executed

    def __init__(
        self,
        dynamic_sampling: bool = False,
        *,
        scorers: WorkerPool | None = None,
        score_timeout_s: float = 30.0,
    ) -> None:
        self.scorers = scorers  # None: score in a thread of this process (tests of handle only)
        self.dynamic_sampling = dynamic_sampling  # False: no skipping
        self.score_timeout_s = score_timeout_s

    async def handle(self, executed: Executed) -> list[Result]:
        rollout = executed.rollout
        task = rollout.task
        if len(executed.outcomes) != len(rollout.samples):
            raise Reject(f"{len(executed.outcomes)} outcomes for {len(rollout.samples)} samples")
        domain_item(task)  # Reject here, not as a worker's failure, what can never be scored
        payload = msgspec.msgpack.encode(executed)
        if self.scorers is None:
            scores = await trio.to_thread.run_sync(score_group, payload)
        else:
            scores = await self.scorers.run(score_group, payload, deadline_s=self.score_timeout_s)
        rewards = judged(scores)
        log.info("verified", split=task.split, domain=task.domain, rewards=rewards)
        counts: list[Result] = []
        if task.split != "eval":
            resolved = Count(N.resolved_counter(task.domain))
            scored = reward_counts(task.domain, rewards)
            if self.dynamic_sampling and max(rewards) - min(rewards) < 1e-9:
                log.info("skipped zero-variance group", domain=task.domain, reward=rewards[0])
                return [Count("zero_variance"), resolved, *scored]
            counts = [resolved, Count(N.trained_counter(task.domain)), *scored]
        stream = N.EVALS if task.split == "eval" else N.TRAJECTORIES
        return [
            Output(
                stream,
                Trajectory(
                    id=new_id(),
                    created_at=now(),
                    policy_version=executed.policy_version,
                    attempt=executed.attempt,
                    rollout=rollout,
                    outcomes=executed.outcomes,
                    rewards=rewards,
                ),
            ),
            *counts,
        ]


def reward_counts(domain: str, rewards: list[float]) -> list[Result]:
    """A scored training group's counts: one more group of ``domain`` scored, and its mean
    reward in thousandths (:func:`actors.scheduling.reward_counters`: the curriculum's and
    the summary's train reward per domain)."""
    groups, reward_milli = reward_counters(domain)
    return [Count(groups), Count(reward_milli, round(1000 * sum(rewards) / len(rewards)))]


async def serve(
    ctx: ActorContext,
    *,
    worker_setup: Callable[[], None] | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``executed``; ``worker_setup`` (importable by name) runs in each scorer process
    first (e.g. to register the domains the parent registered in-process)."""
    cfg = ctx.config.verifier
    async with open_worker_pool(cfg.scorer_processes, worker_setup, SCORER_PRELOAD) as scorers:
        await ctx.serve(
            Verifier(cfg.dynamic_sampling, scorers=scorers, score_timeout_s=cfg.score_timeout_s),
            concurrency=cfg.concurrency,
            time_limit_s=cfg.time_limit_s,
            task_status=task_status,
        )
