"""Work streams split into shards, one hash slot each; one consumer covering several shards.

A stream of a run (the pipeline's streams: :mod:`streamrl.protocol.names`) can be split
into shards (:class:`queues.keys.Layout` with ``shard=k``): shard ``k``'s streams, dedup
keys, dead letters and blobs share one slot, so on Redis Cluster the shards spread over the
nodes and every hand-off inside a shard stays one atomic script on one node.

Guarantees, on top of :mod:`queues.streams`:

- :func:`publish_routed` sends each payload to the shard of its routing key
  (:func:`queues.keys.shard_for`: stable across processes), in order within a shard;
- :class:`ShardedConsumer` consumes one group on a stream in several shards, with the
  interface of :class:`queues.streams.StreamConsumer`. Its entry ids are qualified by the
  shard (``"<k>:<entry id>"``, safe in file names); a hand-off is acknowledged in the
  entry's own shard and its dedup key and outputs, named by the unsharded layout
  (``Layout(run)``), are moved into that shard (:meth:`queues.keys.Layout.localize`), so a
  hand-off never crosses slots. Run-global outputs (the streams of
  :attr:`queues.keys.Layout.GLOBAL_STREAMS`) stay run-global: such a hand-off is two
  idempotent steps, see :meth:`ShardedConsumer.ack_many`;
- a read blocks on every shard at once and returns as soon as one has entries, never more
  than ``count``: entries the other shards delivered meanwhile are held (and heart-beaten)
  for the next read, none is lost to the pending list;
- :func:`publish_counted_routed` is :meth:`queues.streams.Producer.publish_counted` across
  slots (entries routed into shards, a run-global counter): exact, like the one-slot script,
  through a write-ahead record (see there);
- :func:`open_consumer` picks the layout from the names: a plain
  :class:`queues.streams.StreamConsumer` for a one-shard run (``Layout(run)``, unchanged keys),
  a :class:`ShardedConsumer` over every shard otherwise.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import msgspec
import trio

from streamrl.queues.client import RedisClient
from streamrl.queues.keys import Layout, one_slot, shard_for
from streamrl.queues.payloads import PayloadLimits
from streamrl.queues.scripts import lua
from streamrl.queues.streams import (
    ConsumerSettings,
    Delivery,
    Handoff,
    Producer,
    StreamConsumer,
    open_stream_consumer,
)

_RESERVE_COUNTED = lua("reserve_counted.lua")


def qualify(shard: int, entry_id: str) -> str:
    return f"{shard}:{entry_id}"


def unqualify(entry_id: str) -> tuple[int, str]:
    shard, sep, eid = entry_id.partition(":")
    if not sep:
        raise ValueError(f"not a sharded entry id: {entry_id!r}")
    return int(shard), eid


def split_qualified(entry_id: str) -> tuple[int | None, str]:
    """``(shard, entry id)`` of a qualified id, ``(None, entry id)`` of a plain one."""
    if ":" in entry_id:
        return unqualify(entry_id)
    return None, entry_id


async def publish_routed(
    client: RedisClient,
    names: Layout,
    stream: str,
    items: list[tuple[str, bytes]],
    shards: int,
    limits: PayloadLimits | None = None,
) -> list[str]:
    """XADD each ``(routing key, payload)`` to ``stream`` in the shard of its routing key;
    returns the qualified entry ids, in the order of ``items``. One round trip per shard."""
    by_shard: dict[int, list[int]] = defaultdict(list)
    for i, (key, _) in enumerate(items):
        by_shard[shard_for(key, shards)].append(i)
    ids = [""] * len(items)
    for shard, positions in sorted(by_shard.items()):
        producer = Producer(client, names.in_shard(shard), limits)
        added = await producer.publish(stream, [items[i][1] for i in positions])
        for i, eid in zip(positions, added, strict=True):
            ids[i] = qualify(shard, eid)
    return ids


class ShardedConsumer:
    """One consumer of one group on ``stream`` in several shards. Use
    :func:`open_sharded_consumer`; the interface is :class:`StreamConsumer`'s."""

    def __init__(self, names: Layout, consumers: dict[int, StreamConsumer]) -> None:
        if not consumers:
            raise ValueError("a sharded consumer needs at least one shard")
        self.names = names.in_shard(None)
        """The unsharded names: callers name outputs and dedup keys with these."""
        self.consumers = consumers
        first = next(iter(consumers.values()))
        self.client = first.client
        self.settings = first.settings
        self.stream_name, self.group, self.stage = first.stream_name, first.group, first.stage
        self._order = sorted(consumers)
        self._held: list[Delivery] = []  # read from Redis, not yet returned by read()

    def _split(self, entry_id: str) -> tuple[int, StreamConsumer, str]:
        shard, eid = unqualify(entry_id)
        return shard, self.consumers[shard], eid

    def _by_shard(self, entry_ids: Iterable[str]) -> dict[int, list[str]]:
        out: dict[int, list[str]] = defaultdict(list)
        for qualified in entry_ids:
            shard, eid = unqualify(qualified)
            out[shard].append(eid)
        return out

    def _localize(
        self, shard: int, dedup_id: str, outputs: Sequence[tuple[str, bytes]]
    ) -> tuple[str, list[tuple[str, bytes]]]:
        """A dedup key and outputs named by the unsharded layout, moved into ``shard``."""
        local = self.names.in_shard(shard)
        return local.localize(dedup_id), [(local.localize(k), p) for k, p in outputs]

    def _qualified(self, shard: int, deliveries: list[Delivery]) -> list[Delivery]:
        return [dataclasses.replace(d, entry_id=qualify(shard, d.entry_id)) for d in deliveries]

    def _take(self, count: int) -> list[Delivery]:
        taken, self._held = self._held[:count], self._held[count:]
        return taken

    # ------------------------------------------------------------------ reading
    async def read(self, count: int) -> list[Delivery]:
        """Up to ``count`` entries from whichever shards have some (see the module docstring);
        blocks up to ``block_ms`` when none has any; cancellable like StreamConsumer.read."""
        if count <= 0:
            return []
        if self._held:
            return self._take(count)
        interrupt = trio.Event()
        got: dict[int, list[Delivery]] = {}

        async def read_shard(shard: int) -> None:
            deliveries = await self.consumers[shard].read(count, interrupt=interrupt)
            got[shard] = deliveries
            if deliveries:
                interrupt.set()

        async with trio.open_nursery() as nursery:
            for shard in self._order:
                nursery.start_soon(read_shard, shard)
        self._order = self._order[1:] + self._order[:1]  # round-robin: no shard goes first twice
        for shard in self._order:
            self._held += self._qualified(shard, got.get(shard, []))
        return self._take(count)

    def rewind(self) -> None:
        for consumer in self.consumers.values():
            consumer.rewind()

    async def reclaim(self, count: int) -> list[Delivery]:
        out: list[Delivery] = []
        for shard in self._order:
            if len(out) >= count:
                break
            out += self._qualified(shard, await self.consumers[shard].reclaim(count - len(out)))
        return out

    async def give_back(self, deliveries: Sequence[Delivery]) -> int:
        """:meth:`StreamConsumer.give_back`, each entry in its own shard."""
        by_shard: dict[int, list[Delivery]] = defaultdict(list)
        for d in deliveries:
            shard, eid = unqualify(d.entry_id)
            by_shard[shard].append(dataclasses.replace(d, entry_id=eid))
        return sum([await self.consumers[k].give_back(ds) for k, ds in by_shard.items()])

    async def give_back_held(self) -> None:
        """Give back the entries read from Redis and not handed out yet (closing)."""
        held, self._held = self._held, []
        await self.give_back(held)

    async def heartbeat(self, entry_ids: list[str]) -> None:
        held = [d.entry_id for d in self._held]
        for shard, eids in self._by_shard([*entry_ids, *held]).items():
            await self.consumers[shard].heartbeat(eids)

    # ------------------------------------------------------------------ finishing
    async def complete(self, handoff: Handoff) -> None:
        """The hand-off, in the entry's shard (dedup key, outputs and counters moved there;
        ``counts_if_open`` checked in that shard's open tickets)."""
        shard, consumer, eid = self._split(handoff.entry_id)
        dedup, outs = self._localize(shard, handoff.dedup_id, handoff.outputs)
        counters = self._localize_counters(shard, handoff.counters)
        local = self.names.in_shard(shard)
        stores = [(local.localize(k), f, v) for k, f, v in handoff.stores]
        deletes = [local.localize(k) for k in handoff.deletes]
        await consumer.complete(Handoff(eid, dedup, outs, counters, stores, deletes,
                                        counts_if_open=handoff.counts_if_open))

    async def read_stored(self, entry_id: str, key: str, fields: list[str]) -> list[bytes | None]:
        """:meth:`StreamConsumer.read_stored` in the entry's shard (``key`` moved there)."""
        shard, consumer, _ = self._split(entry_id)
        return await consumer.read_stored(entry_id, self.names.in_shard(shard).localize(key),
                                          fields)

    def _localize_counters(
        self, shard: int, counters: Sequence[tuple[str, int]] | None
    ) -> list[tuple[str, int]]:
        """Counter keys named by the unsharded layout, moved into ``shard`` (the counters of
        the work path are per shard: :meth:`queues.keys.Layout.counter`)."""
        local = self.names.in_shard(shard)
        return [(local.localize(k), n) for k, n in counters or ()]

    async def dead_letter(
        self,
        delivery: Delivery,
        error: str,
        *,
        ticket: str | None = None,
        counters: list[tuple[str, int]] | None = None,
    ) -> None:
        """The letter, in the entry's shard (the counters moved there)."""
        shard, consumer, eid = self._split(delivery.entry_id)
        local = dataclasses.replace(delivery, entry_id=eid)
        await consumer.dead_letter(
            local, error, ticket=ticket, counters=self._localize_counters(shard, counters)
        )

    async def ack(self, entry_ids: list[str]) -> None:
        for shard, eids in self._by_shard(entry_ids).items():
            await self.consumers[shard].ack(eids)

    async def ack_many(
        self,
        entry_ids: list[str],
        dedup_id: str,
        outputs: list[tuple[str, bytes]],
        *,
        settled: list[str | None] | None = None,
        counters: list[tuple[str, int]] | None = None,
        only_settling: bool = False,
    ) -> None:
        """Acknowledge entries of any shards and publish ``outputs`` once; ``settled`` (one
        per entry: the ticket it carries, or None) leave the open tickets of the entry's shard
        with its acknowledgement (:meth:`StreamConsumer.ack_many`); ``counters`` are added in
        the shard of the first entry, under that shard's dedup key (once; with
        ``only_settling``, only if that shard's step took a settled ticket out of its open set).

        Atomic (one script) when the entries are of one shard and the localized dedup key and
        outputs are in its slot. Otherwise (entries of several shards, or outputs to
        run-global streams) two idempotent steps: publish once
        into the outputs' slot, guarded by ``dedup_id`` (which must be in that slot), then
        acknowledge in each shard. A crash in between leaves the entries pending; repeating
        the call publishes nothing and acknowledges them.
        """
        by_shard = self._by_shard(entry_ids)
        tickets: dict[int, list[str]] = defaultdict(list)
        for qualified, t in zip(entry_ids, settled or [None] * len(entry_ids), strict=True):
            if t:
                tickets[unqualify(qualified)[0]].append(t)
        if len(by_shard) == 1:
            [(shard, eids)] = by_shard.items()
            dedup, outs = self._localize(shard, dedup_id, outputs)
            consumer = self.consumers[shard]
            counted = self._localize_counters(shard, counters)
            keys = [consumer.stream, dedup, *(k for k, _ in outs), *(k for k, _ in counted)]
            if one_slot(keys):
                await consumer.ack_many(
                    eids, dedup, outs, settled=tickets[shard], counters=counted,
                    only_settling=only_settling,
                )
                return
        if outputs:
            await Producer(self.client, self.names, self.settings.limits).publish_once(
                dedup_id,
                [(self.names.short(k), p) for k, p in outputs],
                dedup_ttl_s=self.settings.dedup_ttl_s,
            )
        counting = unqualify(entry_ids[0])[0] if counters and entry_ids else None
        for shard, eids in by_shard.items():  # per shard: acknowledged and settled together
            dedup, _ = self._localize(shard, dedup_id, [])
            counted = self._localize_counters(shard, counters) if shard == counting else []
            await self.consumers[shard].ack_many(
                eids, dedup, [], settled=tickets[shard], counters=counted,
                only_settling=only_settling,
            )


