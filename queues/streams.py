"""Consumer-group queues on Redis Streams: consume, hand off, dead-letter, reclaim.

Guarantees (for one consumer group on one stream):
- at-least-once delivery: an entry stays in the group's pending list until it is
  acknowledged, and only :meth:`StreamConsumer.complete` or :meth:`StreamConsumer.dead_letter`
  acknowledge it;
- effectively-once hand-off: ``complete`` publishes the outputs and acknowledges the input in
  one Lua script guarded by a dedup key derived from (stage, message id), so a message that is
  handled twice (redelivered, or reclaimed from a slow consumer) publishes its outputs once;
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

import os
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import redis
import trio

from queues import names as N
from queues.client import RedisClient
from queues.messages import DeadLetter, encode, now

_HANDOFF = resources.files("queues").joinpath("handoff.lua").read_text()
_DEADLETTER = resources.files("queues").joinpath("deadletter.lua").read_text()

FIELD = b"d"


def consumer_name() -> str:
    """host:pid:uuid, unique per process start."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class Delivery:
    entry_id: str
    payload: bytes | None  # None: the entry has no payload field (trimmed, foreign writer)
    deliveries: int


@dataclass(frozen=True)
class Handoff:
    """Acknowledge ``entry_id`` after publishing ``outputs`` [(stream key, payload)] once."""

    entry_id: str
    dedup_id: str
    outputs: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class ConsumerSettings:
    block_ms: int = 2000
    reclaim_min_idle_ms: int = 60_000
    dedup_ttl_s: int = 7 * 24 * 3600
    flush_batch: int = 256


def _decode_entries(raw: Any) -> list[tuple[str, bytes | None]]:
    out = []
    for entry_id, fields in raw or []:
        eid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        out.append((eid, (fields or {}).get(FIELD)))
    return out


