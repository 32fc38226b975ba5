"""Per-domain figures (protocol/health.py): admitted counted per domain by the admission
script itself, scored groups and their reward by the verifier's hand-off, read by the roles
that show them (monitor: the summary; admin: ``streamrl status``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from streamrl.actors.executor import to_outcome
from streamrl.actors.scheduler import Scheduler, make_task
from streamrl.actors.verifier import Verifier
from streamrl.domains.math import MathItem
from streamrl.protocol import names as N
from streamrl.protocol.health import domain_health
from streamrl.protocol.messages import Executed, Rollout, Sample, Sampling, Task, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode
from streamrl.queues.streams import ensure_group
from streamrl.runtime.context import ActorContext
from streamrl.runtime.serve import Count
from tests.helpers import run_config

ITEM = MathItem(id="m", prompt="What is 2+2?", answer="4", kind="t")


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


async def test_the_verifier_counts_each_scored_group_and_its_reward() -> None:
    # Given a training group of the math domain, 3 of 4 answers right (no dynamic sampling)
    task = make_task("math", ITEM, split="train", group_size=4, sampling=Sampling(), version=0)
    texts = ["Answer: 4", "Answer: 4", "Answer: 5", "Answer: 4"]
    samples = [Sample(tokens=b"\0\0\0\0", logprobs=b"\0\0\0\0", text=t,
                      finish_reason="stop", weight_version=0) for t in texts]
    rollout = Rollout(id=new_id(), created_at=now(), policy_version=0, task=task,
                      prompt_ids=b"\0\0\0\0", samples=samples)
    executed = Executed(id=new_id(), created_at=now(), policy_version=0, rollout=rollout,
                        outcomes=[to_outcome(None) for _ in texts])
    # When the verifier scores it
    counts = {r.name: r.n for r in await Verifier(False).handle(executed) if isinstance(r, Count)}
    # Then it is counted as scored with its mean reward in thousandths (the curriculum's and
    # the summary's train reward), besides resolved and trained
    assert counts == {"resolved:math": 1, "trained:math": 1, "resolved:math:scored": 1,
                      "resolved:math:reward_milli": 750}
