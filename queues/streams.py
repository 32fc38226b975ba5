"""Consumer-group queues on Redis Streams: consume, hand off, dead-letter, reclaim.

Guarantees (for one consumer group on one stream):
- at-least-once delivery: an entry stays in the group's pending list until it is
  acknowledged, and only :meth:`StreamConsumer.complete` or :meth:`StreamConsumer.dead_letter`
  acknowledge it;
- effectively-once hand-off: ``complete`` publishes the outputs, adds the counters it causes
  (:attr:`Handoff.counters`) and acknowledges the input in one Lua script guarded by a dedup
  key derived from (stage, message id), so a message that is handled twice (redelivered,
  reclaimed from a slow consumer, or a script call repeated after a lost reply) publishes its
  outputs and counts once
  (concurrent ``complete`` calls and ``complete_many`` share one script call per batch, each
  hand-off in it still atomic on its own);
- a consumer first drains its own pending list (entries delivered to it before a restart),
  then reads new entries;
- entries idle longer than ``reclaim_min_idle_ms`` in any consumer are taken over by
  :meth:`StreamConsumer.reclaim` (XAUTOCLAIM); live handlers keep theirs with
  :meth:`StreamConsumer.heartbeat`;
- dead-lettering copies the entry with its error text to the dead-letter stream and
  acknowledges it, atomically.
This module moves bytes; decoding and the retry policy live with the caller.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import redis
import structlog
import trio

from streamrl.queues.client import Arg, RedisClient, encode_command, run_script
from streamrl.queues.codec import DeadLetter, M, MessageError, decode, encode
from streamrl.queues.keys import DEAD, Layout, one_slot
from streamrl.queues.payloads import (
    REF_PREFIX,
    Blob,
    PayloadLimits,
    PayloadTooLarge,
    prepare_many,
    resolve,
    store_blobs,
)
from streamrl.queues.scripts import lua
from streamrl.queues.stats import repair_lag

_HANDOFF = lua("handoff.lua")
_DEADLETTER = lua("deadletter.lua")
_TRIM = lua("trim.lua")
_HANDOFF_BATCH = lua("handoff_batch.lua")
_PUBLISH_COUNTED = lua("publish_counted.lua")
_PUBLISH_ONCE = lua("publish_once.lua")
_REQUEUE = lua("requeue.lua")
_GIVEBACK = lua("giveback.lua")

FIELD = b"d"
_FLUSHES_IN_FLIGHT = 2  # hand-off script calls one consumer has in flight at once

log = structlog.get_logger()


def consumer_name() -> str:
    """host:pid:uuid, unique per process start."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Delivery:
    entry_id: str
    payload: bytes | None  # None: unusable (no payload field, oversize, blob gone): see error
    deliveries: int
    error: str | None = None  # why the payload is None; the caller dead-letters the entry
    raw: bytes | None = None  # what the entry held (for the dead letter when payload is None)
    past_limit: bool = False  # delivered more than max_deliveries times: payload not resolved


@dataclass(slots=True)  # not frozen: a frozen init costs a setattr call per field (hot path)
class Handoff:
    """Acknowledge ``entry_id`` after publishing ``outputs`` [(stream key, payload)] once."""

    entry_id: str
    dedup_id: str
    outputs: Sequence[tuple[str, bytes]] = ()
    counters: Sequence[tuple[str, int]] = ()
    """[(counter key, increment)] added in the same script as the outputs, under the same
    dedup key: only by the delivery that publishes them, so a replayed hand-off counts once.
    The keys must be in the slot of the input stream (:meth:`queues.keys.Layout.counter`)."""
    stores: Sequence[tuple[str, str, bytes]] = ()
    """[(hash key, field, value)] set (HSET, the key's expiry renewed to ``blob_ttl_s``) in
    the same script as the outputs, under the same dedup key: a replayed hand-off stores
    nothing (no orphan field). Keys in the slot of the input stream
    (:meth:`queues.keys.Layout.context`)."""
    deletes: Sequence[str] = ()
    """Keys deleted (DEL) in the same script as the outputs, under the same dedup key (the
    stored context of an episode that ends with this hand-off); same slot."""
    counts_if_open: str | None = None
    """A ticket: the ``counters`` are added only if it is open
    (:attr:`queues.keys.Layout.open_tickets`, checked in the same script), so an entry whose
    ticket was never opened (forged) or is settled already counts nothing; the outputs are
    published all the same."""


