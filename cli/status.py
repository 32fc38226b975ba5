"""``streamrl status``: what every stream and consumer group of a run is doing, and which
stage is the bottleneck.

Per work stream and its group: length, lag (not yet delivered), pending (delivered, not
acknowledged), the age of the oldest pending entry, the highest delivery count among pending
entries, every consumer with its pending count and idle time, and the dead letters that came
from it; for the run: the learner's policy version and step rate, dead letters in all.

Bottleneck: over several samples (``--samples``, or the history of ``--watch``), the stage
whose input backlog (lag + pending) grows. Backpressure makes every stage upstream of a slow
one back up too, so the bottleneck is the *most downstream* stage whose backlog grows.

Sharded runs (``queues.shards`` > 1): every figure of a work stream is summed over its
shards (lengths, lag, pending, dead letters), the oldest pending age and highest delivery
count are the largest of any shard, and a consumer (one name in every shard) is listed once
with its pending entries summed and its shortest idle time.

Reads only. Never waits long for Redis: the connection uses short socket timeouts and the
reconnect window of :data:`OPS_RECONNECT`, so an unreachable server is a clear error in
seconds (exit status 2), not a 60 s hang.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import trio

from streamrl.config.schema import Config
from streamrl.protocol import names as N
from streamrl.protocol.messages import WeightsPublished
from streamrl.protocol.pipeline import PIPELINE, Stall, assess_stall, lag_flag
from streamrl.protocol.quarantine import quarantined
from streamrl.queues.client import Reconnect, RedisClient, RedisURL
from streamrl.queues.codec import MessageError, decode
from streamrl.queues.operations import BrokerError, latest_entries, pending_detail
from streamrl.queues.stats import (
    group_state,
    stream_length,
)

OPS_RECONNECT = Reconnect(timeout_s=3.0, backoff_s=0.1, max_backoff_s=0.5)
"""Operator commands give up on an unreachable Redis after about 3 s."""
CONNECT_TIMEOUT_S = 3.0
"""A server that does not answer the connection (a dead host) is given up on this fast."""
SOCKET_TIMEOUT_S = 30.0
"""A reply may take this long (replay reads whole streams)."""
class RedisUnreachable(RuntimeError):
    pass


def ops_client(config: Config) -> RedisClient:
    """A client for operator commands: as the ``admin`` role where its password is set
    (runtime/auth.py ``ops_url``), else ``run.redis_url`` as given (the operator's own
    credentials); short socket timeouts, a reconnect window of a few seconds."""
    from streamrl.runtime.auth import ops_url

    url = ops_url(config)
    if not url:
        raise RedisUnreachable("run.redis_url is empty: set $STREAMRL_REDIS_URL or --set")
    parts = urlsplit(url)
    if "+cluster" not in parts.scheme and parts.scheme != "unix":
        extra = f"socket_connect_timeout={CONNECT_TIMEOUT_S}&socket_timeout={SOCKET_TIMEOUT_S}"
        query = f"{parts.query}&{extra}" if parts.query else extra
        url = urlunsplit(parts._replace(query=query))
    return RedisClient(url, max_connections=8, reconnect=OPS_RECONNECT)


@dataclass(frozen=True)
class Consumer:
    name: str
    pending: int
    idle_s: float


@dataclass(frozen=True)
class GroupStatus:
    stream: str
    group: str
    length: int
    lag: int
    pending: int
    backlog: int
    oldest_pending_age_s: float | None
    max_deliveries: int
    dead_letters: int
    consumers: list[Consumer] = field(default_factory=list)
    reported_lag: int | None = None
    """The lag Redis reported (None: it could not tell)."""
    lag_flag: str | None = None
    """Why Redis's lag was set aside (impossible for this stream), else None."""


