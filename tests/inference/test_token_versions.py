"""Per-token weight versions on the wire (``Sample.versions``) and the learner's staleness,
which counts from the oldest token of a group."""

from __future__ import annotations

import msgspec

from streamrl.protocol.messages import Trajectory, ids_to_bytes
from streamrl.protocol.staleness import StalenessPolicy, group_staleness
from streamrl.queues.codec import decode, encode
from streamrl.testing.messages import make_trajectory


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
    assert StalenessPolicy(max_staleness=2).too_stale(mixed, 7)


def test_client_reads_version_ranges_and_refuses_bad_ones() -> None:
    import pytest

    from streamrl.inference.sglang_client import ProtocolError, _completion

    def answer(ranges: list[dict] | None) -> dict:
        meta = {"finish_reason": {"type": "length"}, "weight_version": "2",
                "output_token_logprobs": [[-1.0, t, None] for t in (5, 6, 7)]}
        if ranges is not None:
            meta["weight_versions"] = ranges
        return {"text": "x", "output_ids": [5, 6, 7], "meta_info": meta}

    # No ranges: every token is the answer's weight_version
    assert _completion(answer(None)).token_versions().tolist() == [2, 2, 2]
    # Ranges: per token, and the completion's weight_version is the oldest
    c = _completion(answer([{"version": "default", "start": 0, "end": 1},
                            {"version": "2", "start": 1, "end": 3}]))
    assert c.token_versions().tolist() == [0, 2, 2] and c.weight_version == 0
    # Ranges that leave a gap or overrun are a protocol error (server data is untrusted)
    with pytest.raises(ProtocolError):
        _completion(answer([{"version": "1", "start": 0, "end": 2}]))
    with pytest.raises(ProtocolError):
        _completion(answer([{"version": "1", "start": 0, "end": 4}]))
