"""Every stream, consumer group and key name, in one place.

All keys of one run live under ``streamrl:{<run>}:`` so several runs share one Redis. The
text in braces is a Redis Cluster hash tag: keys with the same tag map to one slot, which is
what lets one atomic script touch them together there.

Key layout, and the guarantee it keeps: every key one hand-off script touches (input stream,
dedup key, output streams, dead-letter stream, claim-check blobs ``<stream key>:blob:<id>``)
carries the same hash tag, so each hand-off runs in one slot, on one node.

- One shard (``Names(run)``, the default): every key of the run under ``{<run>}``, one slot.
- Shard ``k`` of a run (``Names(run, shard=k)``): the *work path* of the shard (every stream
  except ``weights`` and ``metrics``, dead letters included, its dedup keys, its blobs)
  lives under its own tag ``{<run>.s<k>}``, a slot of its own, and so do the counters its
  hand-offs write (:meth:`Names.counter`, summed over the shards by their readers); the
  *run-global* keys (``weights``, ``metrics``, the policy version, the admission counter and
  flags) stay under ``{<run>}`` whatever the shard. A hand-off within a shard is one
  script; one whose outputs are run-global (the learner's step announcement) crosses slots:
  see :mod:`queues.shards`.

- A run of n shards (``Names(run, shards=n)``, ``queues.shards``): the view with
  ``shard=None`` names the run-global keys, :meth:`Names.layouts` the views of its shards;
  a run of one shard is the default layout, unchanged.

:func:`shard_for` picks a shard from a routing key (a domain name, an episode id).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable
from dataclasses import dataclass, replace

from redis.crc import key_slot as _key_slot

# Pipeline streams, in order. Each is consumed by the group of the same role name.
TASKS = "tasks"
ROLLOUTS = "rollouts"
EXECUTED = "executed"
TRAJECTORIES = "trajectories"
EVALS = "evals"
# Event streams (read without a group, by offset).
WEIGHTS = "weights"
METRICS = "metrics"
DEAD = "dead"

# Consumer group per consuming role.
GROUP_OF_STREAM = {
    TASKS: "generator",
    ROLLOUTS: "executor",
    EXECUTED: "verifier",
    TRAJECTORIES: "learner",
    EVALS: "monitor",
}

WORK_STREAMS = (TASKS, ROLLOUTS, EXECUTED, TRAJECTORIES, EVALS)

RUN_GLOBAL_STREAMS = (WEIGHTS, METRICS)
"""Streams of the whole run, never sharded: every shard's actors follow the same policy."""


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
class Names:
    run: str = "default"
    shard: int | None = None
    """None: one shard, every key under ``{<run>}``. k: the work path of shard k under
    ``{<run>.s<k>}`` (see the module docstring)."""
    shards: int = 1
    """How many shards the run's work path is split into (``queues.shards``). 1: the default
    layout, one slot. With more, the unsharded view (``shard=None``) names the run-global keys
    and the per-shard views (:meth:`layouts`) the work path; readers of the whole run
    (:mod:`queues.stats`, status, dead letters) sum over :meth:`layouts`."""

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    def layouts(self) -> list[Names]:
        """Where the run's work path lives: ``[Names(run)]`` with one shard, else the view of
        every shard ``0 .. shards-1``."""
        if not self.sharded:
            return [self.in_shard(None)]
        return [self.in_shard(k) for k in range(self.shards)]

    @property
    def prefix(self) -> str:
        """Prefix of the run-global keys (and of every key when unsharded)."""
        return f"streamrl:{{{self.run}}}:"

    @property
    def shard_prefix(self) -> str:
        """Prefix of this shard's work path: streams, dead letters, dedup keys, blobs."""
        if self.shard is None:
            return self.prefix
        return f"streamrl:{{{self.run}.s{self.shard}}}:"

    def in_shard(self, shard: int | None) -> Names:
        """The names of shard ``shard`` of this run (None: unsharded)."""
        return replace(self, shard=shard)

    def stream(self, name: str) -> str:
        prefix = self.prefix if name in RUN_GLOBAL_STREAMS else self.shard_prefix
        return f"{prefix}s:{name}"

    def short(self, key: str) -> str:
        """The stream name without the run prefix (for logs and dead letters)."""
        for prefix in (self.shard_prefix, self.prefix):
            if key.startswith(prefix + "s:"):
                return key[len(prefix) + 2 :]
        return key

    def dedup(self, stage: str, message_id: str) -> str:
        return f"{self.shard_prefix}dedup:{stage}:{message_id}"

    def localize(self, key: str) -> str:
        """``key`` as named by the unsharded layout (``Names(run)``), moved into this shard if
        it is on the work path (a stream other than weights and metrics, a blob, a dedup
        key, a counter); run-global keys, and keys of other runs, come back unchanged."""
        if self.shard is None or not key.startswith(self.prefix):
            return key
        rest = key[len(self.prefix) :]
        if rest.startswith("s:"):
            stream = rest[2:].split(":", 1)[0]
            return key if stream in RUN_GLOBAL_STREAMS else self.shard_prefix + rest
        if rest.startswith(("dedup:", "count:")):
            return self.shard_prefix + rest
        return key

    @property
    def policy_version(self) -> str:
        """Latest published policy version (int)."""
        return f"{self.prefix}policy_version"

    @property
    def admitted(self) -> str:
        """Counter of training groups the scheduler has admitted (staleness admission)."""
        return f"{self.prefix}admitted"

    @property
    def admissions(self) -> str:
        """Hash of admissions reserved but maybe not yet published into every shard (sharded
        runs: the write-ahead record of :func:`queues.shards.publish_counted_routed`)."""
        return f"{self.prefix}admissions"

    @property
    def eval_round(self) -> str:
        """Counter of evaluation rounds started."""
        return f"{self.prefix}eval_round"

    @property
    def stop(self) -> str:
        """Set when the run is being wound down: the scheduler admits no new training work."""
        return f"{self.prefix}stop"

    def counter(self, name: str) -> str:
        """A counter of the work path that admission or the domain shares read
        (``zero_variance``, ``resolved:<domain>``, ``trained:<domain>``, ``dropped_stale``,
        ``duplicates_skipped``): in this shard's slot, because the hand-off that causes a
        count writes it in the same script (``queues/handoff_batch.lua``,
        ``queues/handoff.lua``; :attr:`queues.streams.Handoff.counters`). One key per shard
        on a sharded run, like :attr:`dead_groups`: readers sum over :meth:`layouts`
        (:meth:`counter_keys`)."""
        return f"{self.shard_prefix}count:{name}"

    def counter_keys(self, name: str) -> list[str]:
        """Every key of counter ``name`` in the run: one per shard (one when unsharded); the
        run's value is their sum."""
        return [layout.counter(name) for layout in self.layouts()]

    def paused(self, stage: str) -> str:
        """Set (with a short expiry) while a process of ``stage`` is paused on backpressure,
        renewed each time it looks again: which downstream, its backlog and the bound."""
        return f"{self.prefix}paused:{stage}"

    @property
    def dead_groups(self) -> str:
        """Counter of training groups dead-lettered in this shard (``queues/deadletter.lua``
        adds one with the letter, ``queues/requeue.lua`` takes it back): each frees its slot
        in the scheduler's staleness admission, like a group dropped as stale."""
        return f"{self.shard_prefix}count:dead_groups"

    @property
    def admitted_groups(self) -> str:
        """Set of the ids of the training groups admitted into this shard and not settled yet
        (the admission record, in the slot of the shard's streams and dead letters): added
        with the admission (``queues/publish_counted.lua``, or ``publish_once.lua`` per shard),
        removed when the group is trained or dropped (the learner's hand-off) or
        dead-lettered (``deadletter.lua``, which counts it in :attr:`dead_groups` only if it
        was still here), added back by a requeue (``requeue.lua``). A dead letter frees an
        admission slot only for a group in this set, so once."""
        return f"{self.shard_prefix}admitted_groups"
