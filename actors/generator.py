"""Generator: a task becomes a group of sampled completions (``tasks`` -> ``rollouts``).

Each completion records the behaviour logprob of every token and the policy (weights)
version that produced it. The process loads the current policy version before it takes any
work, and follows every ``weights`` event afterwards; the engine applies an update between
batches.
"""

from __future__ import annotations

from typing import Any

import structlog
import trio

from actors.context import ActorContext, domain_item
from actors.runtime import Output
from inference.engine import Engine
from queues import names as N
from queues.messages import (
    Rollout,
    Sample,
    Task,
    WeightsPublished,
    decode,
    floats_to_bytes,
    ids_to_bytes,
    new_id,
    now,
)
from queues.streams import EventReader

log = structlog.get_logger()


class Generator:
    stage = "generator"
    input_stream = N.TASKS
    input_type = Task

    def __init__(self, engine: Engine, tokenizer: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer

    async def handle(self, task: Task) -> list[Output]:
        domain, item = domain_item(task)
        prompt = domain.render_prompt(item, self.tokenizer)
        completions = await self.engine.generate([prompt] * task.group_size, task.sampling)
        samples = [
            Sample(
                tokens=ids_to_bytes(c.tokens),
                logprobs=floats_to_bytes(c.logprobs),
                text=c.text,
                finish_reason=c.finish_reason,
                weight_version=c.weight_version,
            )
            for c in completions
        ]
        version = min(s.weight_version for s in samples)
        rollout = Rollout(
            id=new_id(),
            created_at=now(),
            policy_version=version,
            attempt=task.attempt,
            task=task,
            prompt_ids=ids_to_bytes(prompt),
            samples=samples,
        )
        log.info(
            "generated",
            samples=len(samples),
            policy_version=version,
            tokens=sum(len(c.tokens) for c in completions),
        )
        return [Output(N.ROLLOUTS, rollout)]


async def serve_weight_updates(
    ctx: ActorContext, engine: Engine, *, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    """Load the current policy version, report ready, then follow every new version."""
    reader = EventReader(ctx.client, ctx.names, N.WEIGHTS, block_ms=ctx.config.queues.block_ms)
    try:
        latest = await reader.latest()
        if latest:
            event = decode(latest[1], WeightsPublished)
            await engine.update_weights(event.path, event.version)
            log.info("weights loaded", policy_version=event.version)
        task_status.started()
        while True:
            events = [decode(raw, WeightsPublished) for _, raw in await reader.read()]
            if events:
                newest = max(events, key=lambda e: e.version)
                if newest.version > engine.weight_version:
                    await engine.update_weights(newest.path, newest.version)
                    log.info("weights updated", policy_version=newest.version)
    finally:
        reader.close()


async def serve(ctx: ActorContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    from inference.transformers_engine import open_transformers_engine
    from learner.model import load_tokenizer, resolve_model

    cfg = ctx.config.generator
    model_dir = resolve_model(ctx.config.model.spec)
    tokenizer = load_tokenizer(model_dir)
    async with (
        open_transformers_engine(
            model_dir, max_batch=cfg.max_batch, threads=cfg.threads or None
        ) as engine,
        trio.open_nursery() as nursery,
    ):
        await nursery.start(serve_weight_updates, ctx, engine)
        await ctx.serve(
            Generator(engine, tokenizer),
            concurrency=cfg.concurrency,
            time_limit_s=cfg.time_limit_s,
            task_status=task_status,
        )
        nursery.cancel_scope.cancel()
