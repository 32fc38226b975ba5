"""Read-only views of stream state: backlog for backpressure, snapshots for monitoring.

For a sharded run (``Names(run, shards=n)``, n > 1) the run-wide view (``shard=None``) of a
work stream is the sum over its shards: length, lag and pending added up (consumers: the
most of any shard, since a process consumes every shard under one name), so the
scheduler's backlog bound, the stages' backpressure and ``streamrl status`` see the whole
run. A per-shard view (``names.in_shard(k)``) reads that shard alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from queues import names as N
from queues.client import RedisClient


@dataclass(frozen=True)
class GroupState:
    stream: str
    group: str
    length: int
    lag: int  # entries not yet delivered to the group
    pending: int  # delivered, not yet acknowledged
    consumers: int

    @property
    def backlog(self) -> int:
        return self.lag + self.pending


def _as_str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def spans_shards(names: N.Names, stream: str) -> bool:
    """Whether ``stream`` of the run view ``names`` lives in several shards."""
    return names.shard is None and names.sharded and stream not in N.RUN_GLOBAL_STREAMS


async def group_state(client: RedisClient, names: N.Names, stream: str, group: str) -> GroupState:
    """The group's state; summed over the shards for the run view of a sharded run."""
    if spans_shards(names, stream):
        parts = [await _group_state(client, n, stream, group) for n in names.layouts()]
        return GroupState(
            stream,
            group,
            sum(p.length for p in parts),
            sum(p.lag for p in parts),
            sum(p.pending for p in parts),
            max(p.consumers for p in parts),
        )
    return await _group_state(client, names, stream, group)


async def _group_state(client: RedisClient, names: N.Names, stream: str, group: str) -> GroupState:
    key = names.stream(stream)

    def fetch() -> GroupState:
        pipe = client.sync.pipeline(transaction=False)
        pipe.xlen(key)
        pipe.xinfo_groups(key)
        try:
            length, groups = pipe.execute()
        except Exception as exc:  # no such key: nothing queued yet
            if "no such key" in str(exc).lower():
                return GroupState(stream, group, 0, 0, 0, 0)
            raise
        for g in groups:
            if _as_str(g["name"]) == group:
                lag = g.get("lag")
                if lag is None:  # Redis cannot tell after deletions: count entries after the cursor
                    last = _as_str(g["last-delivered-id"])
                    lag = len(client.sync.xrange(key, min=f"({last}", max="+", count=100_000) or [])
                return GroupState(
                    stream, group, int(length), int(lag), int(g["pending"]), int(g["consumers"])
                )
        return GroupState(stream, group, int(length), int(length), 0, 0)

    return await client.call(fetch)


async def pipeline_state(client: RedisClient, names: N.Names) -> list[GroupState]:
    return [await group_state(client, names, s, N.GROUP_OF_STREAM[s]) for s in N.WORK_STREAMS]


async def stream_length(client: RedisClient, names: N.Names, stream: str) -> int:
    """XLEN; summed over the shards for the run view of a sharded run."""
    if spans_shards(names, stream):
        return sum([await stream_length(client, n, stream) for n in names.layouts()])
    return int(await client.call(client.sync.xlen, names.stream(stream)))
