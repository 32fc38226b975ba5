"""Admission accounting: what the counters of a run say about how much training work may
still enter it, read through the broker (:mod:`streamrl.queues.operations`).

- :func:`admission_state`: training groups admitted so far, the stop flag, and D, the groups
  that will never be trained (dropped as stale by the learner, settled by it in a batch
  without learning signal, skipped for zero reward variance by the verifier where dynamic
  sampling is on, dead-lettered at any stage and not requeued), each count summed over the
  shards. The scheduler admits group number k only
  while ``k < (V + max_staleness + 1) * groups_per_step + D`` (:func:`staleness_room`).
  Every count is written by the atomic hand-off that causes it, under its dedup key, so the
  bound holds across replays.
- :func:`admission_closed`: ``max_train_groups`` admitted and no admission half-published
  across shards; :func:`run_drained`: that, and nothing left upstream, so no training group
  can reach the learner any more (the learner's last, part-filled step).
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.protocol import names as N
from streamrl.protocol.staleness import StalenessPolicy
from streamrl.queues.client import RedisClient
from streamrl.queues.operations import (
    count_reservations,
    read_counter,
    read_counters,
    read_flag,
)
from streamrl.queues.stats import group_state


@dataclass(frozen=True)
class AdmissionState:
    admitted: int
    """Training groups admitted so far (the run-global ``admitted`` counter)."""
    stopped: bool
    """The run's stop flag: no more training groups are admitted."""
    never_trained: int
    """D: groups that freed their slot (stale drops, batches without signal, zero-variance
    skips, dead groups)."""


async def admission_state(
    client: RedisClient, names: N.Names, *, dynamic_sampling: bool
) -> AdmissionState:
    """The counters of the staleness bound, D summed over the shards (one read per shard)."""
    admitted = await read_counter(client, names.admitted)
    if await read_flag(client, names.stop):
        return AdmissionState(admitted, True, 0)
    freed = ["dropped_stale", "no_signal", *(["zero_variance"] if dynamic_sampling else [])]
    never = 0
    for layout in names.layouts():  # each shard's counters in its own slot
        keys = [layout.counter(name) for name in freed] + [layout.dead_groups]
        never += sum(await read_counters(client, keys))
    return AdmissionState(admitted, False, never)


def staleness_room(state: AdmissionState, version: int, policy: StalenessPolicy) -> int:
    """How many more training groups the staleness bound admits at policy version
    ``version`` (may be <= 0): the run's one staleness policy
    (:meth:`streamrl.protocol.staleness.StalenessPolicy.room`) on these counters. A group that
    will never be trained frees its slot (replaced at today's V): without it, once more than
    ``max_staleness * groups_per_step`` groups were lost the learner could never fill a batch
    again and the run would stall."""
    return policy.room(version, state.admitted, state.never_trained)


async def counted(client: RedisClient, names: N.Names, name: str) -> int:
    """Counter ``name`` of the run: the sum of its key in every shard."""
    return sum(await read_counters(client, names.counter_keys(name)))


async def domain_counts(
    client: RedisClient, names: N.Names, domains: list[str]
) -> tuple[dict[str, int], dict[str, int]]:
    """The verifier's per-domain counters, summed over the shards: (resolved, trained)."""
    counters = [f"{kind}:{d}" for kind in ("resolved", "trained") for d in domains]
    counts = [0] * len(counters)
    for layout in names.layouts():  # one key per shard, each in its shard's slot
        values = await read_counters(client, [layout.counter(name) for name in counters])
        counts = [total + v for total, v in zip(counts, values, strict=True)]
    n = len(domains)
    return dict(zip(domains, counts[:n], strict=True)), dict(zip(domains, counts[n:], strict=True))


async def admission_closed(client: RedisClient, names: N.Names, limit: int) -> bool:
    """Whether admission of a run limited to ``limit`` training groups is over: ``limit``
    admitted and no admission half-published across shards (0: never closed)."""
    if not limit:
        return False
    if await read_counter(client, names.admitted) < limit:
        return False
    return not await count_reservations(client, names)


async def run_drained(client: RedisClient, names: N.Names, limit: int) -> bool:
    """Whether no training group can reach the learner any more: admission is closed
    (:func:`admission_closed`) and no stage upstream holds work (nothing waiting or in
    progress in ``tasks``, ``rollouts``, ``executed``; nothing undelivered in
    ``trajectories``). Each stage hands off and acknowledges in one script, so work is always
    visible in one of these counts."""
    if not await admission_closed(client, names, limit):
        return False
    for stream in (N.TASKS, N.ROLLOUTS, N.EXECUTED):
        state = await group_state(client, names, stream, N.GROUP_OF_STREAM[stream])
        if state.backlog:
            return False
    own = await group_state(client, names, N.TRAJECTORIES, N.GROUP_OF_STREAM[N.TRAJECTORIES])
    return own.lag == 0