@dataclass(frozen=True)
class ConsumerSettings:
    block_ms: int = 2000
    reclaim_min_idle_ms: int = 60_000
    dedup_ttl_s: int = 24 * 3600
    flush_batch: int = 256
    limits: PayloadLimits = field(default_factory=PayloadLimits)
    trim_interval_s: float = 30.0
    """How often the consumer trims acknowledged entries off its stream (0: never)."""
    retain_acked: int = 1000
    """Newest entries kept even when acknowledged (replay, debugging)."""
    trim_batch: int = 10_000
    """Most entries deleted per trim script call (bounds the time Redis is busy)."""
    forget_consumers_idle_ms: int = 3_600_000
    """Trimming also drops consumers idle this long with nothing pending (0: never)."""
    max_deliveries: int = 0
    """An entry delivered more often than this is handed out unresolved (no blob fetched,
    ``payload`` None, ``past_limit``) for the caller to dead-letter (0: no limit here)."""


def over_delivery_limit(deliveries: int, limit: int) -> str:
    """The dead-letter reason of an entry delivered more than ``limit`` times."""
    return (
        f"delivered {deliveries} times (> {limit}): its handler's process died or hung, or"
        " its infrastructure was unavailable, every time"
    )


def _decode_entries(raw: Any) -> list[tuple[str, bytes | None]]:
    out = []
    for entry_id, fields in raw or []:
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        out.append((eid, (fields or {}).get(FIELD)))
    return out


def _reply_entries(reply: Any) -> list[tuple[str, bytes | None]]:
    """:func:`_decode_entries` of a raw XREADGROUP / XREAD reply for one stream, as the
    parser gives it (:meth:`queues.client.BlockingConnection.execute`): a RESP3 map
    {stream: entries}, a RESP2 array [[stream, entries]], or None when nothing came."""
    if not reply:
        return []
    entries = next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]
    return [
        (
            eid.decode() if isinstance(eid, bytes) else eid,
            fields[1] if fields and fields[0] == FIELD else _field(fields),
        )
        for eid, fields in entries
    ]


def _field(fields: list[bytes] | None) -> bytes | None:
    """The payload field of an entry's [field, value, ...] (None: none, or entry deleted)."""
    for i in range(0, len(fields or ()) - 1, 2):
        if fields[i] == FIELD:  # type: ignore[index]
            return fields[i + 1]  # type: ignore[index]
    return None


def _id_order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _Batch:
    """Hand-offs flushed together; ``done`` is set once they are applied in Redis."""

    __slots__ = ("done", "handoffs")

    def __init__(self) -> None:
        self.handoffs: list[Handoff] = []
        self.done = trio.Event()


