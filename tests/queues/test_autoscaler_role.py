"""The ``autoscaler`` role (protocol/roles.py), the user KEDA's ScaledObjects connect as
(deploy/kubernetes/keda.yaml): it reads the pending counts of the three scaled groups
(generator on ``tasks``, executor on ``rollouts``, verifier on ``executed``: what KEDA's
redis-streams scaler sends for ``pendingEntriesCount``) and nothing else. Against a real
Redis, on one shard and on two."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis

from streamrl.protocol import names as N
from streamrl.protocol import roles
from streamrl.queues.acl import role_url
from streamrl.queues.client import RedisClient
from tests.helpers import role_credentials

SCALED = {N.TASKS: "generator", N.ROLLOUTS: "executor", N.EXECUTED: "verifier"}


@pytest.fixture(params=[1, 2], ids=["one-shard", "two-shards"])
def run_names(request: pytest.FixtureRequest, names: N.Names) -> N.Names:
    return N.Names(names.run, shards=int(request.param))


@pytest.fixture
async def autoscaler(client: RedisClient, run_names: N.Names) -> AsyncIterator[redis.Redis]:
    """The run's autoscaler user, as ``streamrl acl apply`` creates it; deleted afterwards."""
    creds = role_credentials(run_names)["autoscaler"]
    shards = run_names.shards if run_names.sharded else 0
    await roles.apply_acls(client, run_names, {"autoscaler": creds}, shards=shards)
    user = redis.Redis.from_url(role_url(client.url.url, creds))
    try:
        yield user
    finally:
        user.close()
        client.sync.execute_command("ACL", "DELUSER", creds.user)


def _stream_keys(names: N.Names, stream: str) -> list[str]:
    return [layout.stream(stream) for layout in names.layouts()]


async def test_it_reads_the_pending_counts_of_the_three_scaled_groups(
    client: RedisClient, run_names: N.Names, autoscaler: redis.Redis
) -> None:
    # Given two entries delivered and not acknowledged in each scaled group, in every shard
    for stream, group in SCALED.items():
        for key in _stream_keys(run_names, stream):
            client.sync.xgroup_create(key, group, id="0", mkstream=True)
            client.sync.xadd(key, {"d": b"x"})
            client.sync.xadd(key, {"d": b"y"})
            client.sync.xreadgroup(group, "replica-1", {key: ">"})
    # Then the autoscaler reads each group's pending count (XPENDING's summary: KEDA's call)
    for stream, group in SCALED.items():
        for key in _stream_keys(run_names, stream):
            assert autoscaler.xpending(key, group)["pending"] == 2


async def test_it_may_do_nothing_else(
    client: RedisClient, run_names: N.Names, autoscaler: redis.Redis
) -> None:
    tasks = run_names.layouts()[0].stream(N.TASKS)
    client.sync.xgroup_create(tasks, "generator", id="0", mkstream=True)
    client.sync.xadd(tasks, {"d": b"x"})
    refused = [
        ("XLEN", tasks),  # nor the entries themselves, nor the group's other state
        ("XRANGE", tasks, "-", "+"),
        ("XINFO", "GROUPS", tasks),
        ("XREADGROUP", "GROUP", "generator", "keda", "STREAMS", tasks, ">"),
        ("XACK", tasks, "generator", "0-1"),
        ("XADD", tasks, "*", "d", "x"),
        ("XGROUP", "SETID", tasks, "generator", "$"),
        ("XPENDING", run_names.stream(N.TRAJECTORIES), "learner"),  # not a scaled stage
        ("XPENDING", run_names.stream(N.DEAD), "dead"),
        ("XPENDING", N.Names("another-run").stream(N.TASKS), "generator"),
        ("GET", run_names.admitted),
        ("EVAL", "return 1", "1", tasks),
        ("KEYS", "*"),
        ("CONFIG", "GET", "requirepass"),
        ("INFO",),
    ]
    for command in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            autoscaler.execute_command(*command)
    assert autoscaler.ping()