@asynccontextmanager
async def open_sharded_consumer(
    client: RedisClient,
    names: Layout,
    stream: str,
    shards: Iterable[int],
    *,
    stage: str,
    group: str | None = None,
    consumer: str | None = None,
    settings: ConsumerSettings | None = None,
) -> AsyncIterator[ShardedConsumer]:
    """A :class:`ShardedConsumer` of ``stream`` in ``shards`` (e.g. ``range(n)``), each shard
    an :func:`open_stream_consumer` with the same consumer name and settings."""
    async with AsyncExitStack() as stack:
        consumers = {
            shard: await stack.enter_async_context(
                open_stream_consumer(
                    client,
                    names.in_shard(shard),
                    stream,
                    stage=stage,
                    group=group,
                    consumer=consumer,
                    settings=settings,
                )
            )
            for shard in shards
        }
        sharded = ShardedConsumer(names, consumers)
        try:
            yield sharded
        finally:
            await _give_back_on_close(sharded)


async def _give_back_on_close(consumer: ShardedConsumer) -> None:
    """The read-ahead of a closing consumer, given back uncharged when Redis answers within a
    few seconds (else it stays charged one delivery: never lost)."""
    with trio.CancelScope(shield=True), trio.move_on_after(5):
        await consumer.give_back_held()


