"""Executor: runs what the model wrote in a sandbox (``rollouts`` -> ``executed``).

The completions of one group run concurrently. What the untrusted code did comes back as
data (exit code, output, timed out, OOM); a sandbox that cannot be provided raises
``SandboxUnavailable``, so the whole message is retried (fresh sandboxes) by the runtime's
retry policy and never half-published.
"""

from __future__ import annotations

from typing import Any

import structlog
import trio

from actors.context import ActorContext, domain_item
from actors.runtime import Output
from queues import names as N
from queues.messages import ExecOutcome, Executed, Rollout, new_id, now
from sandbox import ExecResult, Sandbox, open_sandbox

log = structlog.get_logger()


def to_outcome(result: ExecResult | None) -> ExecOutcome:
    """Wire form of a sandbox result; ``None`` (nothing to run) becomes exit code None."""
    if result is None:
        return ExecOutcome(
            exit_code=None, stdout="", stderr="", timed_out=False, oom_killed=False, duration_s=0.0
        )
    return ExecOutcome(
        exit_code=result.exit_code,
        stdout=result.stdout.decode("utf-8", "replace"),
        stderr=result.stderr.decode("utf-8", "replace"),
        timed_out=result.timed_out,
        oom_killed=result.oom_killed,
        duration_s=result.duration_s,
        stdout_dropped=result.stdout_dropped,
        stderr_dropped=result.stderr_dropped,
    )


def from_outcome(outcome: ExecOutcome) -> ExecResult | None:
    if outcome.exit_code is None and not outcome.timed_out and outcome.duration_s == 0.0:
        return None
    return ExecResult(
        exit_code=outcome.exit_code,
        stdout=outcome.stdout.encode(),
        stderr=outcome.stderr.encode(),
        timed_out=outcome.timed_out,
        oom_killed=outcome.oom_killed,
        duration_s=outcome.duration_s,
        stdout_dropped=outcome.stdout_dropped,
        stderr_dropped=outcome.stderr_dropped,
    )


class Executor:
    stage = "executor"
    input_stream = N.ROLLOUTS
    input_type = Rollout

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox

    async def handle(self, rollout: Rollout) -> list[Output]:
        task = rollout.task
        domain, item = domain_item(task)
        results: list[ExecResult | None] = [None] * len(rollout.samples)

        async def run_one(i: int) -> None:
            request = domain.exec_request(item, rollout.samples[i].text)
            if request is not None:
                results[i] = await self.sandbox.run(request)

        async with trio.open_nursery() as nursery:
            for i in range(len(rollout.samples)):
                nursery.start_soon(run_one, i)
        outcomes = [to_outcome(r) for r in results]
        log.info("executed", samples=len(outcomes), ok=sum(1 for o in outcomes if o.exit_code == 0))
        return [
            Output(
                N.EXECUTED,
                Executed(
                    id=new_id(),
                    created_at=now(),
                    policy_version=rollout.policy_version,
                    attempt=rollout.attempt,
                    rollout=rollout,
                    outcomes=outcomes,
                ),
            )
        ]


async def serve(ctx: ActorContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    cfg = ctx.config.executor
    sandbox = open_sandbox(cfg.backend)
    try:
        await ctx.serve(
            Executor(sandbox),
            concurrency=cfg.concurrency,
            time_limit_s=cfg.time_limit_s,
            task_status=task_status,
        )
    finally:
        with trio.CancelScope(shield=True):
            await sandbox.aclose()
