"""Per-domain figures (protocol/health.py): admitted counted per domain by the admission
script itself, scored groups and their reward by the verifier's hand-off, read by the roles
that show them (monitor: the summary; admin: ``streamrl status``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from streamrl.actors.scheduler import Scheduler
from streamrl.protocol import names as N
from streamrl.protocol.health import domain_health
from streamrl.protocol.messages import Task
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode
from streamrl.queues.streams import ensure_group
from streamrl.runtime.context import ActorContext
from tests.helpers import run_config


async def test_admission_counts_each_domain_once_with_its_groups(
    client: RedisClient, roles: dict[str, RedisClient], names: N.Names, redis_url: str,
    tmp_path: Path,
) -> None:
    config = run_config(tmp_path, redis_url, names.run, "scheduler.domains=['arith','math']",
                        "domain.math.weight=3")
    await ensure_group(client, names.stream(N.TASKS), "generator")
    # Given the scheduler, as its ACL user, admits 8 groups
    scheduler = Scheduler(ActorContext(config, roles["scheduler"], names))
    assert await scheduler.admit(8, version=0, admitted=0) == 8
    # When the same admission is replayed (a lost reply: the counter has moved)
    assert await scheduler.admit(8, version=0, admitted=0) == 0
    # Then each domain's admitted count is that of its published tasks, counted once
    rows = await client.call(client.sync.xrange, names.stream(N.TASKS))
    published = Counter(decode(f[b"d"], Task).domain for _, f in rows)
    for role in ("monitor", "admin"):  # the roles that show it may read it
        health = await domain_health(roles[role], names, ["arith", "math"])
        assert {d: h.admitted for d, h in health.items()} == published
        assert {d: h.backlog for d, h in health.items()} == published
    assert published == {"arith": 2, "math": 6}
