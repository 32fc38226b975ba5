"""Read-only views of stream state: backlog for backpressure, snapshots for monitoring.

For a sharded run (``Names(run, shards=n)``, n > 1) the run-wide view (``shard=None``) of a
work stream is the sum over its shards: length, lag and pending added up (consumers: the
most of any shard, since a process consumes every shard under one name), so the
scheduler's backlog bound, the stages' backpressure and ``streamrl status`` see the whole
run. A per-shard view (``names.in_shard(k)``) reads that shard alone.

The lag cannot be fooled by a wrong ``lag`` from the server (Redis 7.0 loses a group's
``entries-read`` when it loads a rewritten AOF and then reports a lag too large, forever):
``backlog.lua`` checks it against the entries after the group's last-delivered id (0 when
there are none; never more than the stream's length less the group's pending entries) and
counts them where it does not hold. :attr:`GroupState.reported_lag` keeps what the server
said. :func:`repair_lag` (run by the group's own consumers, queues.streams) sets the
group's ``entries-read`` right again, so the server's own figure heals too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

import redis

from streamrl.queues.client import RedisClient
from streamrl.queues.keys import Layout
from streamrl.queues.scripts import lua

_BACKLOG = lua("backlog.lua")
_REPAIR_LAG = lua("repair_lag.lua")
_BACKLOG_SHA = hashlib.sha1(_BACKLOG.encode()).hexdigest()
_QUEUED = lua("queued.lua")
_QUEUED_SHA = hashlib.sha1(_QUEUED.encode()).hexdigest()


@dataclass(frozen=True)
class GroupState:
    stream: str
    group: str
    length: int
    lag: int  # entries not yet delivered to the group
    pending: int  # delivered, not yet acknowledged
    consumers: int
    reported_lag: int | None = None
    """The lag the server reported (None: it could not tell); differs from ``lag`` when the
    server's figure is impossible (see the module docstring)."""
    last_generated_ms: int = 0
    """Time part of the stream's last-generated id: when its newest entry was added."""

    @property
    def backlog(self) -> int:
        return self.lag + self.pending

    @property
    def lag_inconsistent(self) -> bool:
        """The server reported a lag this stream cannot have (e.g. more than its length)."""
        return self.reported_lag is not None and self.reported_lag != self.lag


