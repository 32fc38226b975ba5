"""What every actor process opens at start: config, logging, Redis, names, policies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from actors.config import Config
from actors.policies import Policies, Reject, RetryPolicy
from actors.runtime import Actor, RuntimeSettings, serve_actor
from domains.base import Domain
from domains.registry import get_domain
from queues.client import RedisClient
from queues.messages import Task
from queues.names import Names
from queues.streams import ConsumerSettings, StreamConsumer, open_stream_consumer


@dataclass
class ActorContext:
    config: Config
    client: RedisClient
    names: Names
    shutdown: trio.Event = field(default_factory=trio.Event)
    """Set on SIGINT/SIGTERM: handle-style actors drain the work in hand and return."""

    def consumer_settings(self) -> ConsumerSettings:
        q = self.config.queues
        return ConsumerSettings(block_ms=q.block_ms, reclaim_min_idle_ms=q.reclaim_min_idle_ms)

    def policies(self, time_limit_s: float) -> Policies:
        r = self.config.retry
        return Policies(
            retry=RetryPolicy(r.max_retries, r.backoff_s, r.max_backoff_s),
            max_deliveries=self.config.queues.max_deliveries,
            time_limit_s=time_limit_s,
        )

    def runtime_settings(self, concurrency: int) -> RuntimeSettings:
        q = self.config.queues
        return RuntimeSettings(
            concurrency=concurrency,
            heartbeat_interval_s=q.heartbeat_interval_s,
            reclaim_interval_s=q.reclaim_interval_s,
        )

    @asynccontextmanager
    async def consumer(self, stream: str, stage: str, **kw: Any) -> AsyncIterator[StreamConsumer]:
        async with open_stream_consumer(
            self.client, self.names, stream, stage=stage, settings=self.consumer_settings(), **kw
        ) as c:
            yield c

    async def serve(
        self,
        actor: Actor[Any],
        *,
        concurrency: int,
        time_limit_s: float,
        task_status: Any = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve a handle-style actor on its input stream until cancelled."""
        async with self.consumer(actor.input_stream, actor.stage) as consumer:
            await serve_actor(
                consumer,
                actor,
                self.policies(time_limit_s),
                self.runtime_settings(concurrency),
                shutdown=self.shutdown,
                task_status=task_status,
            )


def domain_item(task: Task) -> tuple[Domain, Any]:
    """The task's domain and its item, rebuilt from the wire; :class:`Reject` if impossible."""
    try:
        domain = get_domain(task.domain)
        item: Any = msgspec.convert(task.spec, domain.item_type)
    except (KeyError, msgspec.ValidationError) as exc:
        raise Reject(f"task {task.item_id!r} of domain {task.domain!r}: {exc}") from None
    return domain, item


@asynccontextmanager
async def open_context(config: Config) -> AsyncIterator[ActorContext]:
    if not config.run.redis_url:
        raise ValueError("run.redis_url is empty: set it, or use `streamrl up` (embedded server)")
    client = RedisClient(config.run.redis_url)
    try:
        yield ActorContext(config, client, Names(config.run.name))
    finally:
        client.close()
