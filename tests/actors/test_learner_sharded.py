"""The learner of a sharded run on the real 3-node Redis Cluster: it trains groups of several
shards in one step, and its announcement crosses slots (``weights``/``metrics`` in the run's
slot, the acknowledgements in each shard). A learner that dies between the two steps (the
events published, the groups still pending) is restarted: nothing is announced twice,
nothing is trained twice, and the groups of every shard are acknowledged."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import trio

from streamrl.actors.learner import serve
from streamrl.learner.checkpoint import Ledger
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, WeightsPublished
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer, StreamConsumer
from streamrl.runtime.context import ActorContext
from tests.actors.helpers import ONE_TINY_STEP, Died, contains_died, group
from tests.helpers import run_config

SHARDS = 3
pytestmark = pytest.mark.on_cluster(shards=3)  # redis_url, names: tests/conftest.py


@pytest.mark.system
async def test_learner_dies_between_announcing_and_acknowledging(
    client: RedisClient, redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = N.Names(f"t{uuid.uuid4().hex[:10]}", shards=SHARDS)
    config = run_config(tmp_path, redis_url, names.run, *ONE_TINY_STEP, f"queues.shards={SHARDS}")
    ctx = ActorContext(config, client, names)
    # Given one group in shard 0 and one in shard 2
    groups = [group([0.0, 1.0]), group([1.0, 0.0])]
    for shard, one in zip((0, 2), groups, strict=True):
        await Producer(client, names.in_shard(shard)).publish(N.TRAJECTORIES, [encode(one)])

    # and a learner that dies after publishing step 1's events, before acknowledging
    # (the per-shard acknowledgement, which also settles the groups' admission records)
    async def die(self: StreamConsumer, *args: object, **kwargs: object) -> None:
        raise Died

    monkeypatch.setattr(StreamConsumer, "ack_many", die)
    with trio.fail_after(120), pytest.raises(BaseException) as died:
        await serve(ctx)
    assert contains_died(died.value)
    monkeypatch.undo()
    assert await client.call(client.sync.xlen, names.stream(N.WEIGHTS)) == 1
    for shard in (0, 2):
        key = names.in_shard(shard).stream(N.TRAJECTORIES)
        assert (await client.call(client.sync.xpending, key, "learner"))["pending"] == 1

    # When it is restarted
    with trio.fail_after(120):
        await serve(ctx)

    # Then step 1 was announced once, both groups are acknowledged, each trained once
    rows = await client.call(client.sync.xrange, names.stream(N.WEIGHTS))
    assert [decode(f[b"d"], WeightsPublished).version for _, f in rows] == [1]
    rows = await client.call(client.sync.xrange, names.stream(N.METRICS))
    [metrics] = [decode(f[b"d"], StepMetrics) for _, f in rows]
    assert (metrics.step, metrics.groups) == (1, 2)
    for shard in (0, 2):
        key = names.in_shard(shard).stream(N.TRAJECTORIES)
        assert (await client.call(client.sync.xpending, key, "learner"))["pending"] == 0
    [record] = Ledger.open(tmp_path / "weights", 1).records
    assert sorted(record.episode_ids) == sorted(g.episode_id for g in groups)
    assert sorted(e.split(":")[0] for e in record.entry_ids) == ["0", "2"]