class StreamConsumer:
    """One consumer of one group on one stream. Use :func:`open_stream_consumer`."""

    def __init__(
        self,
        client: RedisClient,
        names: N.Names,
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
        self.dead_stream = names.stream(N.DEAD)
        self._blocking = client.blocking_connection()
        self._handoff = client.sync.register_script(_HANDOFF)
        self._deadletter = client.sync.register_script(_DEADLETTER)
        self._pending_cursor: str | None = "0"  # None once the own pending list is drained
        self._send, self._recv = trio.open_memory_channel[tuple[Handoff, trio.Event]](0)
        self.statistics_counts = {"read": 0, "reclaimed": 0, "completed": 0, "dead": 0}

    # ------------------------------------------------------------------ setup
    async def ensure_group(self) -> None:
        await ensure_group(self.client, self.stream, self.group)

    # ------------------------------------------------------------------ reading
    async def read(self, count: int) -> list[Delivery]:
        """Up to ``count`` entries: this consumer's own pending ones first, then new ones.

        Blocks up to ``block_ms`` for new entries; cancellable at any time (a cancelled read
        may leave entries in this consumer's pending list; the reclaimer covers them).
        """
        if count <= 0:
            return []
        if self._pending_cursor is not None:
            pending = await self._read_own_pending(count, self._pending_cursor)
            if pending:
                self._pending_cursor = pending[-1].entry_id
                return pending
            self._pending_cursor = None
        raw: Any = await self._blocking.call(
            self._blocking.sync.xreadgroup,
            self.group,
            self.consumer,
            {self.stream: ">"},
            count=count,
            block=self.settings.block_ms,
        )
        entries = _decode_entries(raw[0][1]) if raw else []
        self.statistics_counts["read"] += len(entries)
        return [Delivery(eid, payload, 1) for eid, payload in entries]

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
        return [Delivery(eid, payload, counts.get(eid, 1)) for eid, payload in entries]

    async def _delivery_counts(self, entry_ids: list[str]) -> dict[str, int]:
        def fetch() -> dict[str, int]:
            pipe = self.client.sync.pipeline(transaction=False)
            for eid in entry_ids:
                pipe.xpending_range(self.stream, self.group, min=eid, max=eid, count=1)
            out = {}
            for eid, rows in zip(entry_ids, pipe.execute(), strict=True):
                if rows:
                    out[eid] = int(rows[0]["times_delivered"])
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
        entries = _decode_entries(raw[1])
        if not entries:
            return []
        counts = await self._delivery_counts([eid for eid, _ in entries])
        self.statistics_counts["reclaimed"] += len(entries)
        return [Delivery(eid, payload, counts.get(eid, 1)) for eid, payload in entries]

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

    # ------------------------------------------------------------------ finishing
    async def complete(self, handoff: Handoff) -> None:
        """Publish outputs once and acknowledge; returns when durable in Redis.

        Concurrent calls are pipelined into one round trip by :meth:`serve_flusher`.
        """
        done = trio.Event()
        await self._send.send((handoff, done))
        await done.wait()

    async def serve_flusher(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            batch = [await self._recv.receive()]
            while len(batch) < self.settings.flush_batch:
                try:
                    batch.append(self._recv.receive_nowait())
                except trio.WouldBlock:
                    break
            await self.client.call(self._flush, [h for h, _ in batch])
            self.statistics_counts["completed"] += len(batch)
            for _, done in batch:
                done.set()

    def _flush(self, batch: list[Handoff]) -> None:
        pipe = self.client.sync.pipeline(transaction=False)
        for h in batch:
            if h.outputs:
                keys = [self.stream, h.dedup_id] + [s for s, _ in h.outputs]
                args: list[Any] = [self.group, self.settings.dedup_ttl_s, 1, h.entry_id]
                args += [p for _, p in h.outputs]
                self._handoff(keys=keys, args=args, client=pipe)
            else:
                pipe.xack(self.stream, self.group, h.entry_id)
        pipe.execute()

    async def ack_many(
        self, entry_ids: list[str], dedup_id: str, outputs: list[tuple[str, bytes]]
    ) -> None:
        """Acknowledge a batch of entries and publish ``outputs`` once, atomically."""
        keys = [self.stream, dedup_id] + [s for s, _ in outputs]
        args: list[Any] = [self.group, self.settings.dedup_ttl_s, len(entry_ids), *entry_ids]
        args += [p for _, p in outputs]
        await self.client.call(self._handoff, keys=keys, args=args)

    async def dead_letter(self, delivery: Delivery, error: str) -> None:
        """Move an entry to the dead-letter stream with its error; acknowledge it."""
        letter = DeadLetter(
            stream=self.stream_name,
            group=self.group,
            entry_id=delivery.entry_id,
            error=error[:4000],
            deliveries=delivery.deliveries,
            payload=delivery.payload or b"",
            at=now(),
        )
        await self.client.call(
            self._deadletter,
            keys=[self.stream, self.dead_stream],
            args=[self.group, delivery.entry_id, encode(letter), error[:4000]],
        )
        self.statistics_counts["dead"] += 1

    def close(self) -> None:
        self._blocking.close()


@asynccontextmanager
async def open_stream_consumer(
    client: RedisClient,
    names: N.Names,
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
        group or N.GROUP_OF_STREAM[stream],
        stage=stage,
        consumer=consumer,
        settings=settings,
    )
    await c.ensure_group()
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(c.serve_flusher)
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
    """Publishes to streams of one run (for stages that only produce, e.g. the scheduler)."""

    def __init__(self, client: RedisClient, names: N.Names) -> None:
        self.client = client
        self.names = names

    async def publish(self, stream: str, payloads: list[bytes]) -> list[str]:
        key = self.names.stream(stream)

        def run() -> list[str]:
            pipe = self.client.sync.pipeline(transaction=False)
            for p in payloads:
                pipe.xadd(key, {FIELD: p})
            return [i.decode() for i in pipe.execute()]

        return await self.client.call(run)


class EventReader:
    """Reads an event stream (no group) from an offset; blocking and cancellable."""

    def __init__(self, client: RedisClient, names: N.Names, stream: str, *, block_ms: int = 2000):
        self.client = client
        self.stream = names.stream(stream)
        self.block_ms = block_ms
        self._blocking = client.blocking_connection()
        self.last_id = "0-0"

    async def latest(self) -> tuple[str, bytes] | None:
        raw = await self.client.call(self.client.sync.xrevrange, self.stream, count=1)
        entries = _decode_entries(raw)
        if not entries or entries[0][1] is None:
            return None
        self.last_id = entries[0][0]
        return entries[0][0], entries[0][1]  # type: ignore[return-value]

    async def read(self, count: int = 100) -> list[tuple[str, bytes]]:
        raw: Any = await self._blocking.call(
            self._blocking.sync.xread, {self.stream: self.last_id}, count=count, block=self.block_ms
        )
        entries = _decode_entries(raw[0][1]) if raw else []
        if entries:
            self.last_id = entries[-1][0]
        return [(eid, p) for eid, p in entries if p is not None]

    def close(self) -> None:
        self._blocking.close()
