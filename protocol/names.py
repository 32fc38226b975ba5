"""Every stream, consumer group and key name of the pipeline, in one place.

The broker's :class:`streamrl.queues.keys.Layout` decides where a run's keys live (the run's
hash tag, shards, the work path and the run-global keys); :class:`Names` is that layout with
the pipeline's names: its streams (tasks -> rollouts -> executed -> trajectories, evals; the
run-global ``weights`` and ``metrics``), the group that consumes each (named after its
role), and the keys of admission, evaluation rounds, the stop flag and backpressure.

Admission slots are the broker's tickets: a training group's id is opened in the shard's
:attr:`Names.admitted_groups` when the scheduler admits it, settled by the learner's
hand-off, and a dead letter of one of its entries frees the slot once
(:attr:`Names.dead_groups`).
"""

from __future__ import annotations

from typing import ClassVar

from streamrl.queues.keys import DEAD, Layout

# Pipeline streams, in order. Each is consumed by the group of the same role name.
TASKS = "tasks"
ROLLOUTS = "rollouts"
EXECUTED = "executed"
TRAJECTORIES = "trajectories"
EVALS = "evals"
# Event streams (read without a group, by offset).
WEIGHTS = "weights"
METRICS = "metrics"

__all__ = [
    "DEAD",
    "EVALS",
    "EXECUTED",
    "FAILURE_CAUSES",
    "GROUP_OF_STREAM",
    "METRICS",
    "ROLLOUTS",
    "RUN_GLOBAL_STREAMS",
    "TASKS",
    "TRAJECTORIES",
    "UNRESOLVED_STREAMS",
    "WEIGHTS",
    "WORK_STREAMS",
    "Names",
    "failed_counter",
    "resolved_counter",
    "trained_counter",
]

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

UNRESOLVED_STREAMS = (TASKS, ROLLOUTS, EXECUTED)
"""Streams whose training groups the verifier has not resolved yet: a dead letter from one
of them resolves its group (:func:`resolved_counter`), one from ``trajectories`` does not."""


# Per-domain counters of the work path (``Names.counter``: per shard, summed by readers).
def resolved_counter(domain: str) -> str:
    """Training groups of ``domain`` that left the pipeline before the learner: verified
    (the verifier's hand-off), or dead-lettered upstream of it (the letter's script)."""
    return f"resolved:{domain}"


def trained_counter(domain: str) -> str:
    """Training groups of ``domain`` the verifier forwarded to the learner."""
    return f"trained:{domain}"


FAILURE_CAUSES = ("timeout", "crash", "error", "rejected", "output", "delivery_limit", "payload",
                  "unjudged")
"""Why a stage dead-lettered a group: its time limit or a scorer's deadline, a scorer process
that died, any other handler failure (after the retries), refused by the handler (Reject),
an output over the size limit, past the delivery limit, no usable payload, the verifier
could not judge a sample (``actors/verifier.py``: not a reward of 0)."""


def failed_counter(domain: str, stage: str = "", cause: str = "") -> str:
    """Training groups of ``domain`` dead-lettered (any stage, any cause), or with ``stage``
    and ``cause`` (:data:`FAILURE_CAUSES`) those dead-lettered by that stage for that cause:
    added by the letter's script (``queues/deadletter.lua``), once per group."""
    return f"failed:{domain}:{stage}:{cause}" if stage else f"failed:{domain}"


class Names(Layout):
    """The run's layout with the pipeline's names (see the module docstring)."""

    GLOBAL_STREAMS: ClassVar[frozenset[str]] = frozenset(RUN_GLOBAL_STREAMS)

    def group(self, stream: str) -> str:
        return GROUP_OF_STREAM.get(stream, stream)

    @property
    def policy_version(self) -> str:
        """Latest published policy version (int)."""
        return f"{self.prefix}policy_version"

    @property
    def admitted(self) -> str:
        """Counter of training groups the scheduler has admitted (staleness admission)."""
        return f"{self.prefix}admitted"

    @property
    def admitted_by_domain(self) -> str:
        """Hash of training groups admitted per domain (field: the domain), added to by the
        admission script with :attr:`admitted` (run-global, like it)."""
        return f"{self.prefix}admitted_by_domain"

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

    @property
    def fleet(self) -> str:
        """Hash of the executors' sandbox fleets (run-global): ``<host>/<pid>/<image>`` ->
        JSON of that Docker backend's counts and when they were taken, written by its executor
        every few seconds (actors/executor.py ``publish_fleet``), read by ``streamrl
        status``."""
        return f"{self.prefix}fleet"

    @property
    def quarantine(self) -> str:
        """Hash of the quarantined domains (run-global): domain -> why (JSON), written by the
        scheduler when a domain passes its failure threshold, a field deleted by the operator
        (``streamrl domains lift``); a quarantined domain gets no new training admissions."""
        return f"{self.prefix}quarantine"

    @property
    def held_back(self) -> str:
        """Hash of the curriculum domains held below a level (run-global): domain -> level,
        levels and why (JSON, protocol/curriculum.py), written by the scheduler when a level
        cannot be taken, read by ``streamrl status``."""
        return f"{self.prefix}held_back"

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

    @property
    def open_tickets(self) -> str:
        return self.admitted_groups

    @property
    def released_tickets(self) -> str:
        return self.dead_groups

    @property
    def reservations(self) -> str:
        return self.admissions
