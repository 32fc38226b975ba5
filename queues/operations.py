"""The broker's operations: each one thing a process does in Redis, the commands it sends and
the keys it sends them on.

Two halves that belong together:

- **The operations** (:class:`Op` and its kinds): a role of the pipeline is described by the
  list of operations it performs (``protocol/roles.py``), and each operation derives the ACL
  grants it needs on a layout (:meth:`Op.grants`), so a role's ACL user is allowed exactly
  what its table names, never a hand-kept copy of it.
- **The calls** (the functions below, with :mod:`streamrl.queues.streams`,
  :mod:`streamrl.queues.stats` and :mod:`streamrl.queues.shards`): the only place, outside
  ``queues/``, through which code reaches Redis. Each call names the operation that grants it
  (``Op:`` in its docstring); a call of an operation the role's table lacks is refused by the
  server (``NOPERM``) when the process runs as its role's user.

Keys are named per layout: a stream by its name (:meth:`Layout.stream`), any other key by a
:class:`Key` (a function of the layout, e.g. ``Key(lambda n: n.admitted)``), so one table
serves every run and every shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import redis

from streamrl.queues.acl import (
    CONSUME,
    FOLLOW,
    OBSERVE,
    REPAIR,
    SCRIPTS,
    TRIM,
    Grant,
    blob_pattern,
    glob,
    stream_pattern,
)
from streamrl.queues.client import RedisClient
from streamrl.queues.keys import DEAD, Layout, key_slot
from streamrl.queues.payloads import PayloadLimits, Resolved, resolve

Entry = tuple[str, dict[bytes, bytes]]
"""A stream entry: its id and its fields."""


@dataclass(frozen=True)
class Key:
    """A key of a layout (``of(layout)``); ``prefix``: every key that starts with it."""

    of: Callable[[Any], str]
    prefix: bool = False

    def pattern(self, layout: Layout) -> str:
        return glob(self.of(layout)) + ("*" if self.prefix else "")


def counter(name: str, *, prefix: bool = False) -> Key:
    """Counter ``name`` of the work path (:meth:`Layout.counter`), in the layout's shard."""
    return Key(lambda layout: layout.counter(name), prefix)


class Op:
    """One operation: :meth:`grants` are the ACL selectors it needs on ``layout``."""

    def grants(self, layout: Layout) -> list[Grant]:
        raise NotImplementedError


def _streams(layout: Layout, streams: Iterable[str]) -> tuple[str, ...]:
    return tuple(stream_pattern(layout, s) for s in streams)


def _blobs(layout: Layout, streams: Iterable[str]) -> tuple[str, ...]:
    return tuple(blob_pattern(layout, s) for s in streams)


