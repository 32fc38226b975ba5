"""Event streams (weights) have no consumer group and no dead letters: a forged or garbage
event written by a role that may add to one is logged and passed over by its followers (the
scheduler's admission and the generator's weight updates), never raised to them."""

from __future__ import annotations

import structlog
import trio

from streamrl.actors.scheduler import latest_version
from streamrl.protocol import names as N
from streamrl.protocol.messages import WeightsPublished
from streamrl.protocol.versions import VersionFollower
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.payloads import REF_PREFIX
from streamrl.queues.streams import EventReader, Producer


def _weights(version: int) -> bytes:
    return encode(
        WeightsPublished(
            id=f"w{version}", created_at=0.0, policy_version=version, version=version,
            path=f"/w/v{version}",
        )
    )


async def test_a_forged_latest_event_is_passed_over(
    roles: dict[str, RedisClient], names: N.Names
) -> None:
    # Given version 3 published, then garbage and a forged claim-check reference on top of it
    # (written as the learner, the one role that may add to the weights stream)
    forged = REF_PREFIX + names.admitted.encode()
    await Producer(roles["learner"], names).publish(N.WEIGHTS, [_weights(3), b"\xc1junk", forged])
    # When the scheduler (its own ACL user) reads the policy version at start
    reader = EventReader(roles["scheduler"], names, N.WEIGHTS, block_ms=100)
    try:
        with structlog.testing.capture_logs() as logs:
            version = await latest_version(reader)
    finally:
        reader.close()
    # Then it is the newest event that decodes, and each bad one is logged
    assert version == 3
    assert [e["event"] for e in logs] == ["undecodable event skipped"] * 2
    assert "WeightsPublished" in logs[0]["reason"]


async def test_followers_skip_bad_events_and_keep_following(
    roles: dict[str, RedisClient], names: N.Names
) -> None:
    producer = Producer(roles["learner"], names)
    reader = EventReader(roles["generator"], names, N.WEIGHTS, block_ms=100)
    try:
        # Given a follower at the start of the stream
        assert await reader.newest_id() is None
        # When a good event, garbage and another good event arrive
        await producer.publish(N.WEIGHTS, [_weights(1), b"\x00not msgpack", _weights(2)])
        with structlog.testing.capture_logs() as logs:
            with trio.fail_after(5):
                events = await reader.read_events(WeightsPublished)
        # Then both good ones are read, in order, and the bad one is logged with its id
        assert [e.version for e in events] == [1, 2]
        assert len(logs) == 1 and logs[0]["log_level"] == "error" and logs[0]["entry_id"]
    finally:
        reader.close()


async def test_an_entry_without_a_payload_on_top_does_not_restart_the_chain(
    roles: dict[str, RedisClient], names: N.Names
) -> None:
    # Given versions 1 to 3 published, then an entry with no payload field on top of them
    # (written as the learner, the one role that may add to the weights stream)
    learner = roles["learner"]
    await Producer(learner, names).publish(N.WEIGHTS, [_weights(v) for v in (1, 2, 3)])
    await learner.call(learner.sync.xadd, names.stream(N.WEIGHTS), {"x": b"no payload"})
    reader = EventReader(roles["scheduler"], names, N.WEIGHTS, block_ms=100)
    try:
        # When the scheduler reads the policy version at start
        follower = VersionFollower()
        version = await latest_version(reader, follower)
        # Then it is the chain's newest, and the learner's next version is taken after it
        assert version == 3
        await Producer(learner, names).publish(N.WEIGHTS, [_weights(4)])
        with trio.fail_after(5):
            while not follower.take_all(await reader.read_events(WeightsPublished)):
                pass
        assert follower.version == 4
    finally:
        reader.close()
