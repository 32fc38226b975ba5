"""``streamrl up --autoscale``: replicas of each stage from its input stream's backlog, on one
machine: the counterpart of the KEDA ScaledObjects of deploy/kubernetes (docs/kubernetes.md),
which scale each Deployment on its consumer group's pending entries. Here the supervisor sees
every stage at once, so it can use the lag (entries no replica took yet) and pick the most
downstream backlogged stage, which a per-Deployment scaler cannot.

Every ``up.autoscale_interval_s`` the supervisor samples each work stream's consumer group
(lag: entries no replica took yet; pending: taken, not acknowledged) and, over the last
``up.autoscale_window`` samples (:func:`decide`):

- **up**: the most downstream stage of the training path (generator <- tasks, executor <-
  rollouts, verifier <- executed) whose input lag stayed at least ``up.autoscale_lag`` in
  every sample, or whose every slot (``concurrency`` per replica) held an entry in every
  sample, gets one replica (a run held back by its staleness bound and the scheduler's
  backpressure may never build a lag in front of its slowest stage: that stage is the one
  always busy), unless it has ``up.autoscale_max_replicas`` or the run has
  ``up.autoscale_max_processes`` actor processes. Backpressure makes every stage upstream of
  a slow one back up too, so only the most downstream backlogged stage is scaled (as
  ``streamrl status`` names the bottleneck); when it is at its maximum nothing upstream is
  added (more producers would only queue more);
- **down**: otherwise a stage above the count ``up`` started with, whose input lag was 0 and
  whose pending entries fit in one replica fewer (``concurrency`` each) in every sample,
  loses its newest replica. It is stopped as any actor is (SIGINT: it drains what it holds;
  anything it did not acknowledge is reclaimed by the others), so nothing is lost.

After each change the window starts over (the change's effect is what the next decision
sees). Each change is printed (``streamrl: autoscale: executor 1 -> 2 (...)``) and logged.
A Redis error while sampling skips that sample.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import trio

from streamrl.protocol import names as N

log = structlog.get_logger()

STAGE_INPUTS = ((N.TASKS, "generator"), (N.ROLLOUTS, "executor"), (N.EXECUTED, "verifier"))
"""The scalable stages and their input streams, upstream first."""

Sample = Mapping[str, tuple[int, int]]
"""stream -> (lag, pending) of its consumer group."""


@dataclass(frozen=True)
class Change:
    stage: str
    delta: int  # +1 or -1
    why: str


def decide(history: Sequence[Sample], replicas: Mapping[str, int], base: Mapping[str, int],
           concurrency: Mapping[str, int], *, lag: int, max_replicas: int,
           room: int) -> Change | None:
    """The change the window ``history`` calls for, if any (see the module docstring).
    ``room``: actor processes that may still be added."""
    for stream, stage in reversed(STAGE_INPUTS):
        lags = [h[stream][0] for h in history]
        slots = replicas[stage] * concurrency[stage]
        busy = [h[stream][1] for h in history]
        if min(lags) >= lag:
            why = f"{stream}: lag {min(lags)}..{max(lags)} in the last {len(history)} samples"
        elif min(busy) >= slots:
            why = (f"{stream}: every slot busy ({min(busy)}..{max(busy)} pending, {slots} "
                   f"slots) in the last {len(history)} samples")
        else:
            continue
        if replicas[stage] >= max_replicas or room < 1:
            return None
        return Change(stage, +1, why)
    for stream, stage in STAGE_INPUTS:
        n = replicas[stage]
        if n <= base[stage]:
            continue
        fits = (n - 1) * concurrency[stage]
        if all(h[stream][0] == 0 and h[stream][1] <= fits for h in history):
            most = max(h[stream][1] for h in history)
            return Change(stage, -1, f"{stream}: no lag, at most {most} pending in the last "
                                     f"{len(history)} samples ({n - 1} replicas take {fits})")
    return None


class Autoscaler:
    """Runs :func:`decide` over live samples and applies its changes through ``add`` (start
    one more replica of a stage) and ``remove`` (stop its newest one)."""

    def __init__(self, config: Any, sample: Callable[[], Awaitable[Sample]],
                 add: Callable[[str], Awaitable[None]], remove: Callable[[str], Awaitable[None]],
                 replicas: dict[str, int], processes: Callable[[], int]) -> None:
        up = config.up
        self.up = up
        self.sample = sample
        self.add, self.remove = add, remove
        self.replicas = replicas  # the live count per stage, kept current here
        self.base = dict(replicas)
        self.processes = processes
        self.max_processes = up.autoscale_max_processes or processes() + (os.cpu_count() or 1)
        self.concurrency = {"generator": config.generator.concurrency,
                            "executor": config.executor.concurrency,
                            "verifier": config.verifier.concurrency}
        self.changes: list[Change] = []

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        history: deque[Sample] = deque(maxlen=self.up.autoscale_window)
        task_status.started()
        while True:
            await trio.sleep(self.up.autoscale_interval_s)
            try:
                history.append(await self.sample())
            except (OSError, RuntimeError) as exc:  # Redis away: skip this sample
                log.warning("autoscale sample failed", error=repr(exc))
                continue
            if len(history) < self.up.autoscale_window:
                continue
            change = decide(history, self.replicas, self.base, self.concurrency,
                            lag=self.up.autoscale_lag, max_replicas=self.up.autoscale_max_replicas,
                            room=self.max_processes - self.processes())
            if change is None:
                continue
            before = self.replicas[change.stage]
            if change.delta > 0:
                await self.add(change.stage)
            else:
                await self.remove(change.stage)
            self.replicas[change.stage] = before + change.delta
            self.changes.append(change)
            print(f"streamrl: autoscale: {change.stage} {before} -> {before + change.delta} "
                  f"({change.why})", flush=True)
            log.info("autoscaled", stage=change.stage, replicas=before + change.delta,
                     why=change.why)
            history.clear()