@dataclass(frozen=True)
class Consume(Op):
    """Consume ``stream`` in a group (queues.streams.StreamConsumer: read, reclaim, heartbeat,
    trim, repair the lag) and hand its entries off into ``outputs`` (hand-off scripts: dedup
    key ``dedup:<stage>:*``, XADD, XACK; the ``counters`` they add) or to the dead-letter
    stream (an open ticket of the letter released once); ``watch``: outputs whose backlog it
    observes (backpressure), saying it is paused on it (``paused:<stage>``)."""

    stream: str
    stage: str
    outputs: tuple[str, ...] = ()
    counters: tuple[Key, ...] = ()
    watch: tuple[str, ...] = ()
    stores: tuple[Key, ...] = ()
    """Hashes its hand-offs store fields in and delete (``Handoff.stores``/``deletes``)."""

    def grants(self, layout: Layout) -> list[Grant]:
        source, blobs = stream_pattern(layout, self.stream), blob_pattern(layout, self.stream)
        stores = tuple(k.pattern(layout) for k in self.stores)
        dead = stream_pattern(layout, DEAD)
        released, tickets = glob(layout.released_tickets), glob(layout.open_tickets)
        record = (glob(layout.released_ids), glob(layout.released_counts))
        outs, out_blobs = _streams(layout, self.outputs), _blobs(layout, self.outputs)
        dedup = (glob(layout.dedup(self.stage, "")) + "*",) if self.outputs else ()
        counters = tuple(k.pattern(layout) for k in self.counters)
        grants = [
            Grant(CONSUME + TRIM + REPAIR, rw=(source,)),
            Grant(("get", "del"), rw=(blobs,)),  # claim checks: fetched, deleted by the trim
            Grant(
                SCRIPTS,
                rw=(source, blobs, dead, released, tickets, *record, *outs, *dedup,
                    *out_blobs, *counters, *stores),
            ),
            Grant(("xadd",), write=(dead, *outs)),
            Grant(("incr",), rw=(released,)),  # deadletter.lua: a ticket's slot freed ...
            # ... if the ticket is still open (once), moved to the released ones with what
            # its letter counted; a hand-off that settles it takes it out
            Grant(("smove",), rw=(tickets, record[0])),
            Grant(("hset",), write=(record[1],)),
            Grant(("srem",), rw=(tickets,)),
            Grant(("sismember",), read=(tickets,)),  # a hand-off counting only an open one
        ]
        if self.outputs:
            grants.append(Grant(("set",), write=(*dedup, *out_blobs)))
        if counters:  # the hand-off scripts add the counters they cause (Handoff.counters)
            grants.append(Grant(("incrby",), rw=counters))
        if stores:  # handoff_batch.lua: HSET + EXPIRE of a stored part, DEL at the end
            grants.append(Grant(("hset", "expire", "del"), rw=stores))
        if self.watch:
            grants.append(Grant(OBSERVE, read=_streams(layout, self.watch)))
            grants.append(Grant(("set",), write=(glob(layout.paused(self.stage)),)))
        return grants


@dataclass(frozen=True)
class Produce(Op):
    """queues.streams.Producer.publish into ``streams``: XADD, claim-check blobs first."""

    streams: tuple[str, ...]

    def grants(self, layout: Layout) -> list[Grant]:
        return [
            Grant(("xadd",), write=_streams(layout, self.streams)),
            Grant(("set",), write=_blobs(layout, self.streams)),
        ]


@dataclass(frozen=True)
class PublishCounted(Op):
    """Publish into ``stream`` and add to ``counter`` in one compare-and-set script, the
    entries' tickets opened with it (queues.streams.Producer.publish_counted); on a sharded
    run the write-ahead record in :attr:`Layout.reservations`, then each shard's publish once
    under ``dedup:<stage>:*`` (queues.shards.publish_counted_routed, finish_counted). Reads
    the counter it compares against. ``tally``: a hash added to in the same step (HINCRBY)."""

    stream: str
    counter: Key
    stage: str = "admit"
    tally: Key | None = None

    def grants(self, layout: Layout) -> list[Grant]:
        stream, blobs = stream_pattern(layout, self.stream), blob_pattern(layout, self.stream)
        count, tickets = self.counter.pattern(layout), glob(layout.open_tickets)
        reserved, dedup = glob(layout.reservations), glob(layout.dedup(self.stage, "")) + "*"
        tally = (self.tally.pattern(layout),) if self.tally else ()
        return [
            Grant(SCRIPTS, rw=(stream, count, tickets, *tally)),  # publish_counted.lua
            Grant(("sadd",), write=(tickets,)),
            Grant(("get", "incrby"), rw=(count,)),
            Grant(SCRIPTS, rw=(count, reserved, *tally)),  # reserve_counted.lua
            Grant(("hget", "hset", "hgetall", "hdel"), rw=(reserved,)),
            *([Grant(("hincrby",), rw=tally)] if tally else []),
            Grant(SCRIPTS, rw=(stream, dedup, blobs, tickets)),  # publish_once.lua
            Grant(("set",), write=(dedup,)),
        ]


@dataclass(frozen=True)
class Follow(Op):
    """queues.streams.EventReader on ``streams``: the latest event, then every new one."""

    streams: tuple[str, ...]

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(FOLLOW, read=_streams(layout, self.streams))]


@dataclass(frozen=True)
class Observe(Op):
    """queues.stats on ``streams``: length, lag and pending of a group, the newest entry's
    age; ``detail``: also every pending entry and consumer (:func:`pending_detail`)."""

    streams: tuple[str, ...]
    detail: bool = False

    def grants(self, layout: Layout) -> list[Grant]:
        extra = ("xpending", "xinfo|consumers") if self.detail else ()
        return [Grant((*OBSERVE, *extra), read=_streams(layout, self.streams))]