Consumer = StreamConsumer | ShardedConsumer
"""What :func:`open_consumer` hands out; both have the same interface."""


@asynccontextmanager
async def open_consumer(
    client: RedisClient,
    names: Layout,
    stream: str,
    *,
    stage: str,
    group: str | None = None,
    consumer: str | None = None,
    settings: ConsumerSettings | None = None,
) -> AsyncIterator[Consumer]:
    """A consumer of ``stream`` for the whole run ``names``: one :class:`StreamConsumer` when
    the run has one shard (the default layout, keys unchanged), else a
    :class:`ShardedConsumer` over all of ``names.shards``."""
    kw: dict[str, Any] = dict(stage=stage, group=group, consumer=consumer, settings=settings)
    if names.spans_shards(stream):
        async with open_sharded_consumer(client, names, stream, range(names.shards), **kw) as c:
            yield c
    else:
        async with open_stream_consumer(client, names, stream, **kw) as c:
            yield c


# ---------------------------------------------------------------------- counted publish


class _CountedPublish(msgspec.Struct, array_like=True, frozen=True):
    stream: str
    items: list[tuple[str, bytes]]  # (routing key, payload)
    record: bool = False  # routing keys join their shard's names.open_tickets


_TOKEN_LEN = 32  # uuid4().hex


