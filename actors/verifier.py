"""Verifier: turns execution results into rewards (``executed`` -> ``trajectories``/``evals``).

The domain's verifier scores every completion in [0, 1]; it never raises for what the model
wrote (a verifier bug is a handler failure: retried, then dead-lettered). Training groups go
to the learner, held-out evaluation groups to the ``evals`` stream.
"""

from __future__ import annotations

from typing import Any

import structlog
import trio

from actors.context import ActorContext, domain_item
from actors.executor import from_outcome
from actors.policies import Reject
from actors.runtime import Output
from queues import names as N
from queues.messages import Executed, Trajectory, new_id, now

log = structlog.get_logger()


class Verifier:
    stage = "verifier"
    input_stream = N.EXECUTED
    input_type = Executed

    async def handle(self, executed: Executed) -> list[Output]:
        rollout = executed.rollout
        task = rollout.task
        if len(executed.outcomes) != len(rollout.samples):
            raise Reject(f"{len(executed.outcomes)} outcomes for {len(rollout.samples)} samples")
        domain, item = domain_item(task)
        rewards = [
            float(domain.score(item, sample.text, from_outcome(outcome)))
            for sample, outcome in zip(rollout.samples, executed.outcomes, strict=True)
        ]
        log.info("verified", split=task.split, rewards=rewards)
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
            )
        ]


async def serve(ctx: ActorContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    cfg = ctx.config.verifier
    await ctx.serve(
        Verifier(),
        concurrency=cfg.concurrency,
        time_limit_s=cfg.time_limit_s,
        task_status=task_status,
    )
