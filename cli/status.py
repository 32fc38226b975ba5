"""``streamrl status``: what every stream and consumer group of a run is doing, and which
stage is the bottleneck.

Per work stream and its group: length, lag (not yet delivered), pending (delivered, not
acknowledged), the age of the oldest pending entry, the highest delivery count among pending
entries, every consumer with its pending count and idle time, and the dead letters that came
from it; for the run: the learner's policy version and step rate, dead letters in all.

Per domain (protocol/health.py, as the admin role): the top ``--top`` (10) by backlog, then
failures, or every one with ``--all``: admitted, resolved, trained, backlog, failed training
groups (by stage and cause), train reward, quarantined (and why), forgetting (an eval-only
domain, from the monitor's ``<run dir>/evals.jsonl`` where status runs beside it); and every
curriculum domain the scheduler holds below a level, and why (protocol/curriculum.py).

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
import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import trio

from streamrl.config.schema import Config
from streamrl.protocol import names as N
from streamrl.protocol.curriculum import held_back
from streamrl.protocol.health import DomainHealth, domain_health
from streamrl.protocol.messages import WeightsPublished
from streamrl.protocol.pipeline import PIPELINE, Stall, assess_stall, lag_flag
from streamrl.queues.client import Reconnect, RedisClient, RedisURL
from streamrl.queues.codec import MessageError, decode
from streamrl.queues.operations import BrokerError, latest_entries, pending_detail, read_hash
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
    domains: list[DomainStatus] = field(default_factory=list)
    """The domains shown: the top ones by backlog, then failures (all with ``--all``)."""
    domains_total: int = 0
    """How many domains the run has (configured, admitted or quarantined)."""
    forgetting: list[str] = field(default_factory=list)
    """Eval-only domains whose held-out reward fell past ``scheduler.forgetting_margin``."""
    held_back: dict[str, str] = field(default_factory=dict)
    """Curriculum domains the scheduler holds below a level, and why (protocol/curriculum.py)."""
    rounds: list[str] = field(default_factory=list)
    """A post-training sequence's state (``<run dir>/rounds.json``, cli/rounds.py): the
    current stage and each stage's outcome and why; empty without rounds."""
    fleet: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Each executor's Docker sandbox fleet (``<host>/<pid>/<image>``): containers starting
    and running, created, reaped, leaked, sessions expired, and ``at`` (when its executor
    wrote them, every few seconds; an old one is an executor gone)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class DomainStatus:
    """One domain's line (protocol/health.py)."""

    name: str
    admitted: int
    resolved: int
    trained: int
    backlog: int
    """Admitted and not resolved yet."""
    failed: int
    """Dead-lettered training groups."""
    failed_by: dict[str, int]
    """``<stage>:<cause>`` -> dead-lettered training groups."""
    train_reward: float | None
    quarantined: str | None
    """Why the domain is quarantined; None: it is not."""
    forgetting: bool


@dataclass(frozen=True)
class DomainView:
    """Which domains ``status`` lists: ``known`` (the config's) and every one the run
    admitted or quarantined; the ``top`` of them by backlog, then failures (None: all);
    forgetting judged on the monitor's ``eval_log`` (``<run dir>/evals.jsonl``) for the
    ``eval_only`` domains."""

    known: tuple[str, ...] = ()
    top: int | None = 10
    eval_log: Path | None = None
    eval_only: tuple[str, ...] = ()
    forgetting_margin: float = 0.05


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
    client: RedisClient, names: N.Names, *, stall_after_s: float = 120.0, max_backlog: int = 0,
    view: DomainView | None = None,
) -> Snapshot:
    view = view or DomainView()
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
    health = await domain_health(client, names, list(view.known), seen=True)
    held = {d: h.quarantined.describe() for d, h in health.items() if h.quarantined}
    flagged = eval_forgetting(view)
    rows = [_domain_status(d, h, d in flagged) for d, h in health.items()]
    return Snapshot(
        names.run, time.time(), version, rate, total_dead, groups, shards=names.shards,
        stall=stall, quarantined=held, domains=top_domains(rows, view.top),
        domains_total=len(rows), forgetting=flagged, fleet=await read_fleet(client, names),
        held_back={d: h.describe() for d, h in (await held_back(client, names)).items()},
    )


async def read_fleet(client: RedisClient, names: N.Names) -> dict[str, dict[str, Any]]:
    """The executors' fleet counts (a field that does not decode is left out)."""
    out = {}
    for key, raw in sorted((await read_hash(client, names.fleet)).items()):
        with contextlib.suppress(ValueError):
            value = json.loads(raw)
            if isinstance(value, dict):
                out[key] = value
    return out


def render_fleet(s: Snapshot) -> list[str]:
    """One line per executor's Docker backend: its containers and what its sweeps found."""
    lines = []
    for key, f in s.fleet.items():
        age = s.at - float(f.get("at", 0.0))
        lines.append(
            f"sandboxes {key}: starting {f.get('starting', 0)}, running "
            f"{f.get('running', 0)} ({f.get('busy', 0)} busy), created "
            f"{f.get('created', 0)}, reaped {f.get('reaped', 0)}, leaked {f.get('leaked', 0)}, "
            f"expired {f.get('expired', 0)} ({age:.0f}s ago)")
    return lines