async def publish_counted_routed(
    client: RedisClient,
    names: Layout,
    stream: str,
    items: list[tuple[str, bytes]],
    counter: str,
    expected: int,
    limits: PayloadLimits | None = None,
    *,
    dedup_ttl_s: int = 24 * 3600,
    record: bool = False,
    tally: tuple[str, dict[str, int]] | None = None,
) -> int:
    """Publish ``items`` [(routing key, payload)] routed over ``names.shards`` shards and add
    their number to the run-global ``counter``, only if it still holds ``expected``; returns
    how many were published (0 or ``len(items)``). ``record``: each routing key is opened as
    a ticket in its shard (:attr:`queues.keys.Layout.open_tickets`) in the same script that
    publishes its entry there (the pipeline's use of this: :mod:`streamrl.protocol.names`).
    ``tally`` ``(run-global hash key, {field: n})``: added to with the counter, in step (1).

    The entries (one slot per shard) and the counter (the run's slot) cannot move in one
    script on a cluster, so this is three idempotent steps: (1) ``reserve_counted.lua``, in
    the run's slot: compare-and-set the counter and record the batch in ``names.reservations``
    (the write-ahead record; a replay after a lost reply is recognised by its token); (2) per
    shard, :meth:`Producer.publish_once` of that shard's entries under the dedup key
    ``(admit, expected)`` in the shard's slot; (3) delete the record. A crash after (1) leaves
    the record: :func:`finish_counted` (run at start, and after every reservation)
    publishes what is missing, so the counter and the published entries always end up
    agreeing: every counted entry is published exactly once, nothing uncounted is published.
    """
    added = await reserve_counted(
        client, names, stream, items, counter, expected, record=record, tally=tally
    )
    await finish_counted(client, names, limits, dedup_ttl_s=dedup_ttl_s)
    return added