@dataclass(frozen=True)
class CountPending(Op):
    """The pending-entry count of a consumer group on ``streams`` (XPENDING), for an
    autoscaler outside the run (KEDA's redis-streams scaler, ``pendingEntriesCount``). XPENDING
    cannot be granted in part: its extended form also lists the pending entries' ids,
    consumers, idle times and delivery counts; no entry's content, no length or lag, no other
    key."""

    streams: tuple[str, ...]

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("xpending",), read=_streams(layout, self.streams))]


@dataclass(frozen=True)
class ReadRange(Op):
    """:func:`read_range` and :func:`latest_entries` of ``streams`` (no consumer group)."""

    streams: tuple[str, ...]

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("xrange", "xrevrange"), read=_streams(layout, self.streams))]


@dataclass(frozen=True)
class ReadBlobs(Op):
    """:func:`get_blob`, :func:`resolve_payloads`: the claim-check blobs of ``streams``."""

    streams: tuple[str, ...]

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("get",), read=_blobs(layout, self.streams))]


@dataclass(frozen=True)
class ReadStored(Op):
    """queues.streams.StreamConsumer.read_stored: fields of the hashes ``keys`` (HMGET)."""

    keys: tuple[Key, ...]

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("hmget",), read=tuple(k.pattern(layout) for k in self.keys))]


@dataclass(frozen=True)
class ReadCounters(Op):
    """:func:`read_counters` of ``keys`` (one call may read several: one selector)."""

    keys: tuple[Key, ...]

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("get", "mget"), read=tuple(k.pattern(layout) for k in self.keys))]


@dataclass(frozen=True)
class ReadTally(Op):
    """:func:`read_tally` of ``key`` (a hash of counts: HGETALL)."""

    key: Key

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("hgetall",), read=(self.key.pattern(layout),))]


@dataclass(frozen=True)
class Increment(Op):
    """:func:`increment` (and :func:`read_counters`) of ``key``."""

    key: Key

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("get", "incrby"), rw=(self.key.pattern(layout),))]


@dataclass(frozen=True)
class ReadFlag(Op):
    """:func:`read_flag` of ``key``."""

    key: Key

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("exists",), read=(self.key.pattern(layout),))]


@dataclass(frozen=True)
class SetFlag(Op):
    """:func:`set_flag` of ``key``."""

    key: Key

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("set",), write=(self.key.pattern(layout),))]


@dataclass(frozen=True)
class ReadHash(Op):
    """:func:`read_hash` of ``key``."""

    key: Key

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("hgetall",), read=(self.key.pattern(layout),))]


@dataclass(frozen=True)
class SetFields(Op):
    """:func:`set_fields` of hash ``key``."""

    key: Key

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("hset",), write=(self.key.pattern(layout),))]


@dataclass(frozen=True)
class DeleteFields(Op):
    """:func:`delete_fields` of hash ``key``."""

    key: Key

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("hdel",), write=(self.key.pattern(layout),))]


@dataclass(frozen=True)
class ReadPaused(Op):
    """queues.stats.paused_stages: which stages are paused on backpressure."""

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("get", "mget"), read=(glob(layout.paused("")) + "*",))]


@dataclass(frozen=True)
class CountReservations(Op):
    """:func:`count_reservations`: counted publishes not yet published into every shard."""

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("hlen",), read=(glob(layout.reservations),))]


@dataclass(frozen=True)
class TrimEvents(Op):
    """:func:`trim_events` of ``streams`` (event streams: no group to trim by)."""

    streams: tuple[str, ...]

    def grants(self, layout: Layout) -> list[Grant]:
        return [Grant(("xtrim",), write=_streams(layout, self.streams))]


