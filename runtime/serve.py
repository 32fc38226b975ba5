"""The actor runtime: read -> policies -> handle -> publish and ack.

``serve_actor`` guarantees, for every entry of its input stream it receives:
- exactly one terminal outcome: its outputs published and the entry acknowledged in one
  atomic hand-off, or the entry dead-lettered with the reason; an entry whose process dies
  mid-way stays pending and is redelivered (own pending list on restart, or the reclaimer);
- it never reads more entries than it has free handler slots (backpressure), and reads
  nothing while the consumer group of its downstream stream has more than
  ``max_downstream_backlog`` entries undelivered or pending (producer-side backpressure);
- entries being handled are heart-beaten, so the reclaimer of another replica does not
  steal live work;
- an entry a draining process releases (:class:`runtime.policies.Unavailable`, released at
  once instead of retried: a task still waiting for weights) is given back uncharged: that
  delivery does not count toward its delivery limit
  (:meth:`queues.streams.StreamConsumer.give_back`);
- malformed input (undecodable, wrong schema or version) is dead-lettered with the reason
  and the actor keeps running.
- on a sharded run (``consumer`` a :class:`queues.shards.ShardedConsumer`) all of this holds
  per entry in its own shard: outputs and dedup key go to the input's shard, and the
  downstream backlog is the sum over the shards.
Handlers are plain ``async def handle(message) -> list[Output | Count]`` with no Redis I/O: a
:class:`Count` is a counter the hand-off adds in the same script as the outputs, once.
"""

from __future__ import annotations

import random
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import msgspec
import structlog
import trio

from streamrl.protocol import names as N
from streamrl.protocol.contexts import ContextError
from streamrl.protocol.messages import Message, training_task
from streamrl.queues.codec import MessageError, decode, encode
from streamrl.queues.payloads import REF_PREFIX, PayloadTooLarge
from streamrl.queues.shards import Consumer
from streamrl.queues.stats import Paused, group_state, mark_paused
from streamrl.queues.streams import Delivery, Handoff
from streamrl.runtime import contexts, metrics
from streamrl.runtime.policies import Policies, Reject, Retry, Unavailable
from streamrl.runtime.workers import WorkerFailed, WorkerTimedOut

log = structlog.get_logger()

In = TypeVar("In", bound=Message, contravariant=True)


@dataclass(frozen=True)
class Output:
    stream: str
    message: msgspec.Struct


@dataclass(frozen=True)
class Count:
    """A handler's result that adds ``n`` to the run's counter ``name``
    (:meth:`protocol.names.Names.counter`) with the hand-off: in the same script as its
    outputs and under the same dedup key, so a replayed hand-off counts once. The counts of
    a training group's hand-off are added only while the group is in the admission record
    (``Handoff.counts_if_open``): a group the run never admitted (forged) counts nothing."""

    name: str
    n: int = 1


Result = Output | Count
"""What a handler returns a list of: messages to publish, counters to add."""


class Actor(Protocol, Generic[In]):
    stage: str
    input_stream: str
    input_type: type[Any]  # a Message subclass

    async def handle(self, message: In) -> Sequence[Result]: ...


@dataclass(frozen=True)
class RuntimeStatistics:
    in_flight: int
    handled: int
    retried: int
    dead_lettered: int
    released: int = 0  # left pending after Unavailable: redelivered by a reclaimer


@dataclass(frozen=True)
class RuntimeSettings:
    concurrency: int = 4
    heartbeat_interval_s: float = 10.0
    reclaim_interval_s: float = 5.0
    downstream: tuple[str, str] | None = None
    """(stream, group) this actor feeds, for producer-side backpressure."""
    max_downstream_backlog: int = 0
    """Pause reading while the downstream group's lag + pending exceeds this (0: off)."""
    backpressure_poll_s: float = 0.5