def _as_str(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def group_state(client: RedisClient, names: Layout, stream: str, group: str) -> GroupState:
    """The group's state; summed over the shards for the run view of a sharded run."""
    if names.spans_shards(stream):
        parts = [await _group_state(client, n, stream, group) for n in names.layouts()]
        reported = [p.reported_lag for p in parts]
        return GroupState(
            stream,
            group,
            sum(p.length for p in parts),
            sum(p.lag for p in parts),
            sum(p.pending for p in parts),
            max(p.consumers for p in parts),
            None if None in reported else sum(r or 0 for r in reported),
            max(p.last_generated_ms for p in parts),
        )
    return await _group_state(client, names, stream, group)


def _run_read_only(
    client: RedisClient, key: str, *args: Any, script: tuple[str, str] = (_BACKLOG, _BACKLOG_SHA)
) -> Any:
    """A read-only script, backlog.lua unless ``script`` (text, SHA) says otherwise
    (EVALSHA_RO; its text once where the server lacks it)."""
    text, sha = script
    try:
        return client.sync.evalsha_ro(sha, 1, key, *args)
    except redis.exceptions.NoScriptError:
        return client.sync.eval_ro(text, 1, key, *args)


async def still_queued(
    client: RedisClient, names: Layout, stream: str, group: str, entry_ids: list[str]
) -> int:
    """How many of ``entry_ids`` (as publishing returned them: shard-qualified ``"<k>:<id>"``
    on a sharded run) are still in ``group``'s backlog on ``stream``: not delivered to it yet,
    or delivered and not acknowledged (``queued.lua``, read-only, one call per shard)."""
    by_shard: dict[int | None, list[str]] = {}
    for qualified in entry_ids:
        prefix, _, eid = qualified.rpartition(":")
        by_shard.setdefault(int(prefix) if prefix else None, []).append(eid)
    total = 0
    for shard, ids in by_shard.items():
        key = names.in_shard(shard).stream(stream)
        total += await client.call(
            _run_read_only, client, key, group, *ids, script=(_QUEUED, _QUEUED_SHA)
        )
    return total


async def _group_state(client: RedisClient, names: Layout, stream: str, group: str) -> GroupState:
    row = await client.call(_run_read_only, client, names.stream(stream), group)
    length, found, reported, lag, pending, consumers, last_id, _ = row
    last_ms = int(_as_str(last_id).split("-")[0])
    if not found:
        return GroupState(stream, group, int(length), int(length), 0, 0, None, last_ms)
    reported_lag = None if int(reported) < 0 else int(reported)
    return GroupState(
        stream, group, int(length), int(lag), int(pending), int(consumers), reported_lag, last_ms
    )


@dataclass(frozen=True)
class LagRepair:
    stream: str
    group: str
    entries_read_was: int
    entries_read: int
    lag: int


async def repair_lag(client: RedisClient, stream_key: str, group: str) -> LagRepair | None:
    """Set the group's ``entries-read`` right where the server has it wrong (repair_lag.lua:
    at the group's own last-delivered id, atomically, so nothing is delivered again or
    skipped); returns what was repaired, None when nothing was wrong. Needs XGROUP SETID on
    the stream: a consumer of the group (queues.acl)."""
    script = client.sync.register_script(_REPAIR_LAG)
    row = await client.call(script, keys=[stream_key], args=[group])
    if not row:
        return None
    was, now, lag = (int(x) for x in row)
    return LagRepair(stream_key, group, was, now, lag)


async def stream_length(client: RedisClient, names: Layout, stream: str) -> int:
    """XLEN; summed over the shards for the run view of a sharded run."""
    if names.spans_shards(stream):
        return sum([await stream_length(client, n, stream) for n in names.layouts()])
    return int(await client.call(client.sync.xlen, names.stream(stream)))


@dataclass(frozen=True)
class Paused:
    """A stage paused on backpressure (:func:`mark_paused`): what it waits on."""

    stage: str
    downstream: str
    backlog: int
    limit: int


async def mark_paused(
    client: RedisClient, names: Layout, paused: Paused, *, ttl_s: float
) -> None:
    """Say that a process of ``paused.stage`` is paused; it expires ``ttl_s`` after the last
    call (a stage that resumes, or dies, stops renewing it)."""
    value = json.dumps(asdict(paused))
    ttl_ms = max(1, int(ttl_s * 1000))
    await client.call(client.sync.set, names.paused(paused.stage), value, px=ttl_ms)


async def paused_stages(client: RedisClient, names: Layout, stages: list[str]) -> list[Paused]:
    """The stages among ``stages`` that are paused on backpressure now."""
    if not stages:
        return []
    raw = await client.call(client.sync.mget, [names.paused(s) for s in stages])
    out = []
    for value in raw:
        if value:
            with contextlib.suppress(ValueError, TypeError):
                out.append(Paused(**json.loads(value)))
    return out


async def newest_entry_age_s(
    client: RedisClient, names: Layout, streams: tuple[str, ...]
) -> float | None:
    """Seconds (on the server's clock) since an entry was last added to any of ``streams``
    (every shard of the work streams); None when none ever was."""
    newest, now_ms = 0, 0
    for stream in streams:
        layouts = names.layouts() if names.spans_shards(stream) else [names]
        for layout in layouts:
            row = await client.call(_run_read_only, client, layout.stream(stream), "")
            newest = max(newest, int(_as_str(row[6]).split("-")[0]))
            now_ms = max(now_ms, int(row[7]))
    return max(0.0, (now_ms - newest) / 1000) if newest else None
