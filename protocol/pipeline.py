"""The pipeline seen whole: the state of every work stage's consumer group, and whether the
run is stalled (work queued on the training path, nothing acknowledged for a while) and why.
Read by the monitor (progress, the stall warning) and ``streamrl status``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.stats import GroupState, group_state, newest_entry_age_s, paused_stages

PIPELINE = (N.TASKS, N.ROLLOUTS, N.EXECUTED, N.TRAJECTORIES)
"""The training path in order (``evals`` feeds the monitor, off the path)."""
ACTIVITY = (*N.WORK_STREAMS, N.DEAD, N.METRICS)
"""Streams that grow only as work gets done: hand-off outputs (each acknowledges its input),
admissions, dead letters (each acknowledges its entry), learner steps."""
PAUSABLE = ("generator", "executor", "verifier")
"""Stages that pause on their downstream's backlog (runtime.serve, queues.stats.mark_paused)."""




async def pipeline_state(client: RedisClient, names: N.Names) -> list[GroupState]:
    """The consumer group of every work stream (:data:`streamrl.protocol.names.WORK_STREAMS`)."""
    return [await group_state(client, names, s, N.GROUP_OF_STREAM[s]) for s in N.WORK_STREAMS]


@dataclass(frozen=True)
class Stall:
    idle_s: float
    """Since anything was last acknowledged anywhere (the server's clock)."""
    queued: int
    """Entries waiting or in progress on the training path."""
    reasons: list[str]

    def describe(self) -> str:
        return (
            f"STALLED: nothing acknowledged for {self.idle_s:.0f}s while {self.queued} entries"
            f" are queued: {'; '.join(self.reasons)}"
        )


def lag_flag(state: GroupState) -> str | None:
    """Why the lag Redis reported for ``state`` was set aside; None if it was not."""
    if not state.lag_inconsistent or state.reported_lag is None:
        return None
    reported = state.reported_lag
    why = (
        f"more than the stream's {state.length} entries"
        if reported > state.length
        else f"but {state.lag} entries follow its last-delivered id"
    )
    return f"{state.stream}: Redis reports lag {reported}, {why} (lag counted from the stream)"


async def assess_stall(
    client: RedisClient,
    names: N.Names,
    groups: Sequence[GroupState],
    *,
    stall_after_s: float,
    max_backlog: int = 0,
) -> Stall | None:
    """A :class:`Stall` when work is queued on the training path and nothing was acknowledged
    for ``stall_after_s`` (no entry added to any of :data:`ACTIVITY`), with the reasons: the
    stages paused on backpressure (on what, with which backlog), the scheduler held by its
    ``max_backlog``, lags Redis got wrong, groups with work and no consumer or only work in
    progress."""
    queued = sum(g.backlog for g in groups if g.stream in PIPELINE)
    if not queued:
        return None
    idle = await newest_entry_age_s(client, names, ACTIVITY)
    if idle is None or idle < stall_after_s:
        return None
    paused = await paused_stages(client, names, list(PAUSABLE))
    reasons = [
        f"{p.stage} paused on backpressure: {p.downstream} backlog {p.backlog} > {p.limit}"
        for p in paused
    ]
    by_stream = {g.stream: g for g in groups}
    tasks = by_stream.get(N.TASKS)
    if tasks is not None and max_backlog and tasks.backlog >= max_backlog:
        reasons.append(
            f"scheduler not admitting: tasks backlog {tasks.backlog} >= scheduler.max_backlog"
            f" {max_backlog}"
        )
    reasons += [flag for g in groups if (flag := lag_flag(g))]
    held = {p.stage for p in paused}
    for g in groups:
        if g.stream not in PIPELINE or not g.backlog or g.group in held:
            continue
        if not g.consumers:
            reasons.append(f"{g.group}: {g.backlog} entries and no consumer")
        elif g.pending and not g.lag:
            reasons.append(f"{g.group}: {g.pending} entries in progress, none acknowledged")
    return Stall(round(idle, 1), queued, reasons or ["no stage paused on backpressure"])