@dataclass(frozen=True)
class RequeueDead(Op):
    """queues.streams.requeue_dead_letter into ``streams`` (requeue.lua: XRANGE and XDEL of
    the letter, XADD of its payload, claim-check blob first; a released ticket taken back,
    and what its letter recorded adding to ``counters``: queues.streams.released_counters)
    and :func:`delete_entries` of dead letters (purge)."""

    streams: tuple[str, ...]
    counters: tuple[Key, ...] = ()

    def grants(self, layout: Layout) -> list[Grant]:
        work = _streams(layout, self.streams)
        dead = stream_pattern(layout, DEAD)
        released, tickets = glob(layout.released_tickets), glob(layout.open_tickets)
        ids, counts = glob(layout.released_ids), glob(layout.released_counts)
        counters = tuple(k.pattern(layout) for k in self.counters)
        grants = [
            Grant(SCRIPTS, rw=(dead, released, tickets, ids, counts, *work, *counters)),
            Grant(("get", "decrby"), rw=(released,)),
            Grant(("smove",), rw=(ids, tickets)),
            Grant(("hget", "hdel"), rw=(counts,)),
            Grant(("xdel",), write=(dead,)),
            Grant(("xadd",), write=work),
            Grant(("set",), write=_blobs(layout, self.streams)),
        ]
        if counters:  # requeue.lua takes back what the released ticket's letter recorded
            grants.append(Grant(("get", "decrby"), rw=counters))
        return grants


def grants_of(ops: Iterable[Op], layouts: Iterable[Layout]) -> list[Grant]:
    """The grants of ``ops`` on every one of ``layouts``, each once, in order."""
    layouts = list(layouts)
    return list(dict.fromkeys(g for layout in layouts for op in ops for g in op.grants(layout)))


# -- the calls ---------------------------------------------------------------------------


BrokerError = redis.RedisError
"""Any failure of a broker call that outlived the reconnect window (unreachable, refused)."""
BrokerRefused = redis.ResponseError
"""A :data:`BrokerError` that is Redis's answer (an error reply: a refused or failed command),
not a failure to reach it."""
AclRefused = redis.exceptions.NoPermissionError
"""A :data:`BrokerRefused` of the ACL: the user lacks a permission (``NOPERM``)."""


def _str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def read_counters(client: RedisClient, keys: list[str]) -> list[int]:
    """The integer value of each of ``keys`` (0 where missing); one MGET per hash slot.
    Op: :class:`ReadCounters` (or :class:`Increment`, :class:`PublishCounted` for one)."""
    by_slot: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        by_slot.setdefault(key_slot(key), []).append(i)
    values = [0] * len(keys)
    for indices in by_slot.values():
        slot_keys = [keys[i] for i in indices]
        if len(slot_keys) == 1:
            raw: list[Any] = [await client.call(client.sync.get, slot_keys[0])]
        else:
            raw = await client.call(client.sync.mget, slot_keys)
        for i, value in zip(indices, raw, strict=True):
            values[i] = int(value or 0)
    return values


async def read_tally(client: RedisClient, key: str) -> dict[str, int]:
    """Every field of the hash of counts ``key`` (missing: empty). Op: :class:`ReadTally`."""
    raw = await client.call(client.sync.hgetall, key)
    return {_str(k): int(v) for k, v in raw.items()}


async def read_counter(client: RedisClient, key: str) -> int:
    """Op: :class:`ReadCounters`."""
    return (await read_counters(client, [key]))[0]


async def increment(client: RedisClient, key: str) -> int:
    """Add one to counter ``key``; its new value. Op: :class:`Increment`."""
    return int(await client.call(client.sync.incr, key))


async def read_flag(client: RedisClient, key: str) -> bool:
    """Whether flag ``key`` is set. Op: :class:`ReadFlag`."""
    return bool(await client.call(client.sync.exists, key))


async def set_flag(client: RedisClient, key: str) -> None:
    """Op: :class:`SetFlag`."""
    await client.call(client.sync.set, key, 1)


async def clear_flag(client: RedisClient, key: str) -> bool:
    """Clear flag ``key``; whether it was set. No role has this: the admin URL's own user."""
    return bool(await client.call(client.sync.delete, key))


async def read_hash(client: RedisClient, key: str) -> dict[str, str]:
    """Every field of hash ``key`` (empty where missing). Op: :class:`ReadHash`."""
    raw: Any = await client.call(client.sync.hgetall, key)
    return {_str(k): _str(v) for k, v in (raw or {}).items()}