def _domain_status(name: str, h: DomainHealth, forgetting: bool) -> DomainStatus:
    why = h.quarantined.describe() if h.quarantined else None
    return DomainStatus(name, h.admitted, h.resolved, h.trained, h.backlog, h.failed,
                        dict(h.causes), h.train_reward, why, forgetting)


def top_domains(rows: list[DomainStatus], top: int | None) -> list[DomainStatus]:
    """The ``top`` of ``rows`` by backlog, then failures, then name (None: all of them)."""
    ranked = sorted(rows, key=lambda r: (-r.backlog, -r.failed, r.name))
    return ranked if top is None else ranked[:top]


def eval_forgetting(view: DomainView) -> list[str]:
    """The eval-only domains flagged as forgetting in the monitor's log of held-out results
    (actors/monitor.py ``forgetting``); none without the log (status on another host). The
    latest round counts once it has as many results as the one before it (else it is still
    being evaluated)."""
    from streamrl.actors.monitor import EvalRound, forgetting

    if view.eval_log is None or not view.eval_only or not view.eval_log.exists():
        return []
    rounds: dict[int, EvalRound] = {}
    seen: set[tuple[int, str, str]] = set()
    for line in view.eval_log.read_text().splitlines():
        try:
            row = json.loads(line)
            key = (int(row["round"]), str(row["domain"]), str(row["item_id"]))
            reward = float(row["reward"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash
        if key not in seen:
            seen.add(key)
            r = rounds.setdefault(key[0], EvalRound(key[0], 0))
            r.rewards.append(reward)
            r.by_domain.setdefault(key[1], []).append(reward)
    ordered = [r for _, r in sorted(rounds.items())]
    if len(ordered) > 1 and len(ordered[-1].rewards) < len(ordered[-2].rewards):
        ordered = ordered[:-1]
    return forgetting(ordered, list(view.eval_only), view.forgetting_margin)


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
    lines += render_domains(s)
    lines += render_fleet(s)
    lines += [f"quarantined {d}: {why} (lift: streamrl domains lift {d})"
              for d, why in s.quarantined.items()]
    lines += [f"held back {d}: {why}" for d, why in s.held_back.items()]
    lines += [f"forgetting {d}: held-out reward fell past scheduler.forgetting_margin"
              for d in s.forgetting]
    lines += s.rounds
    return "\n".join(lines)


def render_domains(s: Snapshot) -> list[str]:
    """One line per shown domain: admitted, resolved, trained, backlog, failed (by stage
    and cause), train reward, quarantined, forgetting."""
    if not s.domains:
        return []
    shown = len(s.domains)
    head = (f"domains: top {shown} of {s.domains_total} by backlog, then failures (--all: every"
            " one)" if shown < s.domains_total else f"domains: {shown}")
    width = max(8, *(len(d.name) + 2 for d in s.domains))
    lines = [head, f"{'domain':<{width}}{'admitted':>9}{'resolved':>9}{'trained':>8}"
                   f"{'backlog':>8}{'failed':>7}{'reward':>8}  failures, state"]
    for d in s.domains:
        reward = f"{d.train_reward:.3f}" if d.train_reward is not None else "-"
        notes = [f"{k.replace(':', ' ')} {n}" for k, n in
                 sorted(d.failed_by.items(), key=lambda kv: (-kv[1], kv[0]))]
        notes += [f"QUARANTINED: {d.quarantined}"] if d.quarantined else []
        notes += ["FORGETTING"] if d.forgetting else []
        lines.append(f"{d.name:<{width}}{d.admitted:>9}{d.resolved:>9}{d.trained:>8}"
                     f"{d.backlog:>8}{d.failed:>7}{reward:>8}  {', '.join(notes) or '-'}")
    return lines


def domain_view(config: Config, top: int | None) -> DomainView:
    """The domains of ``config`` (trained and eval-only) and its monitor's log of held-out
    results."""
    sched = config.scheduler
    return DomainView(
        known=tuple(dict.fromkeys([*sched.domains, *sched.eval_domains])), top=top,
        eval_log=config.run.path / "evals.jsonl",
        eval_only=tuple(d for d in sched.eval_domains if d not in sched.domains),
        forgetting_margin=sched.forgetting_margin,
    )


async def print_status(
    config: Config,
    as_json: bool,
    *,
    watch: bool = False,
    samples: int = 2,
    interval_s: float = 1.0,
    top: int | None = 10,
) -> int:
    """``streamrl status``: ``top`` domains by backlog, then failures (None: ``--all``)."""
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
            "view": domain_view(config, top),
        }
        from streamrl.cli.rounds import rounds_lines

        rounds = rounds_lines(config.run.path)
        if not watch:
            snap = await sample(client, names, max(1, samples), interval_s, **stall)
            snap = dataclasses.replace(snap, rounds=rounds)
            print(json.dumps(snap.to_json(), indent=2) if as_json else render(snap))
            return 0
        history: list[Snapshot] = []
        while True:  # --watch: one snapshot per interval, bottleneck over the last ten
            history = [*history[-9:], await snapshot(client, names, **stall)]
            stage, growth = bottleneck(history)
            snap = Snapshot(**{**history[-1].__dict__, "bottleneck": stage, "growth": growth,
                               "rounds": rounds_lines(config.run.path)})
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
