"""The staleness policy: how far behind the learner a training group may be sampled, in one place.

A group's staleness at learner version ``V`` is ``V`` minus the oldest weight version any of
its tokens was sampled with (a completion may span weight updates). ``max_staleness`` bounds
it at three points, each asking :class:`StalenessPolicy`:

- the scheduler admits training group number k only while
  ``k < (V + max_staleness + 1) * groups_per_step + D`` (:meth:`StalenessPolicy.room`; D:
  groups that will never be trained, each replaced once), so every admitted group can still
  be trained within ``max_staleness`` versions of the policy that samples it;
- the generator generates a task only on weights at least as new as the ones it was admitted
  at (:meth:`StalenessPolicy.wait_version`): the bound above counts from the admission
  version, so a generator that had not loaded it yet (a task admitted right after a publish)
  would sample the group one version older than the bound allows and the learner would drop
  it. In synchronous mode (``max_staleness = 0``, :attr:`StalenessPolicy.synchronous`) that is
  exactly the admitted version and the wait is strict; otherwise a generator that cannot
  load it within a short wait generates on what it serves (:attr:`StalenessPolicy.strict_wait`);
- the learner drops (acknowledges and counts) a group too stale for the version it would be
  trained at (:meth:`StalenessPolicy.too_stale`); it never trains on one.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamrl.protocol.messages import Task, Trajectory


def group_staleness(trajectory: Trajectory, learner_version: int) -> int:
    """How many versions behind ``learner_version`` the oldest token of the group was drawn
    (per-token versions: a completion may span a weight update)."""
    oldest = min(
        min(s.weight_version, int(s.token_versions().min(initial=s.weight_version)))
        for s in trajectory.rollout.samples
    )
    return learner_version - oldest


@dataclass(frozen=True)
class StalenessPolicy:
    max_staleness: int
    """``learner.max_staleness``: the most versions a trained group may lag (0: synchronous)."""
    groups_per_step: int = 1
    """``learner.groups_per_step``: groups in one learner step (one version)."""

    def room(self, version: int, admitted: int, never_trained: int) -> int:
        """How many more training groups may be admitted at policy version ``version`` with
        ``admitted`` admitted so far and ``never_trained`` (D) that will never be trained:
        ``(V + max_staleness + 1) * groups_per_step + D - admitted`` (may be <= 0)."""
        bound = (version + self.max_staleness + 1) * self.groups_per_step + never_trained
        return bound - admitted

    @property
    def synchronous(self) -> bool:
        """``max_staleness = 0``: a group is trained at the version right after the one it was
        admitted at, so it must be generated on exactly those weights (the batch barrier)."""
        return self.max_staleness == 0

    def wait_version(self, task: Task) -> int:
        """The weight version a generator should serve before it generates ``task``: the one
        it was admitted at."""
        return task.policy_version

    @property
    def strict_wait(self) -> bool:
        """Whether a task may only be generated once :meth:`wait_version` is served (the
        synchronous mode's barrier); else a generator waits a short while, then generates on
        the weights it serves (the learner still drops what ends up too stale)."""
        return self.synchronous

    def staleness(self, trajectory: Trajectory, version: int) -> int:
        return group_staleness(trajectory, version)

    def too_stale(self, trajectory: Trajectory, version: int) -> bool:
        """Whether the group may not be trained at ``version`` (it is dropped whole)."""
        return group_staleness(trajectory, version) > self.max_staleness