async def reserve_counted(
    client: RedisClient,
    names: Layout,
    stream: str,
    items: list[tuple[str, bytes]],
    counter: str,
    expected: int,
    *,
    token: str | None = None,
    record: bool = False,
    tally: tuple[str, dict[str, int]] | None = None,
) -> int:
    """Step (1) of :func:`publish_counted_routed` alone: count ``items`` and record them,
    if ``counter`` still holds ``expected``; publishes nothing. Repeating it with the same
    ``token`` (what the client does after a lost reply) reserves nothing twice."""
    if not items:
        return 0
    token = token or uuid.uuid4().hex
    if len(token) != _TOKEN_LEN:
        raise ValueError(f"token must be {_TOKEN_LEN} characters")
    encoded = msgspec.msgpack.encode(_CountedPublish(stream, items, record))
    script = client.sync.register_script(_RESERVE_COUNTED)
    return int(
        await client.call(
            script,
            keys=[counter, names.reservations, *([tally[0]] if tally else [])],
            args=[expected, token, encoded, len(items),
                  *(x for field, n in (tally[1].items() if tally else ()) for x in (field, n))],
        )
    )


async def finish_counted(
    client: RedisClient,
    names: Layout,
    limits: PayloadLimits | None = None,
    *,
    dedup_ttl_s: int = 24 * 3600,
) -> int:
    """Publish every reserved counted publish of the run (see :func:`publish_counted_routed`) that
    is still recorded, each entry once, and delete the records; returns how many records were
    finished. Idempotent; safe to run from several processes at once."""
    raw: Any = await client.call(client.sync.hgetall, names.reservations)
    done = 0
    for field_raw, value in sorted((raw or {}).items(), key=lambda kv: int(kv[0])):
        start = field_raw.decode() if isinstance(field_raw, bytes) else str(field_raw)
        counted = msgspec.msgpack.decode(value[_TOKEN_LEN:], type=_CountedPublish)
        by_shard: dict[int, list[tuple[str, bytes]]] = defaultdict(list)
        for key, payload in counted.items:
            by_shard[shard_for(key, names.shards)].append((key, payload))
        for shard, shard_items in sorted(by_shard.items()):
            local = names.in_shard(shard) if names.sharded else names.in_shard(None)
            await Producer(client, local, limits).publish_once(
                local.dedup("admit", start),
                [(counted.stream, p) for _, p in shard_items],
                dedup_ttl_s=dedup_ttl_s,
                members=[k for k, _ in shard_items] if counted.record else None,
            )
        await client.call(client.sync.hdel, names.reservations, start)
        done += 1
    return done
