"""The one staleness policy (protocol/staleness.py) the scheduler, the generator and the learner
ask: the admission bound, the synchronous mode's version wait, the learner's drop."""

from __future__ import annotations

from streamrl.protocol.admission import AdmissionState, staleness_room
from streamrl.protocol.messages import Trajectory
from streamrl.protocol.staleness import StalenessPolicy
from streamrl.testing.messages import make_trajectory


def _group(versions: list[int]) -> Trajectory:
    n = len(versions)
    return make_trajectory([1], [[5]] * n, [[-1.0]] * n, [0.0] * n, weight_versions=versions)


def test_a_group_is_too_stale_by_its_oldest_sample_and_dropped_whole() -> None:
    # Given a learner at version 6 that trains groups at most 2 versions behind
    policy = StalenessPolicy(max_staleness=2, groups_per_step=4)
    fresh_at_limit = _group([4, 6])  # staleness 2
    one_old_sample = _group([6, 6, 3])  # staleness 3: the whole group goes
    current = _group([6, 6])
    # Then only the group with a sample more than 2 versions old is too stale
    assert [policy.staleness(g, 6) for g in (fresh_at_limit, one_old_sample, current)] == [2, 3, 0]
    assert [policy.too_stale(g, 6) for g in (fresh_at_limit, one_old_sample, current)] == [
        False, True, False,
    ]


def test_admission_room_is_the_bound_minus_the_admitted() -> None:
    # k < (V + max_staleness + 1) * groups_per_step + D
    policy = StalenessPolicy(max_staleness=2, groups_per_step=4)
    assert policy.room(version=0, admitted=0, never_trained=0) == 12
    assert policy.room(version=1, admitted=12, never_trained=0) == 4
    assert policy.room(version=1, admitted=12, never_trained=3) == 7  # each lost group replaced
    assert policy.room(version=0, admitted=14, never_trained=0) == -2


def test_the_schedulers_room_is_the_policys() -> None:
    # Given the run's counters as the scheduler reads them
    policy = StalenessPolicy(max_staleness=2, groups_per_step=4)
    state = AdmissionState(admitted=12, stopped=False, never_trained=3)
    # Then its room is the one policy's
    assert staleness_room(state, 1, policy) == policy.room(1, 12, 3) == 7


def test_admission_and_the_learner_agree_on_the_bound() -> None:
    # Given groups admitted as the bound allows, each sampled at the version it was admitted at
    policy = StalenessPolicy(max_staleness=1, groups_per_step=2)
    admitted: list[int] = []  # the admission version of each group
    for version in range(5):
        admitted += [version] * policy.room(version, len(admitted), never_trained=0)
    # Then the learner, training groups_per_step groups per version in admission order, finds
    # none of them too stale at the version it trains them at (the scheduler's guarantee)
    for k, sampled_at in enumerate(admitted):
        trained_at = k // policy.groups_per_step  # the step that trains group k
        assert not policy.too_stale(_group([sampled_at]), trained_at)


def test_every_mode_waits_for_the_admitted_version_only_synchronous_strictly() -> None:
    task = _group([3]).rollout.task
    assert StalenessPolicy(max_staleness=0).synchronous
    assert StalenessPolicy(max_staleness=0).wait_version(task) == task.policy_version
    assert StalenessPolicy(max_staleness=0).strict_wait
    assert StalenessPolicy(max_staleness=2).wait_version(task) == task.policy_version
    assert not StalenessPolicy(max_staleness=2).strict_wait