@dataclass(frozen=True)
class Snapshot:
    run: str
    at: float
    policy_version: int
    steps_per_min: float | None
    dead_letters: int
    groups: list[GroupStatus]
    bottleneck: str | None = None
    """The stage (consumer group) whose backlog grows, most downstream; None if none does."""
    growth: dict[str, int] = field(default_factory=dict)
    """Backlog change per stream across the samples the bottleneck was judged on."""
    shards: int = 1
    """Work-path shards of the run (``queues.shards``); the figures are their sums."""
    stall: Stall | None = None
    """Set when nothing was acknowledged for ``ops.stall_after_s`` while work is queued."""
    quarantined: dict[str, str] = field(default_factory=dict)
    """Quarantined domains (no new admissions) and why (protocol/quarantine.py)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def _group_detail(
    client: RedisClient, names: N.Names, stream: str, group: str
) -> tuple[float | None, int, list[Consumer]]:
    """Oldest pending age, highest delivery count, consumers: over every shard of the run."""
    ages: list[float] = []
    most = 0
    merged: dict[str, Consumer] = {}
    for layout in names.layouts():
        oldest, deliveries, consumers = await _shard_detail(client, layout, stream, group)
        ages += [oldest] if oldest is not None else []
        most = max(most, deliveries)
        for c in consumers:
            seen = merged.get(c.name)
            merged[c.name] = c if seen is None else Consumer(
                c.name, seen.pending + c.pending, min(seen.idle_s, c.idle_s)
            )
    return (max(ages) if ages else None), most, list(merged.values())


async def _shard_detail(
    client: RedisClient, names: N.Names, stream: str, group: str
) -> tuple[float | None, int, list[Consumer]]:
    detail = await pending_detail(client, names.stream(stream), group)
    oldest = None
    if detail.entries:  # the lowest id is the oldest entry; its age from the id's timestamp
        first_ms = int(detail.entries[0][0].split("-")[0])
        oldest = max(0.0, time.time() - first_ms / 1000)
    max_deliveries = max((count for _, count in detail.entries), default=0)
    return oldest, max_deliveries, [
        Consumer(c.name, c.pending, c.idle_s) for c in detail.consumers
    ]


async def _dead_by_stream(client: RedisClient, names: N.Names) -> tuple[int, dict[str, int]]:
    from streamrl.cli.dlq import list_dead

    total = await stream_length(client, names, N.DEAD)
    counts: dict[str, int] = {}
    if total <= 10_000:  # beyond that only the total: listing would take long
        for entry in await list_dead(client, names):
            stream = entry.letter.stream if entry.letter else "?"
            counts[stream] = counts.get(stream, 0) + 1
    return total, counts


async def _learner(client: RedisClient, names: N.Names) -> tuple[int, float | None]:
    version = 0
    for _, fields in await latest_entries(client, names.stream(N.WEIGHTS)):
        with contextlib.suppress(MessageError, KeyError):
            version = decode(fields[b"d"], WeightsPublished).version
    times = []
    for entry_id, _ in await latest_entries(client, names.stream(N.METRICS), count=20):
        times.append(int(entry_id.split("-")[0]) / 1000)
    rate = None
    if len(times) >= 2 and max(times) > min(times):
        rate = (len(times) - 1) / (max(times) - min(times)) * 60
    return version, rate


async def snapshot(
    client: RedisClient, names: N.Names, *, stall_after_s: float = 120.0, max_backlog: int = 0
) -> Snapshot:
    total_dead, dead = await _dead_by_stream(client, names)
    groups, states = [], []
    for stream in N.WORK_STREAMS:
        group = N.GROUP_OF_STREAM[stream]
        state = await group_state(client, names, stream, group)
        states.append(state)
        oldest, max_deliveries, consumers = await _group_detail(client, names, stream, group)
        groups.append(
            GroupStatus(
                stream, group, state.length, state.lag, state.pending, state.backlog, oldest,
                max_deliveries, dead.get(stream, 0), consumers, state.reported_lag,
                lag_flag(state),
            )
        )
    version, rate = await _learner(client, names)
    stall = await assess_stall(
        client, names, states, stall_after_s=stall_after_s, max_backlog=max_backlog
    )
    held = {d: why.describe() for d, why in (await quarantined(client, names)).items()}
    return Snapshot(
        names.run, time.time(), version, rate, total_dead, groups, shards=names.shards,
        stall=stall, quarantined=held,
    )


def bottleneck(samples: Sequence[Snapshot]) -> tuple[str | None, dict[str, int]]:
    """The most downstream stage of the training path whose backlog grew from the first
    sample to the last (and never shrank on the way), with every stream's growth."""
    if len(samples) < 2:
        return None, {}
    series = {
        stream: [next(g.backlog for g in s.groups if g.stream == stream) for s in samples]
        for stream in PIPELINE
    }
    growth = {stream: values[-1] - values[0] for stream, values in series.items()}
    growing = [
        stream
        for stream, values in series.items()
        if values[-1] > values[0] and all(b >= a for a, b in itertools.pairwise(values))
    ]
    if not growing:
        return None, growth
    return N.GROUP_OF_STREAM[growing[-1]], growth