class ActorRuntime:
    def __init__(
        self,
        consumer: Consumer,
        actor: Actor[Any],
        policies: Policies,
        settings: RuntimeSettings,
    ) -> None:
        self.consumer = consumer
        self.actor = actor
        self.policies = policies
        self.settings = settings
        self._in_flight: set[str] = set()
        self._slot_freed = trio.Condition()
        self._rng = random.Random()
        self._handled = self._retried = self._dead = self._released = 0
        self._reading = trio.CancelScope()
        self._draining = False

    def statistics(self) -> RuntimeStatistics:
        return RuntimeStatistics(
            len(self._in_flight), self._handled, self._retried, self._dead, self._released
        )

    @property
    def free(self) -> int:
        return self.settings.concurrency - len(self._in_flight)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Handle entries until cancelled, or until :meth:`drain` has finished the work in hand."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_heartbeats)
            nursery.start_soon(self._serve_reclaimer, nursery)
            task_status.started()
            with self._reading:
                while True:
                    async with self._slot_freed:
                        while self.free <= 0:
                            await self._slot_freed.wait()
                    await self._wait_for_downstream()
                    for delivery in await self.consumer.read(self.free):
                        self._dispatch(nursery, delivery)
            async with self._slot_freed:  # draining: let the handlers in hand finish
                while self._in_flight:
                    await self._slot_freed.wait()
            nursery.cancel_scope.cancel()

    async def _wait_for_downstream(self) -> None:
        s = self.settings
        if s.downstream is None or s.max_downstream_backlog <= 0:
            return
        stream, group = s.downstream
        paused = False
        while True:
            state = await group_state(self.consumer.client, self.consumer.names, stream, group)
            metrics.record_queue(self.consumer.names.run, stream, state.lag, state.pending)
            if state.backlog <= s.max_downstream_backlog:
                if paused:
                    log.info("backpressure released", downstream=stream, backlog=state.backlog)
                return
            if not paused:
                log.info("backpressure: paused reading", downstream=stream, backlog=state.backlog)
                paused = True
            held = Paused(self.actor.stage, stream, state.backlog, s.max_downstream_backlog)
            ttl = max(2.0, 4 * s.backpressure_poll_s)  # `streamrl status` reads it (stalls)
            await mark_paused(self.consumer.client, self.consumer.names, held, ttl_s=ttl)
            await trio.sleep(s.backpressure_poll_s)

    def drain(self) -> None:
        """Stop taking new entries; :meth:`serve` returns once the in-flight ones are settled."""
        self._draining = True
        self._reading.cancel()

    def _dispatch(self, nursery: trio.Nursery, delivery: Delivery) -> None:
        if delivery.entry_id in self._in_flight:
            return  # reclaimed back to ourselves while still being handled
        self._in_flight.add(delivery.entry_id)
        nursery.start_soon(self._process, delivery)

    async def _serve_heartbeats(self) -> None:
        while True:
            await trio.sleep(self.settings.heartbeat_interval_s)
            await self.consumer.heartbeat(sorted(self._in_flight))

    async def _serve_reclaimer(self, nursery: trio.Nursery) -> None:
        while True:
            await trio.sleep(self.settings.reclaim_interval_s)
            if self._draining:
                return
            for delivery in await self.consumer.reclaim(self.free):
                log.info("reclaimed", entry_id=delivery.entry_id, deliveries=delivery.deliveries)
                self._dispatch(nursery, delivery)

    async def _process(self, delivery: Delivery) -> None:
        try:
            await self._process_one(delivery)
        finally:
            self._in_flight.discard(delivery.entry_id)
            async with self._slot_freed:
                self._slot_freed.notify_all()

    async def _process_one(self, delivery: Delivery) -> None:
        started = trio.current_time()
        message = await decode_or_dead_letter(
            self.consumer, self.actor.stage, delivery, self.actor.input_type
        )
        if message is None:
            self._dead += 1
            return None
        with structlog.contextvars.bound_contextvars(episode_id=message.episode_id):
            try:  # an episode's context by reference: the handler sees it whole
                message, stored = await contexts.resolve(
                    self.consumer, delivery.entry_id, message)
            except ContextError as exc:
                return await self._dead_letter(delivery, str(exc), message, cause="payload")
            results = await self._handle_with_retries(delivery, message)
            if results is None:
                return None
            stage, names = self.actor.stage, self.consumer.names
            outputs = [r for r in results if isinstance(r, Output)]
            wire = contexts.externalize(names, stored, [o.message for o in outputs])
            handoff = Handoff(
                delivery.entry_id,
                names.dedup(stage, message.id),
                [(names.stream(o.stream), encode(m))
                 for o, m in zip(outputs, wire.messages, strict=True)],
                [(names.counter(r.name), r.n) for r in results if isinstance(r, Count)],
                wire.stores,
                wire.deletes,
                counts_if_open=admitted_group(self.consumer, message),
            )
            try:
                await self.consumer.complete(handoff)
            except PayloadTooLarge as exc:
                return await self._dead_letter(
                    delivery, f"output refused: {exc}", message, cause="output"
                )
            self._handled += 1
            metrics.record_handled(
                self.consumer.names.run, stage, trio.current_time() - started,
                [o.message for o in outputs],
            )
            return None

    async def _handle_with_retries(
        self, delivery: Delivery, message: Message
    ) -> Sequence[Result] | None:
        retry = 0
        while True:
            try:
                with trio.fail_after(self.policies.time_limit_s):
                    return await self.actor.handle(message)
            except Reject as exc:
                await self._dead_letter(delivery, f"{exc.cause}: {exc}", message, cause=exc.cause)
                return None
            except Exception as exc:  # the retry policy turns failures into data
                retry += 1
                error = "".join(traceback.format_exception_only(exc)).strip()
                if isinstance(exc, trio.TooSlowError):
                    error = f"time limit {self.policies.time_limit_s}s exceeded"
                if retry > self.policies.retry.max_retries or (
                    self._draining and isinstance(exc, Unavailable)
                ):
                    if isinstance(exc, Unavailable):  # left pending: the reclaimer redelivers
                        log.warning("handler unavailable, released", error=error, retry=retry)
                        self._released += 1
                        if self._draining:  # returned by the drain, not by its own failure
                            await self.consumer.give_back([delivery])
                        return None
                    await self._dead_letter(
                        delivery, f"failed {retry} times, last: {error}", message,
                        cause=failure_cause(exc),
                    )
                    return None
                delay = exc.delay if isinstance(exc, Retry) and exc.delay is not None else None
                delay = self.policies.retry.delay(retry, self._rng) if delay is None else delay
                log.warning("handler failed, retrying", error=error, retry=retry, delay_s=delay)
                self._retried += 1
                metrics.record_retry(self.consumer.names.run, self.actor.stage)
                await trio.sleep(delay)

    async def _dead_letter(
        self, delivery: Delivery, reason: str, message: Message | None = None, *,
        cause: str = "error",
    ) -> None:
        await dead_letter(self.consumer, self.actor.stage, delivery, reason, message, cause=cause)
        self._dead += 1


