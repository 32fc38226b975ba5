"""Malformed input at the queue layer: a message of another type is refused, and an entry
two consumers hold at once is dead-lettered once."""

from __future__ import annotations

import pytest

from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Sampling, Task, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, MessageError, decode, encode
from streamrl.queues.streams import ConsumerSettings, Producer, open_stream_consumer
from streamrl.testing.messages import make_trajectory
from streamrl.testing.wait import wait_until


def test_a_message_with_unknown_fields_is_refused() -> None:
    # A Trajectory has every field of an Executed, plus its rewards
    trajectory = make_trajectory([1, 2], [[3, 4]], [[-1.0, -1.0]], [1.0])
    with pytest.raises(MessageError, match="unknown field `rewards`"):
        decode(encode(trajectory), Executed)


@pytest.mark.parametrize(
    ("group_size", "sampling", "field"),
    [
        (0, Sampling(), "group_size"),
        (10**6, Sampling(), "group_size"),
        (4, Sampling(max_new_tokens=10**9), "max_new_tokens"),
        (4, Sampling(max_new_tokens=0), "max_new_tokens"),
        (4, Sampling(top_p=0.0), "top_p"),
        (4, Sampling(temperature=-1.0), "temperature"),
    ],
)
def test_a_task_that_would_size_work_out_of_bounds_is_refused(
    group_size: int, sampling: Sampling, field: str
) -> None:
    task = Task(
        id=new_id(), created_at=now(), policy_version=0, domain="arith", item_id="1",
        split="train", prompt="p", spec={}, group_size=group_size, sampling=sampling,
    )  # fmt: skip
    with pytest.raises(MessageError, match=field):
        decode(encode(task), Task)
    ok = Task(**{**{f: getattr(task, f) for f in task.__struct_fields__}, "group_size": 4})
    assert decode(encode(ok.__replace__(sampling=Sampling())), Task).group_size == 4


async def test_an_entry_held_by_two_consumers_is_dead_lettered_once(
    client: RedisClient, names: N.Names
) -> None:
    # Given an entry read by consumer a and then reclaimed by consumer b (a looked dead)
    await Producer(client, names).publish(N.EXECUTED, [b"\xc1garbage"])
    settings = ConsumerSettings(reclaim_min_idle_ms=1)
    async with (
        open_stream_consumer(client, names, N.EXECUTED, stage="v", settings=settings) as a,
        open_stream_consumer(client, names, N.EXECUTED, stage="v", settings=settings) as b,
    ):
        [held_by_a] = await a.read(1)
        [held_by_b] = await wait_until(lambda: b.reclaim(1), 10, what="b did not reclaim it")
        # When both dead-letter it
        await a.dead_letter(held_by_a, "malformed message: a")
        await b.dead_letter(held_by_b, "malformed message: b")
    # Then the dead-letter stream holds it once, and nothing is pending
    rows = await client.call(client.sync.xrange, names.stream(N.DEAD))
    letters = [decode(f[b"d"], DeadLetter) for _, f in rows]
    assert [(x.entry_id, x.error) for x in letters] == [
        (held_by_a.entry_id, "malformed message: a")
    ]
    pending = await client.call(client.sync.xpending, names.stream(N.EXECUTED), "verifier")
    assert pending["pending"] == 0
