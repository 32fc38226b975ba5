"""What every actor process opens at start: config, logging, Redis, names, policies.

Shards (``queues.shards`` > 1): :attr:`ActorContext.names` is the run view of a sharded run;
:meth:`ActorContext.consumer` then consumes every shard (:class:`queues.shards.ShardedConsumer`,
hand-offs stay in the shard of their input) and :meth:`ActorContext.publish_work` routes new
work to the shard of its routing key. With one shard both are the plain single-slot calls.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from streamrl.config.schema import Config
from streamrl.domains.base import Domain
from streamrl.domains.declared import declare_domains
from streamrl.domains.registry import get_domain
from streamrl.protocol import names as N
from streamrl.protocol.messages import Task
from streamrl.protocol.names import Names
from streamrl.protocol.staleness import StalenessPolicy
from streamrl.queues.client import RedisClient
from streamrl.queues.payloads import PayloadLimits
from streamrl.queues.shards import Consumer, open_consumer, publish_routed
from streamrl.queues.streams import ConsumerSettings, Producer
from streamrl.runtime.auth import actor_url
from streamrl.runtime.policies import Policies, Reject, RetryPolicy
from streamrl.runtime.serve import Actor, RuntimeSettings, serve_actor

DOWNSTREAM = {N.TASKS: N.ROLLOUTS, N.ROLLOUTS: N.EXECUTED, N.EXECUTED: N.TRAJECTORIES}
"""The work stream each handle-style stage feeds (producer-side backpressure)."""


@dataclass
class ActorContext:
    config: Config
    client: RedisClient
    names: Names
    shutdown: trio.Event = field(default_factory=trio.Event)
    """Set on SIGINT/SIGTERM: handle-style actors drain the work in hand and return."""

    def payload_limits(self) -> PayloadLimits:
        q = self.config.queues
        return PayloadLimits(
            max_bytes=q.max_message_bytes,
            claim_check_bytes=q.claim_check_bytes,
            blob_ttl_s=q.blob_ttl_s,
        )

    def consumer_settings(self, stream: str) -> ConsumerSettings:
        q = self.config.queues
        return ConsumerSettings(
            block_ms=q.block_ms,
            reclaim_min_idle_ms=q.reclaim_min_idle_ms_by_stream.get(stream, q.reclaim_min_idle_ms),
            dedup_ttl_s=q.dedup_ttl_s,
            limits=self.payload_limits(),
            trim_interval_s=q.trim_interval_s,
            retain_acked=q.retain_acked,
            max_deliveries=q.max_deliveries,
        )

    def producer(self) -> Producer:
        """Publishes to run-global streams, and to work streams of a one-shard run (for work,
        :meth:`publish_work` also covers sharded runs)."""
        return Producer(self.client, self.names, self.payload_limits())

    async def publish_work(self, stream: str, items: list[tuple[str, bytes]]) -> list[str]:
        """XADD ``items`` [(routing key, payload)] to work stream ``stream``: into the shard of
        each routing key (e.g. the episode id) when the run is sharded, else as
        :meth:`Producer.publish`. Returns the entry ids (shard-qualified when sharded)."""
        if not self.names.sharded:
            return await self.producer().publish(stream, [p for _, p in items])
        return await publish_routed(
            self.client, self.names, stream, items, self.names.shards, self.payload_limits()
        )

    def policies(self, time_limit_s: float) -> Policies:
        r = self.config.retry
        return Policies(
            retry=RetryPolicy(r.max_retries, r.backoff_s, r.max_backoff_s),
            time_limit_s=time_limit_s,
        )

    def staleness(self) -> StalenessPolicy:
        """The run's one staleness policy (scheduler admission, generator, learner)."""
        learner = self.config.learner
        return StalenessPolicy(learner.max_staleness, learner.groups_per_step)

    def runtime_settings(self, concurrency: int, input_stream: str) -> RuntimeSettings:
        q = self.config.queues
        downstream = DOWNSTREAM.get(input_stream)
        return RuntimeSettings(
            concurrency=concurrency,
            heartbeat_interval_s=q.heartbeat_interval_s,
            reclaim_interval_s=q.reclaim_interval_s,
            downstream=(downstream, N.GROUP_OF_STREAM[downstream]) if downstream else None,
            max_downstream_backlog=q.max_downstream_backlog,
        )

    @asynccontextmanager
    async def consumer(self, stream: str, stage: str, **kw: Any) -> AsyncIterator[Consumer]:
        """A consumer of ``stream`` over the whole run: every shard of a sharded run."""
        async with open_consumer(
            self.client,
            self.names,
            stream,
            stage=stage,
            settings=self.consumer_settings(stream),
            **kw,
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
                self.runtime_settings(concurrency, actor.input_stream),
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
async def open_context(
    config: Config, role: str, *, password: str | None = None
) -> AsyncIterator[ActorContext]:
    """Connect as ``role`` (with ``auth.enabled``: its own ACL user, see runtime/auth.py).
    The domains declared as data in ``config.domain`` are registered first (every process
    of the run sees the same ones: domains/declared.py)."""
    if not config.run.redis_url:
        raise ValueError("run.redis_url is empty: set it, or use `streamrl up` (embedded server)")
    declare_domains(config.domain)
    client = RedisClient(actor_url(config, role, password))
    try:
        yield ActorContext(config, client, Names(config.run.name, shards=config.queues.shards))
    finally:
        client.close()
