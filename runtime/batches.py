"""The batch variant of the serve loop: read -> decode -> collect -> handle -> settle, a
batch at a time (the learner, the archiver).

:class:`BatchRuntime` guarantees, for every entry of its input stream it receives:
- the runtime's one read and decode path: the consumer's delivery limit, then decode ->
  dead-letter with the reason (:func:`runtime.serve.decode_or_dead_letter`); an *observer*
  group (``BatchSettings.observer``: a copy such as the archive, beside the stage that owns
  the stream and dead-letters its bad entries) acknowledges and logs such an entry instead,
  so one bad entry is never dead-lettered twice;
- an entry is *held* from its read until it is settled: never collected into a second batch
  (a rewind or reclaim that hands it out again is passed over), heart-beaten every
  ``heartbeat_interval_s`` so no reclaimer takes it while it is worked on;
- exactly one terminal outcome: acknowledged with its batch in one atomic hand-off with the
  batch's outputs and counters (:meth:`BatchRuntime.settle`, ``ack_many``: a replayed
  hand-off publishes and counts nothing twice), settled alone (:meth:`BatchRuntime.settle`
  with one entry: a duplicate, a stale group), or dead-lettered; an entry whose process dies
  first stays pending and is read again (own pending list at restart, a reclaimer);
- an entry read ahead (held, no step taken on it yet: the learner's next batch) is given back
  uncharged when the runtime closes, so a stop does not bring it closer to its delivery
  limit; an entry whose step began keeps the delivery it was charged;
- a batch handler that raises is retried with the retry policy's backoff
  (:meth:`BatchRuntime.handle`); when it still fails, each entry is tried alone and only
  the ones that fail alone are dead-lettered, with their error; the rest are handled. Entries
  held for a later batch are never part of it;
- the group's sole consumer (``BatchSettings.sole_consumer``: the learner) takes back, when
  idle, entries pending on it that it does not hold (their delivery was lost: Redis restarted
  during the read); other groups reclaim idle entries of crashed consumers every
  ``reclaim_interval_s``.
No producer-side backpressure: a batch consumer (the learner, the archiver) feeds no work
stream. No time limit: a batch handler runs in a thread that cannot be interrupted.
"""

from __future__ import annotations

import random
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import structlog
import trio

from streamrl.protocol.messages import Message, training_group
from streamrl.queues.codec import MessageError, decode, encode
from streamrl.queues.shards import Consumer
from streamrl.queues.stats import group_state
from streamrl.queues.streams import Delivery
from streamrl.runtime import metrics
from streamrl.runtime.policies import Policies
from streamrl.runtime.serve import Count, Output, dead_letter, decode_or_dead_letter

log = structlog.get_logger()

M = TypeVar("M", bound=Message)
T = TypeVar("T")


@dataclass(frozen=True)
class Held(Generic[M]):
    """An entry read, decoded and collected: held until it is settled."""

    delivery: Delivery
    message: M

    @property
    def entry_id(self) -> str:
        return self.delivery.entry_id


@dataclass(frozen=True)
class Settlement:
    """What one atomic hand-off does besides acknowledging its entries: publish ``outputs``
    and add ``counts`` once (under ``dedup_id``), take ``tickets`` (one per entry, or empty)
    out of the admission record; with ``only_settling`` the counts are added only if the
    hand-off took a ticket out (:meth:`queues.streams.StreamConsumer.ack_many`). With none
    of these (``Settlement()``), a plain acknowledgement (XACK: no dedup key to write)."""

    dedup_id: str = ""
    outputs: Sequence[Output] = ()
    counts: Sequence[Count] = ()
    tickets: Sequence[str] = ()
    only_settling: bool = False


@dataclass(frozen=True)
class BatchSettings:
    heartbeat_interval_s: float = 10.0
    reclaim_interval_s: float = 0.0
    """Take over idle entries of crashed consumers this often (0: never; a consumer with a
    name fixed for life drains its own pending list at start instead)."""
    sole_consumer: bool = False
    """The group's only consumer: entries pending in the group that it does not hold were
    delivered to it and lost on the way; it reads them again when idle."""
    observer: bool = False
    """A copy beside the owning stage: what does not decode is acknowledged, not
    dead-lettered."""


Accept = Callable[[Held[M], Sequence[Held[M]]], Awaitable[bool]]
"""Whether a decoded entry joins the batch (given those collected so far); one it refuses
it has settled itself (:meth:`BatchRuntime.settle`, :meth:`BatchRuntime.dead_letter`)."""


