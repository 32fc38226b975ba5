"""Per-token weight versions on the wire (``Sample.versions``) and the learner's staleness,
which counts from the oldest token of a group."""

from __future__ import annotations

import msgspec

from learner.batch import group_staleness, make_trajectory, split_stale
from queues.messages import Trajectory, decode, encode, ids_to_bytes


def with_versions(traj: Trajectory, versions: list[list[int]]) -> Trajectory:
    samples = [msgspec.structs.replace(s, versions=ids_to_bytes(v))
               for s, v in zip(traj.rollout.samples, versions, strict=True)]
    rollout = msgspec.structs.replace(traj.rollout, samples=samples)
    return msgspec.structs.replace(traj, rollout=rollout)


def test_versions_round_trip_and_default_to_weight_version() -> None:
    traj = make_trajectory([1, 2], [[5, 6, 7], [8]], [[-1.0] * 3, [-2.0]], [1.0, 0.0],
                           weight_versions=[4, 5])
    # Without per-token versions every token is the sample's weight_version
    assert [s.token_versions().tolist() for s in traj.rollout.samples] == [[4, 4, 4], [5]]
    # With them, they survive encoding and decoding
    mixed = with_versions(traj, [[4, 5, 5], [5]])
    back = decode(encode(mixed), Trajectory)
    assert [s.token_versions().tolist() for s in back.rollout.samples] == [[4, 5, 5], [5]]


def test_staleness_counts_from_the_oldest_token() -> None:
    # A sample whose weight_version says 6 but whose first tokens came from version 3
    traj = make_trajectory([1, 2], [[5, 6, 7]], [[-1.0] * 3], [1.0], weight_versions=6)
    assert group_staleness(traj, 7) == 1
    mixed = with_versions(traj, [[3, 6, 6]])
    assert group_staleness(mixed, 7) == 4
    fresh, stale = split_stale([mixed], 7, max_staleness=2)
    assert fresh == [] and stale == [mixed]
