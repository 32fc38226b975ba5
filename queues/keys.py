"""Where the broker keeps a run's keys: every stream, dedup key, claim-check blob, counter
and ticket set of one run, and how they are split into shards.

All keys of one run live under ``streamrl:{<run>}:`` so several runs share one Redis. The
text in braces is a Redis Cluster hash tag: keys with the same tag map to one slot, which is
what lets one atomic script touch them together there.

Key layout, and the guarantee it keeps: every key one hand-off script touches (input stream,
dedup key, output streams, dead-letter stream, claim-check blobs ``<stream key>:blob:<id>``,
the counters and tickets it writes) carries the same hash tag, so each hand-off runs in one
slot, on one node.

- One shard (``Layout(run)``, the default): every key of the run under ``{<run>}``, one slot.
- Shard ``k`` of a run (``Layout(run, shard=k)``): the *work path* of the shard (every stream
  except the layout's :attr:`Layout.GLOBAL_STREAMS`, dead letters included, its dedup keys,
  its blobs, its counters and tickets) lives under its own tag ``{<run>.s<k>}``, a slot of
  its own; the *run-global* keys stay under ``{<run>}`` whatever the shard. A hand-off within
  a shard is one script; one whose outputs are run-global crosses slots: see
  :mod:`streamrl.queues.shards`.
- A run of n shards (``Layout(run, shards=n)``): the view with ``shard=None`` names the
  run-global keys, :meth:`Layout.layouts` the views of its shards; a run of one shard is the
  default layout, unchanged.

*Tickets*: an entry may carry a ticket (an id its producer opened in the shard's
:attr:`Layout.open_tickets` set). A hand-off that settles the ticket takes it out of the set;
a dead letter of an entry whose ticket is still open takes it out and counts it in
:attr:`Layout.released_tickets`, once, recording the ticket in :attr:`Layout.released_ids` and
what its letter counted in :attr:`Layout.released_counts` (what a requeue of the letter takes
back, whatever the letter's own fields say). The pipeline protocol uses them for admission slots
(:mod:`streamrl.protocol.names`); the broker only keeps the set and the count exact.

:func:`shard_for` picks a shard from a routing key; :func:`one_slot` tells whether keys may
be used by one script on a cluster.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import ClassVar, Self

from redis.crc import key_slot as _key_slot

DEAD = "dead"
"""The dead-letter stream of a layout (one per shard): entries that could not be handled,
with the reason (:class:`streamrl.queues.codec.DeadLetter`)."""


def shard_for(routing_key: str, shards: int) -> int:
    """The shard (``0 <= k < shards``) of ``routing_key``: the same in every process, host and
    Python version (CRC-32, not the salted ``hash()``)."""
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    return zlib.crc32(routing_key.encode()) % shards


def key_slot(key: str) -> int:
    """The Redis Cluster hash slot of ``key`` (CRC16 of its hash tag, mod 16384)."""
    return int(_key_slot(key.encode()))


def one_slot(keys: Iterable[str]) -> bool:
    """Whether ``keys`` may be used together by one script or transaction on a cluster."""
    return len({key_slot(k) for k in keys}) <= 1


@dataclass(frozen=True)
class Layout:
    run: str = "default"
    shard: int | None = None
    """None: one shard, every key under ``{<run>}``. k: the work path of shard k under
    ``{<run>.s<k>}`` (see the module docstring)."""
    shards: int = 1
    """How many shards the run's work path is split into (:mod:`streamrl.queues.shards`). 1:
    the default layout, one slot. With more, the unsharded view (``shard=None``) names the
    run-global keys and the per-shard views (:meth:`layouts`) the work path; readers of the
    whole run sum over :meth:`layouts`."""

    GLOBAL_STREAMS: ClassVar[frozenset[str]] = frozenset()
    """Streams of the whole run, never sharded (a subclass names them)."""

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def layouts(self) -> list[Self]:
        """Where the run's work path lives: ``[self in shard None]`` with one shard, else the
        view of every shard ``0 .. shards-1``."""
        if not self.sharded:
            return [self.in_shard(None)]
        return [self.in_shard(k) for k in range(self.shards)]

    def spans_shards(self, stream: str) -> bool:
        """Whether ``stream``, named from this view, is split over several shards (a work
        stream of a sharded run seen from its run-global view)."""
        return self.shard is None and self.sharded and stream not in self.GLOBAL_STREAMS

    @cached_property  # a layout is frozen; every key name of a hot path starts with these
    def prefix(self) -> str:
        """Prefix of the run-global keys (and of every key when unsharded)."""
        return f"streamrl:{{{self.run}}}:"

    @cached_property
    def shard_prefix(self) -> str:
        """Prefix of this shard's work path: streams, dead letters, dedup keys, blobs."""
        if self.shard is None:
            return self.prefix
        return f"streamrl:{{{self.run}.s{self.shard}}}:"

    def in_shard(self, shard: int | None) -> Self:
        """The layout of shard ``shard`` of this run (None: unsharded)."""
        return replace(self, shard=shard)

    def stream(self, name: str) -> str:
        prefix = self.prefix if name in self.GLOBAL_STREAMS else self.shard_prefix
        return f"{prefix}s:{name}"

    def group(self, stream: str) -> str:
        """The consumer group that handles ``stream`` when none is named (a subclass maps
        streams to the roles that consume them)."""
        return stream

    def short(self, key: str) -> str:
        """The stream name without the run prefix (for logs and dead letters)."""
        for prefix in (self.shard_prefix, self.prefix):
            if key.startswith(prefix + "s:"):
                return key[len(prefix) + 2 :]
        return key

    def dedup(self, stage: str, message_id: str) -> str:
        return f"{self.shard_prefix}dedup:{stage}:{message_id}"

    def localize(self, key: str) -> str:
        """``key`` as named by the unsharded layout, moved into this shard if it is on the
        work path (a stream other than the global ones, a blob, a dedup key, a counter);
        run-global keys, and keys of other runs, come back unchanged."""
        if self.shard is None or not key.startswith(self.prefix):
            return key
        rest = key[len(self.prefix) :]
        if rest.startswith("s:"):
            stream = rest[2:].split(":", 1)[0]
            return key if stream in self.GLOBAL_STREAMS else self.shard_prefix + rest
        if rest.startswith(("dedup:", "count:", "ctx:")):
            return self.shard_prefix + rest
        return key

    def context(self, owner: str) -> str:
        """Hash of the stored parts of ``owner``'s context (a multi-turn episode's: one field
        per stored turn), in this shard's slot: the hand-offs that write and delete it and
        the entries that reference it share the slot (:attr:`queues.streams.Handoff.stores`)."""
        return f"{self.shard_prefix}ctx:{owner}"

    def counter(self, name: str) -> str:
        """A counter of the work path, in this shard's slot, so that the hand-off that causes
        a count writes it in the same script (:attr:`streamrl.queues.streams.Handoff.counters`).
        One key per shard on a sharded run: readers sum over :meth:`layouts`
        (:meth:`counter_keys`)."""
        return f"{self.shard_prefix}count:{name}"

    def counter_keys(self, name: str) -> list[str]:
        """Every key of counter ``name`` in the run: one per shard (one when unsharded); the
        run's value is their sum."""
        return [layout.counter(name) for layout in self.layouts()]

    @property
    def open_tickets(self) -> str:
        """Set of the tickets opened in this shard and not settled yet (module docstring)."""
        return f"{self.shard_prefix}tickets"

    @property
    def released_tickets(self) -> str:
        """Counter of the open tickets whose entry was dead-lettered in this shard (once each;
        a requeue of the letter takes it back)."""
        return self.counter("tickets_released")

    @property
    def released_ids(self) -> str:
        """Set of the tickets a dead letter released in this shard and no requeue took back:
        ``deadletter.lua`` moves a ticket here from :attr:`open_tickets` (SMOVE, so only a
        ticket that was open), ``requeue.lua`` moves it back; the record a requeue trusts."""
        return f"{self.shard_prefix}tickets_released_ids"

    @property
    def released_counts(self) -> str:
        """Hash: released ticket -> JSON ``[[counter key, increment], ...]``, what its letter
        added with the release (``deadletter.lua``); a requeue takes back at most that."""
        return f"{self.shard_prefix}tickets_released_counts"

    @property
    def reservations(self) -> str:
        """Hash of counted publishes reserved but maybe not yet published into every shard
        (the write-ahead record of :func:`streamrl.queues.shards.publish_counted_routed`)."""
        return f"{self.prefix}reservations"

    def paused(self, stage: str) -> str:
        """Set (with a short expiry) while a process of ``stage`` is paused on backpressure,
        renewed each time it looks again: which downstream, its backlog and the bound."""
        return f"{self.prefix}paused:{stage}"