class BatchRuntime(Generic[M]):
    """Use :func:`open_batches`."""

    def __init__(
        self,
        consumer: Consumer,
        stage: str,
        kind: type[M],
        policies: Policies,
        settings: BatchSettings,
    ) -> None:
        self.consumer = consumer
        self.stage = stage
        self.kind = kind
        self.policies = policies
        self.settings = settings
        self.held: set[str] = set()
        """Entry ids collected and not settled yet (batches being collected, handled,
        settled): this consumer's share of the group's pending list."""
        self.ahead: dict[str, Delivery] = {}
        """The held entries no step has been taken on yet (read ahead): given back uncharged
        when the runtime closes (:meth:`give_back_ahead`)."""
        self._next_reclaim = 0.0
        self._rng = random.Random()

    async def collect(
        self,
        n: int,
        *,
        accept: Accept[M] | None = None,
        deadline_s: float | None = None,
        enough: Callable[[], Awaitable[bool]] | None = None,
        until: trio.Event | None = None,
    ) -> list[Held[M]]:
        """``n`` entries decoded and accepted; fewer only once ``deadline_s`` passed since
        the first was collected, when a read came back empty and ``enough()`` says no more
        can come (the learner's last part-filled step), or once ``until`` is set (after the
        read in progress: what it read is returned, not lost). One read per ``n`` entries:
        no round trip of its own per entry."""
        batch: list[Held[M]] = []
        started = trio.current_time()
        while len(batch) < n:
            deliveries = await self._read(n - len(batch))
            for d in deliveries:
                if d.entry_id in self.held:  # handed out again (rewind, reclaim): ours already
                    continue
                message = await self._decode(d)
                if message is None:
                    continue
                held = Held(d, message)
                if accept is None or await accept(held, batch):
                    batch.append(held)
                    self.held.add(d.entry_id)
                    self.ahead[d.entry_id] = d
            if until is not None and until.is_set():
                break
            if not batch:
                started = trio.current_time()
            elif deadline_s is not None and trio.current_time() - started >= deadline_s:
                break
            if deliveries:
                continue
            if self.settings.sole_consumer and await self._lost_deliveries():
                self.consumer.rewind()
            elif batch and enough is not None and await enough():
                break
        return batch

    async def _read(self, count: int) -> list[Delivery]:
        every = self.settings.reclaim_interval_s
        if every and trio.current_time() >= self._next_reclaim:
            self._next_reclaim = trio.current_time() + every
            reclaimed = await self.consumer.reclaim(count)
            for d in reclaimed:
                log.info("reclaimed", entry_id=d.entry_id, deliveries=d.deliveries)
            if reclaimed:
                return reclaimed
        return await self.consumer.read(count)

    async def _decode(self, d: Delivery) -> M | None:
        if not self.settings.observer:
            message: M | None = await decode_or_dead_letter(self.consumer, self.stage, d, self.kind)
            return message
        reason = d.error or "entry has no payload"
        if d.payload is not None:
            try:
                return decode(d.payload, self.kind)
            except MessageError as exc:
                reason = str(exc)
        log.warning("passed over", stage=self.stage, entry_id=d.entry_id, reason=reason[:500])
        await self.consumer.ack([d.entry_id])  # the owning stage dead-letters it
        return None

    async def _lost_deliveries(self) -> bool:
        c = self.consumer
        own = await group_state(c.client, c.names, c.stream_name, c.group)
        if own.pending <= len(self.held):
            return False
        log.warning("taking back pending entries whose delivery was lost",
                    stream=c.stream_name, pending=own.pending, held=len(self.held))
        return True

    async def settle(self, entry_ids: Sequence[str], settlement: Settlement) -> None:
        """Acknowledge ``entry_ids`` with ``settlement``'s outputs, counters and tickets, in
        one atomic hand-off (two idempotent steps across shards:
        :meth:`queues.shards.ShardedConsumer.ack_many`); they are no longer held."""
        names, s = self.consumer.names, settlement
        if not (s.outputs or s.counts or s.tickets):
            await self.consumer.ack(list(entry_ids))
            self._release(entry_ids)
            return
        await self.consumer.ack_many(
            list(entry_ids),
            s.dedup_id,
            [(names.stream(o.stream), encode(o.message)) for o in s.outputs],
            settled=list(s.tickets) or None,  # type: ignore[arg-type]
            counters=[(names.counter(c.name), c.n) for c in s.counts],
            only_settling=s.only_settling,
        )
        self._release(entry_ids)

    def _release(self, entry_ids: Sequence[str]) -> None:
        self.held.difference_update(entry_ids)
        for eid in entry_ids:
            self.ahead.pop(eid, None)

    async def give_back_ahead(self) -> None:
        """Give back the entries read ahead (held, no step taken on them): they stay pending,
        their read not charged against the delivery limit
        (:meth:`queues.streams.StreamConsumer.give_back`); the entries of a step that began
        keep their charge."""
        ahead, self.ahead = list(self.ahead.values()), {}
        self.held.difference_update(d.entry_id for d in ahead)
        await self.consumer.give_back(ahead)

    async def dead_letter(self, held: Held[M], reason: str, *, frees_ticket: bool = True) -> None:
        """Dead-letter ``held`` with ``reason`` (:func:`runtime.serve.dead_letter`); with
        ``frees_ticket`` an admitted training group frees its admission slot with it."""
        message = held.message if frees_ticket else None
        await dead_letter(self.consumer, self.stage, held.delivery, reason, message)
        self._release([held.entry_id])

    async def handle(
        self,
        batch: list[Held[M]],
        step: Callable[[list[M]], Awaitable[T]],
        probe: Callable[[M], Awaitable[object]] | None = None,
    ) -> tuple[T | None, list[Held[M]]]:
        """``(step(messages), the entries it was taken on)``. A step that raises is retried
        with the retry policy's backoff; past ``max_retries`` each entry goes through
        ``probe`` alone, those that raise there are dead-lettered with their error and the
        step is taken on the rest (``(None, [])`` when none is left). Raises the step's error
        when every entry passes alone, or when there is no ``probe`` (the caller cannot
        isolate: it fails loudly, the supervisor restarts it and the delivery limit bounds
        the redeliveries)."""
        for held in batch:  # begun: a process that dies now is charged their delivery
            self.ahead.pop(held.entry_id, None)
        retry = self.policies.retry
        failure: Exception | None = None
        for attempt in range(retry.max_retries + 1):
            if failure is not None:
                delay = retry.delay(attempt, self._rng)
                log.warning("batch failed, retrying", stage=self.stage, error=_error(failure),
                            retry=attempt, delay_s=delay, entries=len(batch))
                metrics.record_retry(self.consumer.names.run, self.stage)
                await trio.sleep(delay)
            try:
                return await step([h.message for h in batch]), batch
            except Exception as exc:  # the retry policy turns failures into data
                failure = exc
        assert failure is not None
        if probe is None:
            raise failure
        culprits: list[tuple[Held[M], str]] = []
        for held in batch if len(batch) > 1 else []:
            try:
                await probe(held.message)
            except Exception as exc:  # the culprit's failure becomes its dead letter
                culprits.append((held, _error(exc)))
        if len(batch) == 1:  # the batch was the probe
            culprits = [(batch[0], _error(failure))]
        if not culprits:
            raise RuntimeError(
                f"{self.stage}: a batch of {len(batch)} kept failing but each entry passes"
                " alone (not an entry's fault)"
            ) from failure
        for held, error in culprits:
            log.error("isolated a failing entry", stage=self.stage, entry_id=held.entry_id,
                      error=error, group=training_group(held.message))
            await self.dead_letter(
                held, f"{self.stage} failed on it alone after {retry.max_retries + 1}"
                f" failed batch attempts: {error}",
            )
        rest = [h for h in batch if all(h is not c for c, _ in culprits)]
        if not rest:
            return None, []
        return await step([h.message for h in rest]), rest

    async def serve_heartbeats(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await trio.sleep(self.settings.heartbeat_interval_s)
            await self.consumer.heartbeat(sorted(self.held))


async def serve_batches(
    runtime: BatchRuntime[M],
    handler: Callable[[list[Held[M]]], Awaitable[Settlement]],
    *,
    size: int,
    deadline_s: float | None = None,
    until: trio.Event | None = None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Collect batches of up to ``size`` entries (fewer once ``deadline_s`` passed since the
    first), hand each to ``handler`` (retried as in :meth:`BatchRuntime.handle`), and settle
    all its entries with the :class:`Settlement` it returns, in one hand-off. Runs until
    cancelled, or until ``until`` is set (the batch in hand is finished first)."""
    task_status.started()
    while until is None or not until.is_set():
        batch = await runtime.collect(size, deadline_s=deadline_s, until=until)
        if not batch:
            continue

        async def step(_: list[M], batch: list[Held[M]] = batch) -> Settlement:
            return await handler(batch)

        settlement, taken = await runtime.handle(batch, step)
        if settlement is not None:
            await runtime.settle([h.entry_id for h in taken], settlement)


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(exc)).strip()


@asynccontextmanager
async def open_batches(
    consumer: Consumer,
    stage: str,
    kind: type[M],
    policies: Policies,
    settings: BatchSettings,
) -> AsyncIterator[BatchRuntime[M]]:
    """A :class:`BatchRuntime` on ``consumer`` whose held entries are heart-beaten while
    the block runs; on leaving it (cancelled included) the entries read ahead are given back
    uncharged (:meth:`BatchRuntime.give_back_ahead`)."""
    runtime = BatchRuntime(consumer, stage, kind, policies, settings)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve_heartbeats)
            yield runtime
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(5):  # else charged, not lost
            await runtime.give_back_ahead()
