"""Verifier: turns execution results into rewards (``executed`` -> ``trajectories``/``evals``).

The domain's verifier scores every completion in [0, 1]; it never raises for what the model
wrote (a verifier bug is a handler failure: retried, then dead-lettered). Training groups go
to the learner, held-out evaluation groups to the ``evals`` stream.

Dynamic sampling (``verifier.dynamic_sampling``): a training group whose rewards are all
equal carries no GRPO signal (every advantage is zero); it is acknowledged without output
and counted (``count:zero_variance``), and every training group is counted per domain as
resolved, and as trained if forwarded (``count:resolved:<domain>``, ``count:trained:<domain>``;
the scheduler's adaptive share reads them). The counters are results of the handler
(:class:`runtime.serve.Count`), added by the runtime's hand-off in the same script as its
outputs and under the same dedup key: a replayed hand-off (redelivery, reclaim, a repeated
script call) counts a group once, so the staleness bound the scheduler computes from
``zero_variance`` stays exact. A domain's ``score`` runs in a worker thread (a verifier may
parse, e.g. sympy under a deadline) so the actor keeps heart-beating meanwhile.
"""

from __future__ import annotations

from typing import Any

import structlog
import trio

from streamrl.actors.executor import from_outcome
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Trajectory, new_id, now
from streamrl.runtime.context import ActorContext, domain_item
from streamrl.runtime.policies import Reject
from streamrl.runtime.serve import Count, Output, Result

log = structlog.get_logger()


class Verifier:
    stage = "verifier"
    input_stream = N.EXECUTED
    input_type = Executed

    def __init__(self, dynamic_sampling: bool = False) -> None:
        self.dynamic_sampling = dynamic_sampling  # False: no skipping, no counters

    async def handle(self, executed: Executed) -> list[Result]:
        rollout = executed.rollout
        task = rollout.task
        if len(executed.outcomes) != len(rollout.samples):
            raise Reject(f"{len(executed.outcomes)} outcomes for {len(rollout.samples)} samples")
        domain, item = domain_item(task)

        def score_all() -> list[float]:
            return [
                float(domain.score(item, sample.text, from_outcome(outcome)))
                for sample, outcome in zip(rollout.samples, executed.outcomes, strict=True)
            ]

        rewards = await trio.to_thread.run_sync(score_all)
        log.info("verified", split=task.split, domain=task.domain, rewards=rewards)
        counts: list[Result] = []
        if self.dynamic_sampling and task.split != "eval":
            if max(rewards) - min(rewards) < 1e-9:
                log.info("skipped zero-variance group", domain=task.domain, reward=rewards[0])
                return [Count("zero_variance"), Count(f"resolved:{task.domain}")]
            counts = [Count(f"resolved:{task.domain}"), Count(f"trained:{task.domain}")]
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


async def serve(ctx: ActorContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    cfg = ctx.config.verifier
    await ctx.serve(
        Verifier(cfg.dynamic_sampling),
        concurrency=cfg.concurrency,
        time_limit_s=cfg.time_limit_s,
        task_status=task_status,
    )