def admitted_group(consumer: Consumer, message: Message) -> str | None:
    """The training group whose admission ``message``'s counts depend on (its episode id),
    on the training path; None elsewhere (an evaluation item, the ``evals`` stream)."""
    if consumer.stream_name == N.EVALS:
        return None
    task = training_task(message)
    return None if task is None else task.episode_id


def failure_cause(exc: BaseException) -> str:
    """What a handler failure that exhausted its retries was, for the per-domain failure
    counters (:func:`protocol.names.failed_counter`): ``timeout`` (the time limit, a scorer's
    deadline), ``crash`` (a scorer process died), else ``error``."""
    if isinstance(exc, (trio.TooSlowError, WorkerTimedOut)):
        return "timeout"
    return "crash" if isinstance(exc, WorkerFailed) else "error"


async def dead_letter(
    consumer: Consumer, stage: str, delivery: Delivery, reason: str,
    message: Message | None = None, *, cause: str = "error",
) -> None:
    """Dead-letter ``delivery`` (the consumer logs it with the reason); a decoded ``message`` of
    an admitted training group frees the group's admission slot with the letter
    (:func:`protocol.messages.training_group`), on the training path only: a training group
    found in ``evals`` (forged or misrouted) frees nothing there, its own entry is still on its
    way to the learner. The same step counts the failure for the group's domain (all causes,
    and by stage and ``cause``: :func:`protocol.names.failed_counter`) and, upstream of the
    verifier, the group as resolved (:data:`protocol.names.UNRESOLVED_STREAMS`): once per
    group, as the ticket. The one way every consumer dead-letters."""
    on_path = message is not None and consumer.stream_name != N.EVALS
    task = training_task(message) if on_path and message is not None else None
    counters: list[tuple[str, int]] = []
    if task is not None:
        names = [N.failed_counter(task.domain), N.failed_counter(task.domain, stage, cause)]
        if consumer.stream_name in N.UNRESOLVED_STREAMS:
            names.append(N.resolved_counter(task.domain))
        counters = [(consumer.names.counter(name), 1) for name in names]
    ticket = None if task is None else task.episode_id
    await consumer.dead_letter(delivery, reason, ticket=ticket, counters=counters)
    metrics.record_dead(consumer.names.run, stage, reason)


async def decode_or_dead_letter(
    consumer: Consumer, stage: str, delivery: Delivery, kind: type[Any]
) -> Any:
    """The delivery's message decoded as ``kind``, or None once the entry is dead-lettered
    instead: it has no usable payload (past the delivery limit, which the consumer applies
    before any payload work; oversize; blob gone), or it does not decode (garbage, wrong
    schema or version). An entry past its limit whose message is held inline still frees its
    training group's admission slot (:func:`_peek`). The one decode path of every consumer."""
    if delivery.payload is None:
        reason = delivery.error or "entry has no payload"
        cause = "delivery_limit" if delivery.past_limit else "payload"
        await dead_letter(consumer, stage, delivery, reason, _peek(delivery, kind), cause=cause)
        return None
    try:
        return decode(delivery.payload, kind)
    except MessageError as exc:
        await dead_letter(consumer, stage, delivery, f"malformed message: {exc}")
        return None


def _peek(delivery: Delivery, kind: type[Any]) -> Message | None:
    """The message of an entry past its delivery limit, if it is held inline (no I/O: a
    claim-check blob is not fetched), so that its dead letter still frees an admitted
    group's slot; None for anything else."""
    raw = delivery.raw
    if not delivery.past_limit or raw is None or raw.startswith(REF_PREFIX):
        return None
    try:
        message: Message = decode(raw, kind)
    except MessageError:
        return None
    return message


async def serve_actor(
    consumer: Consumer,
    actor: Actor[Any],
    policies: Policies,
    settings: RuntimeSettings,
    *,
    shutdown: trio.Event | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run ``actor`` on ``consumer`` (see the module docstring for guarantees).

    Runs until cancelled; once ``shutdown`` is set it drains (stops reading, settles the
    entries in hand) and returns.
    """
    runtime = ActorRuntime(consumer, actor, policies, settings)
    async with trio.open_nursery() as nursery:
        if shutdown is not None:

            async def drain_on_shutdown() -> None:
                await shutdown.wait()
                runtime.drain()

            nursery.start_soon(drain_on_shutdown)
        await runtime.serve(task_status=task_status)
        nursery.cancel_scope.cancel()