class StreamConsumer:
    """One consumer of one group on one stream. Use :func:`open_stream_consumer`."""

    def __init__(
        self,
        client: RedisClient,
        names: Layout,
        stream: str,
        group: str,
        *,
        stage: str,
        consumer: str | None = None,
        settings: ConsumerSettings | None = None,
    ) -> None:
        self.client = client
        self.names = names
        self.stream = names.stream(stream)
        self.stream_name = stream
        self.group = group
        self.stage = stage
        self.consumer = consumer or consumer_name()
        self.settings = settings or ConsumerSettings()
        self.dead_stream = names.stream(DEAD)
        self._blocking = client.blocking_connection(self.stream)
        self._handoff = client.sync.register_script(_HANDOFF)
        self._deadletter = client.sync.register_script(_DEADLETTER)
        self._trim = client.sync.register_script(_TRIM)
        self._handoff_batch = client.sync.register_script(_HANDOFF_BATCH)
        self._giveback = client.sync.register_script(_GIVEBACK)
        self._read_new = ("XREADGROUP", "GROUP", group, self.consumer, "COUNT")
        self._pending_cursor: str | None = "0"  # None once the own pending list is drained
        self._batches: list[_Batch] = []  # hand-offs waiting for serve_flusher, oldest first
        self._flush_wanted = trio.lowlevel.ParkingLot()  # idle flushers wait here
        self.statistics_counts = {"read": 0, "reclaimed": 0, "completed": 0, "dead": 0,
                                  "read_calls": 0, "reclaim_calls": 0}
        """Entries read, reclaimed, completed, dead-lettered; and the reads of new entries
        (each one that came back empty blocked ``block_ms``) and the reclaims this consumer
        made, empty ones included: a test's proof that time passed in the consumer."""

    # ------------------------------------------------------------------ setup
    async def ensure_group(self) -> None:
        await ensure_group(self.client, self.stream, self.group)

    # ------------------------------------------------------------------ reading
    def rewind(self) -> None:
        """Read this consumer's own pending list again from its start (before new entries):
        entries whose delivery reached the list but not the caller (a reply lost when Redis
        restarted, a cancelled read). The caller skips the ones it already holds."""
        self._pending_cursor = "0"

    async def read(self, count: int, *, interrupt: trio.Event | None = None) -> list[Delivery]:
        """Up to ``count`` entries: this consumer's own pending ones first, then new ones.

        Blocks up to ``block_ms`` for new entries, or until ``interrupt`` is set (then it
        returns what it has, losing nothing); cancellable at any time (a cancelled read may
        leave entries in this consumer's pending list; the reclaimer covers them).
        """
        if count <= 0:
            return []
        if self._pending_cursor is not None:
            pending = await self._read_own_pending(count, self._pending_cursor)
            if pending:
                self._pending_cursor = pending[-1].entry_id
                return pending
            self._pending_cursor = None
        command: list[Arg] = [*self._read_new, count, "BLOCK", self.settings.block_ms]
        command += ("STREAMS", self.stream, ">")
        raw = await self._blocking.execute(encode_command(command), interrupt=interrupt)
        entries = _reply_entries(raw)
        self.statistics_counts["read"] += len(entries)
        self.statistics_counts["read_calls"] += 1
        return await self._deliveries(entries, None)

    async def _read_own_pending(self, count: int, after: str) -> list[Delivery]:
        raw: Any = await self.client.call(
            self.client.sync.xreadgroup,
            self.group,
            self.consumer,
            {self.stream: after},
            count=count,
        )
        entries = _decode_entries(raw[0][1]) if raw else []
        if not entries:
            return []
        counts = await self._delivery_counts([eid for eid, _ in entries])
        return await self._deliveries(entries, counts)

    async def _deliveries(
        self, entries: list[tuple[str, bytes | None]], counts: dict[str, int] | None
    ) -> list[Delivery]:
        """Claim-check references swapped for their blobs, limits checked (queues.payloads).
        The delivery limit comes first: an entry past ``max_deliveries`` is handed out with
        its error and nothing of its payload fetched (a blob that kills its reader cannot keep
        it alive), and no entry's payload can fail the read of the batch."""
        limits, key = self.settings.limits, self.stream
        if counts is None and all(  # new entries, each a plain payload: nothing to check
            p is not None and len(p) <= limits.max_bytes and not p.startswith(REF_PREFIX)
            for _, p in entries
        ):
            return [Delivery(eid, p, 1, None, p) for eid, p in entries]
        counts = counts or {}
        limit = self.settings.max_deliveries
        past = {eid for eid, _ in entries if limit and counts.get(eid, 1) > limit}
        todo = [(eid, p) for eid, p in entries if eid not in past]
        if any(p is not None and p.startswith(REF_PREFIX) for _, p in todo):
            resolved = await self.client.call(
                resolve, self.client.sync, todo, limits, stream_key=key
            )
        else:
            resolved = resolve(None, todo, limits, stream_key=key)  # no blob to fetch: no I/O
        by_id = dict(zip((eid for eid, _ in todo), resolved, strict=True))
        out = []
        for eid, raw in entries:
            n = counts.get(eid, 1)
            if eid in past:
                error = over_delivery_limit(n, limit)
                out.append(Delivery(eid, None, n, error, raw, past_limit=True))
            else:
                r = by_id[eid]
                out.append(Delivery(eid, r.payload, n, r.error, r.raw))
        return out

    async def _delivery_counts(self, entry_ids: list[str]) -> dict[str, int]:
        """Delivery counts of entries pending in this consumer: one XPENDING over their id
        range (the ids were just read or claimed by it); ids past a cut-short range are looked
        up one by one. An id no longer pending here is left out."""

        def fetch() -> dict[str, int]:
            sync = self.client.sync
            ids = sorted(entry_ids, key=_id_order)
            limit = 2 * len(ids) + 16  # room for this consumer's other entries in the range
            rows = sync.xpending_range(
                self.stream, self.group, ids[0], ids[-1], limit, consumername=self.consumer
            )
            seen = {_str(row["message_id"]): int(row["times_delivered"]) for row in rows}
            out = {eid: seen[eid] for eid in entry_ids if eid in seen}
            rest = [eid for eid in entry_ids if eid not in out] if len(rows) >= limit else []
            if rest:
                pipe = sync.pipeline(transaction=False)
                for eid in rest:
                    pipe.xpending_range(self.stream, self.group, eid, eid, 1, self.consumer)
                for eid, found in zip(rest, pipe.execute(), strict=True):
                    if found:
                        out[eid] = int(found[0]["times_delivered"])
            return out

        return await self.client.call(fetch)

    async def reclaim(self, count: int) -> list[Delivery]:
        """Take over up to ``count`` entries idle longer than min-idle in any consumer."""
        if count <= 0:
            return []
        raw = await self.client.call(
            self.client.sync.xautoclaim,
            self.stream,
            self.group,
            self.consumer,
            min_idle_time=self.settings.reclaim_min_idle_ms,
            start_id="0-0",
            count=count,
        )
        self.statistics_counts["reclaim_calls"] += 1
        entries = _decode_entries(raw[1])
        if not entries:
            return []
        counts = await self._delivery_counts([eid for eid, _ in entries])
        self.statistics_counts["reclaimed"] += len(entries)
        return await self._deliveries(entries, counts)

    async def heartbeat(self, entry_ids: list[str]) -> None:
        """Reset the idle time of entries this consumer is still working on."""
        if entry_ids:
            await self.client.call(
                self.client.sync.xclaim,
                self.stream,
                self.group,
                self.consumer,
                0,
                entry_ids,
                justid=True,
            )

    async def give_back(self, deliveries: Sequence[Delivery]) -> int:
        """Return entries handed out to this consumer that no handler began (read ahead, or
        released before their work started): each still pending here with the delivery count
        it was handed out with keeps the count it had before (``giveback.lua``), so reading it
        is not charged against ``max_deliveries``. It stays pending, for this consumer's next
        read of its own pending list or a reclaimer. Returns how many were given back; 0 when
        Redis refuses (logged: they stay pending, charged, never lost)."""
        if not deliveries:
            return 0
        args: list[Arg] = [self.group, self.consumer]
        for d in deliveries:
            args += (d.entry_id, d.deliveries)
        try:
            given = int(await self.client.call(self._giveback, keys=[self.stream], args=args))
        except redis.RedisError as exc:
            log.warning("not given back", stream=self.stream_name, error=str(exc))
            return 0
        log.info("given back", stream=self.stream_name, entries=len(deliveries), given=given)
        return given

    # ------------------------------------------------------------------ finishing
    async def complete(self, handoff: Handoff) -> None:
        """Publish outputs once and acknowledge; returns when durable in Redis.

        Concurrent calls are batched by :meth:`serve_flusher` into one script call
        (``handoff_batch.lua``, one round trip) of up to ``flush_batch`` hand-offs; each
        hand-off's publish and ack are atomic. Raises
        :class:`queues.payloads.PayloadTooLarge` (publishing and acknowledging nothing) when an
        output is over ``limits.max_bytes``; outputs over ``limits.claim_check_bytes`` are
        stored as blobs first and referenced.
        """
        await self.complete_many([handoff])

    async def complete_many(self, handoffs: list[Handoff]) -> None:
        """:meth:`complete` for several hand-offs at once (one wait instead of one task each);
        returns when all are applied. Each is published once and acknowledged atomically, as
        with ``complete``; all outputs are checked against the limits before any is queued.
        Once queued, a hand-off is applied even if the caller stops waiting (cancelled): that
        is harmless, a hand-off is idempotent."""
        if not handoffs:
            return
        limits = self.settings.limits
        for h in handoffs:
            for key, _, value in h.stores:
                if len(value) > limits.max_bytes:
                    raise PayloadTooLarge(
                        f"stored part of {len(value)} bytes for {key} is over the limit of "
                        f"{limits.max_bytes} bytes (queues.max_message_bytes)")
        prepared = handoffs
        # an output up to claim_check_bytes (<= max_bytes) goes as it is: one check per batch
        if any(len(p) > limits.claim_check_bytes for h in handoffs for _, p in h.outputs):
            prepared, blobs = self._claim_checked(handoffs)
            if blobs:
                await self._store_blobs(blobs)
        batches = self._batches
        waits: list[_Batch] = []
        for h in prepared:
            if not batches or len(batches[-1].handoffs) >= self.settings.flush_batch:
                batches.append(_Batch())
            if not waits or waits[-1] is not batches[-1]:
                waits.append(batches[-1])
            batches[-1].handoffs.append(h)
        self._flush_wanted.unpark(count=len(waits))
        for batch in waits:
            await batch.done.wait()

    def _claim_checked(self, handoffs: list[Handoff]) -> tuple[list[Handoff], list[Blob]]:
        """``handoffs`` with their outputs through :func:`queues.payloads.prepare_many` (large
        ones referenced, their blobs returned to store first; raises PayloadTooLarge)."""
        prepared: list[Handoff] = []
        blobs: list[Blob] = []
        for h in handoffs:
            outputs, more = prepare_many(h.outputs, self.settings.limits)
            if more:
                blobs += more
                h = dataclasses.replace(h, outputs=outputs)
            prepared.append(h)
        return prepared, blobs

    async def serve_flusher(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Flush queued hand-offs, one batch per script call; a batch fills while earlier
        ones are in flight (group commit). ``_FLUSHES_IN_FLIGHT`` calls are in flight at
        most, so Redis can apply one batch while the next is packed and sent; batches are
        independent (each hand-off touches only its own entry and dedup key), so the order
        in which they are applied does not matter."""
        async with trio.open_nursery() as nursery:
            for _ in range(_FLUSHES_IN_FLIGHT):
                nursery.start_soon(self._serve_flushes)
            task_status.started()

    async def _serve_flushes(self) -> None:
        while True:
            while not self._batches:
                await self._flush_wanted.park()
            batch = self._batches.pop(0)
            await self.client.call(self._flush, batch.handoffs)
            self.statistics_counts["completed"] += len(batch.handoffs)
            batch.done.set()

    def _flush(self, batch: list[Handoff]) -> list[int]:
        """Run handoff_batch.lua over ``batch``; returns [published, acked]. Repeatable (the
        client retries it after a lost connection): a replay publishes nothing twice."""
        keys: list[str] = [self.stream]
        args: list[Any] = [self.group, self.settings.dedup_ttl_s]
        ttl = self.settings.limits.blob_ttl_s
        for h in batch:
            if not (h.counters or h.stores or h.deletes):  # the common shape: 2 arguments
                args += (h.entry_id, len(h.outputs))
                if h.outputs:
                    keys.append(h.dedup_id)
                    for stream, payload in h.outputs:
                        keys.append(stream)
                        args.append(payload)
                continue
            checked = h.counts_if_open is not None and bool(h.counters)
            args += (h.entry_id, -2 if checked else -1, len(h.outputs), len(h.counters),
                     len(h.stores), len(h.deletes))  # fmt: skip
            if checked:
                args.append(h.counts_if_open)
            keys.append(h.dedup_id)
            for stream, payload in h.outputs:
                keys.append(stream)
                args.append(payload)
            for counter, increment in h.counters:
                keys.append(counter)
                args.append(increment)
            for key, name, value in h.stores:
                keys.append(key)
                args += (name, value, ttl)
            keys += h.deletes
            if checked:
                keys.append(self.names.open_tickets)
        if self.client.cluster is not None:  # redis-py routes it (and follows MOVED)
            return self._handoff_batch(keys=keys, args=args)  # type: ignore[no-any-return]
        reply: list[int] = run_script(self._handoff_batch, self.client.sync, keys, args)
        return reply

    async def _store_blobs(self, blobs: list[Blob]) -> None:
        def run() -> None:
            pipe = self.client.sync.pipeline(transaction=False)
            store_blobs(pipe, blobs, self.settings.limits)
            pipe.execute()

        await self.client.call(run)

    async def ack_many(
        self,
        entry_ids: list[str],
        dedup_id: str,
        outputs: list[tuple[str, bytes]],
        *,
        settled: list[str] | None = None,
        counters: list[tuple[str, int]] | None = None,
        only_settling: bool = False,
    ) -> None:
        """Acknowledge a batch of entries and publish ``outputs`` once, atomically; the
        ``settled`` tickets (those the entries carry) leave the shard's open tickets
        (:attr:`queues.keys.Layout.open_tickets`) in the same step, and ``counters``
        [(key, increment)] are added with the outputs, under the same dedup key (once, as in
        :attr:`Handoff.counters`); with ``only_settling``, only if the step took one of the
        ``settled`` tickets out of the open set (a ticket released already, or never opened,
        counts nothing)."""
        outputs, blobs = prepare_many(outputs, self.settings.limits)
        if blobs:
            await self._store_blobs(blobs)
        members = sorted(set(settled or ()))
        record = [self.names.open_tickets] if members else []
        counted = counters or []
        keys = [self.stream, dedup_id, *record, *(k for k, _ in counted)]
        keys += [s for s, _ in outputs]
        args: list[Any] = [self.group, self.settings.dedup_ttl_s, len(entry_ids), *entry_ids]
        args += [len(members), *members]
        args += [len(counted), *(n for _, n in counted), "1" if only_settling else "0"]
        args += [p for _, p in outputs]
        await self.client.call(self._handoff, keys=keys, args=args)

    async def read_stored(self, entry_id: str, key: str, fields: list[str]) -> list[bytes | None]:
        """The values of ``fields`` of hash ``key`` (HMGET; None where a field is gone), as
        :attr:`Handoff.stores` wrote them for the entries of this stream (``entry_id``: the
        entry that references them; ``key`` named by :attr:`names`)."""
        if not fields:
            return []
        values: Any = await self.client.call(self.client.sync.hmget, key, fields)
        return list(values)

    async def ack(self, entry_ids: list[str]) -> None:
        """Acknowledge entries without publishing anything (idempotent). For a hand-off whose
        outputs live in another slot: :meth:`Producer.publish_once` first, then this."""
        if entry_ids:
            await self.client.call(self.client.sync.xack, self.stream, self.group, *entry_ids)

    async def dead_letter(
        self,
        delivery: Delivery,
        error: str,
        *,
        ticket: str | None = None,
        counters: list[tuple[str, int]] | None = None,
    ) -> None:
        """Move an entry to the dead-letter stream with its error; acknowledge it. ``ticket``:
        the ticket the entry carries; if it is still open
        (:attr:`queues.keys.Layout.open_tickets`), the letter releases it, once: out of the
        open set and counted in :attr:`queues.keys.Layout.released_tickets` (what the pipeline
        does with a released ticket: :mod:`streamrl.protocol.names`), and ``counters``
        [(key, increment)] (in the stream's slot) are added in the same step, so once; the
        ticket and the counters are recorded (:attr:`queues.keys.Layout.released_ids`,
        :attr:`queues.keys.Layout.released_counts`) for :func:`requeue_dead_letter`."""
        letter = DeadLetter(
            stream=self.stream_name,
            group=self.group,
            entry_id=delivery.entry_id,
            error=error[:4000],
            deliveries=delivery.deliveries,
            payload=delivery.payload if delivery.payload is not None else delivery.raw or b"",
            at=time.time(),
        )
        written = await self.client.call(
            self._deadletter,
            keys=[self.stream, self.dead_stream, self.names.released_tickets,
                  self.names.open_tickets, self.names.released_ids, self.names.released_counts,
                  *(k for k, _ in counters or ())],
            args=[self.group, delivery.entry_id, encode(letter), error[:4000], ticket or "",
                  *(n for _, n in counters or ())],
        )
        if written:
            log.error("dead-lettered", stream=self.stream_name, key=self.stream,
                      group=self.group, entry_id=delivery.entry_id,
                      deliveries=delivery.deliveries, reason=error[:500])
        else:
            log.info("dead letter skipped: settled already", stream=self.stream_name,
                     entry_id=delivery.entry_id, reason=error[:500])
        self.statistics_counts["dead"] += 1

    async def trim(self) -> int:
        """Delete acknowledged entries (and their blobs) below the oldest one any group of
        this stream still needs, keeping the newest ``retain_acked``; returns how many."""
        s = self.settings
        total = 0
        while True:
            deleted = int(
                await self.client.call(
                    self._trim,
                    keys=[self.stream],
                    args=[s.retain_acked, s.trim_batch, REF_PREFIX, s.forget_consumers_idle_ms],
                )
            )
            total += deleted
            if deleted < s.trim_batch:
                return total

    async def repair_lag(self) -> None:
        """Set this group's ``entries-read`` right where the server lost it (Redis 7.0 after
        loading a rewritten AOF; :func:`queues.stats.repair_lag`), so its lag heals."""
        repaired = await repair_lag(self.client, self.stream, self.group)
        if repaired is not None:
            log.warning(
                "consumer group lag repaired", stream=self.stream_name, group=self.group,
                entries_read_was=repaired.entries_read_was, entries_read=repaired.entries_read,
                lag=repaired.lag,
            )  # fmt: skip

    async def serve_trimmer(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Housekeeping every ``trim_interval_s`` (0: none): repair the group's lag (at start
        too), trim acknowledged entries."""
        task_status.started()
        interval = self.settings.trim_interval_s
        if interval <= 0:
            return
        while True:
            try:
                await self.repair_lag()
            except redis.RedisError as exc:  # housekeeping must never stop the actor
                log.warning("lag repair failed", stream=self.stream_name, error=str(exc))
            await trio.sleep(interval)
            try:
                await self.trim()
            except redis.RedisError as exc:  # memory housekeeping must never stop the actor
                log.warning("trim failed", stream=self.stream_name, error=str(exc))

    def close(self) -> None:
        self._blocking.close()


@asynccontextmanager
async def open_stream_consumer(
    client: RedisClient,
    names: Layout,
    stream: str,
    *,
    stage: str,
    group: str | None = None,
    consumer: str | None = None,
    settings: ConsumerSettings | None = None,
) -> AsyncIterator[StreamConsumer]:
    c = StreamConsumer(
        client,
        names,
        stream,
        group or names.group(stream),
        stage=stage,
        consumer=consumer,
        settings=settings,
    )
    await c.ensure_group()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(c.serve_flusher)
            await nursery.start(c.serve_trimmer)
            yield c
            nursery.cancel_scope.cancel()
    finally:
        c.close()


async def ensure_group(client: RedisClient, stream_key: str, group: str) -> None:
    """Create the consumer group (and the stream) if missing; reads from the beginning."""
    try:
        await client.call(client.sync.xgroup_create, stream_key, group, id="0", mkstream=True)
    except redis.ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


class Producer:
    """Publishes to streams of one run (for a process that only produces)."""

    def __init__(
        self, client: RedisClient, names: Layout, limits: PayloadLimits | None = None
    ) -> None:
        self.client = client
        self.names = names
        self.limits = limits or PayloadLimits()
        self._publish_counted = client.sync.register_script(_PUBLISH_COUNTED)
        self._publish_once = client.sync.register_script(_PUBLISH_ONCE)

    async def publish(self, stream: str, payloads: list[bytes]) -> list[str]:
        """XADD each payload; raises PayloadTooLarge (writing nothing) if one is over the
        limit; large ones go through the claim check."""
        key = self.names.stream(stream)
        prepared, blobs = prepare_many([(key, p) for p in payloads], self.limits)

        def run() -> list[str]:
            pipe = self.client.sync.pipeline(transaction=False)
            store_blobs(pipe, blobs, self.limits)
            for _, p in prepared:
                pipe.xadd(key, {FIELD: p})
            return [i.decode() for i in pipe.execute()[len(blobs) :]]

        return await self.client.call(run)

    async def publish_counted(
        self,
        stream: str,
        payloads: list[bytes],
        counter: str,
        expected: int,
        *,
        members: list[str] | None = None,
        tally: tuple[str, dict[str, int]] | None = None,
    ) -> int:
        """XADD ``payloads`` and add their number to the ``counter`` key, in one script, only
        if the counter still holds ``expected`` (compare-and-set). Safe to replay: after a
        lost reply, or when another producer moved the counter, it adds nothing. Returns the
        number of entries added (0 or ``len(payloads)``). ``members`` (the tickets the
        entries carry) are opened (:attr:`queues.keys.Layout.open_tickets`) in the same
        step; ``tally`` ``(hash key, {field: n})`` (same slot) is added to in that step too."""
        key = self.names.stream(stream)
        prepared, blobs = prepare_many([(key, p) for p in payloads], self.limits)
        pairs = [x for field, n in (tally[1].items() if tally else ()) for x in (field, n)]

        def run() -> int:
            if blobs:
                pipe = self.client.sync.pipeline(transaction=False)
                store_blobs(pipe, blobs, self.limits)
                pipe.execute()
            record = [self.names.open_tickets] if members else []
            record += [tally[0]] if tally and pairs else []
            args: list[Any] = [expected, len(members or ()), *(members or ())]
            args += [len(pairs) // 2, *pairs]
            args += [p for _, p in prepared]
            return int(self._publish_counted(keys=[key, counter, *record], args=args))

        return await self.client.call(run)

    async def publish_once(
        self,
        dedup_key: str,
        outputs: list[tuple[str, bytes]],
        *,
        dedup_ttl_s: int = 24 * 3600,
        members: list[str] | None = None,
    ) -> bool:
        """XADD ``outputs`` [(stream name, payload)] unless ``dedup_key`` exists, in one script;
        returns whether they were published. The dedup key and the streams must share a slot
        (e.g. run-global streams and a dedup key of the unsharded names). With
        :meth:`StreamConsumer.ack` after it, this is the cross-slot hand-off: not atomic, but
        idempotent (a crash in between leaves the input pending; handled again, the publish
        adds nothing and the acknowledgement goes through). ``members`` (tickets) are opened in
        this layout's :attr:`queues.keys.Layout.open_tickets` with them."""
        keys = [self.names.stream(s) for s, _ in outputs]
        record = [self.names.open_tickets] if members else []
        if not one_slot([dedup_key, *record, *keys]):
            raise ValueError(f"publish_once: {dedup_key} and {keys} are not in one hash slot")
        prepared, blobs = prepare_many(
            [(k, p) for k, (_, p) in zip(keys, outputs, strict=True)], self.limits
        )

        def run() -> bool:
            if blobs:
                pipe = self.client.sync.pipeline(transaction=False)
                store_blobs(pipe, blobs, self.limits)
                pipe.execute()
            args: list[Any] = [dedup_ttl_s, len(members or ()), *(members or ())]
            args += [p for _, p in prepared]
            return bool(self._publish_once(keys=[dedup_key, *record, *keys], args=args))

        return await self.client.call(run)


class EventReader:
    """Reads an event stream (no group) from an offset; blocking and cancellable."""

    def __init__(self, client: RedisClient, names: Layout, stream: str, *, block_ms: int = 2000):
        self.client = client
        self.stream = names.stream(stream)
        self.block_ms = block_ms
        self._blocking = client.blocking_connection(self.stream)
        self.last_id = "0-0"

    async def latest(self) -> tuple[str, bytes] | None:
        raw = await self.client.call(self.client.sync.xrevrange, self.stream, count=1)
        entries = _decode_entries(raw)
        if not entries or entries[0][1] is None:
            return None
        self.last_id = entries[0][0]
        return entries[0][0], entries[0][1]  # type: ignore[return-value]

    async def newest_id(self) -> str | None:
        """The id of the stream's newest entry, whatever it holds (None: the stream is empty);
        the read position is left as it is."""
        raw = await self.client.call(self.client.sync.xrevrange, self.stream, count=1)
        entries = _decode_entries(raw)
        return entries[0][0] if entries else None

    async def read(self, count: int = 100) -> list[tuple[str, bytes]]:
        raw: Any = await self._blocking.call(
            self._blocking.sync.xread, {self.stream: self.last_id}, count=count, block=self.block_ms
        )
        entries = _decode_entries(raw[0][1]) if raw else []
        if entries:
            self.last_id = entries[-1][0]
        return [(eid, p) for eid, p in entries if p is not None]

    async def read_events(self, kind: type[M], count: int = 100) -> list[M]:
        """:meth:`read`, decoded as ``kind``; undecodable events are logged and skipped."""
        return self._decoded(await self.read(count), kind)

    def _decoded(self, entries: list[tuple[str, bytes]], kind: type[M]) -> list[M]:
        out = []
        for eid, payload in entries:
            try:
                out.append(decode(payload, kind))
            except MessageError as exc:
                log.error("undecodable event skipped", stream=self.stream, entry_id=eid,
                          reason=str(exc)[:500])
        return out

    def close(self) -> None:
        self._blocking.close()


async def requeue_dead_letter(
    client: RedisClient,
    layout: Layout,
    stream: str,
    dead_id: str,
    payload: bytes,
    limits: PayloadLimits,
    *,
    ticket: str | None = None,
    counters: Sequence[str] = (),
    most: int = 1,
) -> str | None:
    """Put a dead letter's payload back on ``stream`` (a stream name of ``layout``, the
    letter's shard) as a new entry and delete the letter from the layout's dead-letter
    stream, atomically (``requeue.lua``; all keys in one slot). ``ticket``: the ticket the
    payload carries. Only if a dead letter released that ticket
    (:attr:`queues.keys.Layout.released_ids`, written by the letter's script) is the release
    taken back, once: one less in :attr:`queues.keys.Layout.released_tickets`, the ticket
    open again, and of each of ``counters`` what the releasing letter recorded adding to it
    (:func:`released_counters`), at most ``most``; no counter below zero. The letter's own
    fields are never trusted. A payload over the claim-check size is stored out of band
    first. Returns the new entry id, or None when the letter was gone already (requeued or
    purged): repeatable."""
    script = client.sync.register_script(_REQUEUE)
    prepared, blobs = prepare_many([(layout.stream(stream), payload)], limits)
    keys = [layout.stream(DEAD), layout.stream(stream), layout.released_tickets,
            layout.open_tickets, layout.released_ids, layout.released_counts, *counters]

    def run() -> Any:
        if blobs:
            pipe = client.sync.pipeline(transaction=False)
            store_blobs(pipe, blobs, limits)
            pipe.execute()
        return script(keys=keys, args=[dead_id, prepared[0][1], ticket or "", most])

    new_id = await client.call(run)
    if not new_id:
        return None
    return new_id.decode() if isinstance(new_id, bytes) else str(new_id)


async def released_counters(client: RedisClient, layout: Layout, ticket: str) -> list[str]:
    """The counter keys the letter that released ``ticket`` in ``layout``'s shard added to
    (:attr:`queues.keys.Layout.released_counts`); none if no letter released it. Op:
    :class:`queues.operations.RequeueDead`."""
    record = await client.call(client.sync.hget, layout.released_counts, ticket)
    try:
        return [str(key) for key, _ in json.loads(record or b"[]")]
    except (ValueError, TypeError):
        return []


def counted_keys(fields: Mapping[bytes, bytes]) -> list[str]:
    """The counter keys a dead entry's letter added with its released ticket (its field
    ``counted``, written by ``deadletter.lua``); none for a letter without it or unreadable."""
    try:
        pairs = json.loads(fields.get(b"counted", b"[]"))
        return [str(key) for key, _ in pairs]
    except (ValueError, TypeError):
        return []