async def set_fields(client: RedisClient, key: str, fields: dict[str, str]) -> None:
    """Set ``fields`` of hash ``key``. Op: :class:`SetFields`."""
    if fields:
        await client.call(client.sync.hset, key, mapping=fields)


async def delete_fields(client: RedisClient, key: str, fields: list[str]) -> int:
    """Delete ``fields`` of hash ``key``; how many were there. Op: :class:`DeleteFields`."""
    return int(await client.call(client.sync.hdel, key, *fields)) if fields else 0


async def count_reservations(client: RedisClient, layout: Layout) -> int:
    """Counted publishes reserved and maybe not yet published into every shard. Op:
    :class:`CountReservations`."""
    return int(await client.call(client.sync.hlen, layout.reservations))


def _entries(rows: Any) -> list[Entry]:
    return [(_str(entry_id), dict(fields or {})) for entry_id, fields in rows or []]


async def read_range(
    client: RedisClient, key: str, low: str = "-", high: str = "+", *, count: int | None = None
) -> list[Entry]:
    """The entries of stream ``key`` from ``low`` to ``high``, oldest first (at most
    ``count``). Op: :class:`ReadRange` (or :class:`Observe`, for a work stream)."""
    return _entries(await client.call(client.sync.xrange, key, low, high, count=count))


async def latest_entries(client: RedisClient, key: str, count: int = 1) -> list[Entry]:
    """The newest ``count`` entries of stream ``key``, newest first. Op: :class:`ReadRange`."""
    return _entries(await client.call(client.sync.xrevrange, key, count=count))


async def get_blob(client: RedisClient, key: str) -> bytes | None:
    """A claim-check blob (None if it is gone). Op: :class:`ReadBlobs`."""
    blob: Any = await client.call(client.sync.get, key)
    return None if blob is None else bytes(blob)


async def resolve_payloads(
    client: RedisClient, entries: list[tuple[str, bytes | None]], limits: PayloadLimits
) -> list[Resolved]:
    """Each entry's payload with claim-check references resolved (queues.payloads.resolve).
    Op: :class:`ReadBlobs`."""
    return await client.call(resolve, client.sync, entries, limits)


async def delete_entries(client: RedisClient, key: str, ids: list[str]) -> int:
    """XDEL ``ids`` from stream ``key``; how many were still there. Op: :class:`RequeueDead`
    (dead letters)."""
    return int(await client.call(client.sync.xdel, key, *ids))


async def trim_events(client: RedisClient, keys: list[str], keep: int) -> None:
    """Keep about the newest ``keep`` entries of each event stream (approximate MAXLEN).
    Op: :class:`TrimEvents`."""

    def trim() -> None:
        pipe = client.sync.pipeline(transaction=False)
        for key in keys:
            pipe.xtrim(key, maxlen=keep, approximate=True)
        pipe.execute()

    await client.call(trim)


@dataclass(frozen=True)
class ConsumerDetail:
    name: str
    pending: int
    idle_s: float


@dataclass(frozen=True)
class PendingDetail:
    """The pending entries (oldest first: id, delivery count) and consumers of a group."""

    entries: list[tuple[str, int]] = field(default_factory=list)
    consumers: list[ConsumerDetail] = field(default_factory=list)


async def pending_detail(
    client: RedisClient, key: str, group: str, *, count: int = 1000
) -> PendingDetail:
    """Up to ``count`` pending entries of ``group`` on stream ``key`` and its consumers;
    empty where the stream or the group does not exist yet. Op: :class:`Observe` (detail)."""

    def fetch() -> PendingDetail:
        try:
            rows = client.sync.xpending_range(key, group, "-", "+", count)
            consumers = client.sync.xinfo_consumers(key, group)
        except redis.ResponseError as exc:  # no stream or no group yet
            if "no such key" in str(exc).lower() or "nogroup" in str(exc).lower():
                return PendingDetail()
            raise
        return PendingDetail(
            [(_str(r["message_id"]), int(r["times_delivered"])) for r in rows],
            [ConsumerDetail(_str(c["name"]), int(c["pending"]), int(c["idle"]) / 1000)
             for c in consumers],
        )

    return await client.call(fetch)
