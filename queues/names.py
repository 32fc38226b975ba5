"""Every stream, consumer group and key name, in one place.

All keys of one run live under ``streamrl:{<run>}:`` so several runs share one Redis. The
run name sits in a hash tag: on Redis Cluster every key of a run maps to one slot, so the
atomic hand-off script (which touches the input stream, the output streams and a dedup
key) is legal there.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Names:
    run: str = "default"

    @property
    def prefix(self) -> str:
        return f"streamrl:{{{self.run}}}:"

    def stream(self, name: str) -> str:
        return f"{self.prefix}s:{name}"

    def short(self, key: str) -> str:
        """The stream name without the run prefix (for logs and dead letters)."""
        return key.removeprefix(self.prefix + "s:")

    def dedup(self, stage: str, message_id: str) -> str:
        return f"{self.prefix}dedup:{stage}:{message_id}"

    @property
    def policy_version(self) -> str:
        """Latest published policy version (int)."""
        return f"{self.prefix}policy_version"

    @property
    def admitted(self) -> str:
        """Counter of training groups the scheduler has admitted (staleness admission)."""
        return f"{self.prefix}admitted"

    @property
    def eval_round(self) -> str:
        """Counter of evaluation rounds started."""
        return f"{self.prefix}eval_round"

    @property
    def stop(self) -> str:
        """Set when the run is being wound down: the scheduler admits no new training work."""
        return f"{self.prefix}stop"

    def counter(self, name: str) -> str:
        return f"{self.prefix}count:{name}"