async def sample(
    client: RedisClient, names: N.Names, samples: int, interval_s: float, **kw: Any
) -> Snapshot:
    """``samples`` snapshots ``interval_s`` apart; the last one, with the bottleneck judged
    (``kw``: :func:`snapshot`'s stall settings)."""
    taken = []
    for i in range(samples):
        if i:
            await trio.sleep(interval_s)
        taken.append(await snapshot(client, names, **kw))
    stage, growth = bottleneck(taken)
    last = taken[-1]
    return Snapshot(**{**last.__dict__, "bottleneck": stage, "growth": growth})


def render(s: Snapshot) -> str:
    rate = f"{s.steps_per_min:.2f} steps/min" if s.steps_per_min is not None else "no steps yet"
    run = f"{s.run} ({s.shards} shards)" if s.shards > 1 else s.run
    lines = [
        f"run {run}: policy v{s.policy_version}, {rate}, {s.dead_letters} dead letters,"
        f" bottleneck: {s.bottleneck or '-'}",
        f"{'stream':<14}{'group':<11}{'length':>8}{'lag':>7}{'pending':>9}{'oldest':>9}"
        f"{'maxdel':>8}{'dead':>6}  consumers (pending/idle)",
    ]
    for g in s.groups:
        oldest = f"{g.oldest_pending_age_s:.0f}s" if g.oldest_pending_age_s is not None else "-"
        consumers = ", ".join(f"{c.name} ({c.pending}/{c.idle_s:.0f}s)" for c in g.consumers)
        lag = f"{g.lag}!" if g.lag_flag else str(g.lag)
        lines.append(
            f"{g.stream:<14}{g.group:<11}{g.length:>8}{lag:>7}{g.pending:>9}{oldest:>9}"
            f"{g.max_deliveries:>8}{g.dead_letters:>6}  {consumers or '-'}"
        )
    lines += [f"! {g.lag_flag}" for g in s.groups if g.lag_flag]
    if s.stall is not None:
        lines.insert(1, s.stall.describe())
    lines += [f"quarantined {d}: {why} (lift: streamrl domains lift {d})"
              for d, why in s.quarantined.items()]
    return "\n".join(lines)


async def print_status(
    config: Config,
    as_json: bool,
    *,
    watch: bool = False,
    samples: int = 2,
    interval_s: float = 1.0,
) -> int:
    names = N.Names(config.run.name, shards=config.queues.shards)
    try:
        client = ops_client(config)
    except (RedisUnreachable, ValueError) as exc:
        print(f"streamrl status: {exc}", file=sys.stderr)
        return 2
    try:
        stall: dict[str, Any] = {
            "stall_after_s": config.ops.stall_after_s,
            "max_backlog": config.scheduler.max_backlog,
        }
        if not watch:
            snap = await sample(client, names, max(1, samples), interval_s, **stall)
            print(json.dumps(snap.to_json(), indent=2) if as_json else render(snap))
            return 0
        history: list[Snapshot] = []
        while True:  # --watch: one snapshot per interval, bottleneck over the last ten
            history = [*history[-9:], await snapshot(client, names, **stall)]
            stage, growth = bottleneck(history)
            snap = Snapshot(**{**history[-1].__dict__, "bottleneck": stage, "growth": growth})
            if as_json:
                print(json.dumps(snap.to_json()), flush=True)
            else:
                print("\x1b[2J\x1b[H" + render(snap), flush=True)
            await trio.sleep(interval_s)
    except BrokerError as exc:  # unreachable, refused, not Redis at all: say so, briefly
        print(
            f"streamrl status: cannot reach Redis at {RedisURL(config.run.redis_url).redacted}: "
            f"{type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 2
    finally:
        client.close()
