"""The summary's per-domain table (``Summary.domains``) and forgetting: admitted and trained
groups and train reward from the run's counters, the held-out reward per round from the
monitor's evaluation rounds, an eval-only domain's drop past ``scheduler.forgetting_margin``
flagged."""

from __future__ import annotations

from pathlib import Path

from streamrl.actors.monitor import Monitor
from streamrl.actors.scheduler import Scheduler
from streamrl.protocol import names as N
from streamrl.protocol.quarantine import Why, quarantine
from streamrl.queues.client import RedisClient
from streamrl.queues.streams import ensure_group
from streamrl.runtime.context import ActorContext
from tests.helpers import run_config


async def test_summary_has_every_domain_and_flags_forgetting(
    client: RedisClient, roles: dict[str, RedisClient], names: N.Names, redis_url: str,
    tmp_path: Path,
) -> None:
    config = run_config(tmp_path, redis_url, names.run, "scheduler.domains=['arith','math']",
                        "scheduler.eval_domains=['general']", "scheduler.forgetting_margin=0.1")
    await ensure_group(client, names.stream(N.TASKS), "generator")
    # Given 4 admitted groups, and 2 of arith's scored (rewards 1.0 and 0.5) and trained
    assert await Scheduler(ActorContext(config, roles["scheduler"], names)).admit(4, 0, 0) == 4
    for key, n in (("resolved:arith", 2), ("trained:arith", 2), ("resolved:arith:scored", 2),
                   ("resolved:arith:reward_milli", 1500)):  # as the verifier's hand-offs add
        await client.call(client.sync.incrby, names.counter(key), n)
    # and three held-out rounds in which the eval-only `general` falls 0.9 -> 0.7 -> 0.5
    monitor = Monitor(ActorContext(config, roles["monitor"], names), tmp_path, eval_items=2)
    for round_no, general in enumerate((0.9, 0.7, 0.5)):
        monitor._add(round_no, "g", "general", [general], [round_no])
        monitor._add(round_no, "a", "arith", [0.5 + 0.1 * round_no], [round_no])
    # When the monitor (as its ACL user) reads the counters and summarises
    await monitor.refresh_domains()
    s = monitor.summary(names.run)
    # Then every domain has its row, and `general` is flagged as forgetting
    assert set(s.domains) == {"arith", "math", "general"}
    arith = s.domains["arith"]
    assert arith["trained"] == 2 and arith["train_reward"] == 0.75
    assert arith["eval"] == [0.5, 0.6, 0.7] and not arith["forgetting"]
    assert s.domains["arith"]["admitted"] + s.domains["math"]["admitted"] == 4
    assert s.domains["general"]["eval"] == [0.9, 0.7, 0.5]
    assert s.domains["general"]["forgetting"] and s.forgetting == ["general"]
    assert "forgetting: general" in monitor.progress_line()


async def test_summary_has_each_domains_dead_letters_and_quarantine(
    client: RedisClient, roles: dict[str, RedisClient], names: N.Names, redis_url: str,
    tmp_path: Path,
) -> None:
    config = run_config(tmp_path, redis_url, names.run, "scheduler.domains=['arith','math']")
    # Given 3 of math's training groups dead-lettered (2 by the verifier's scorer, 1 past the
    # generator's delivery limit), as the dead-letter script counts them, and math quarantined
    for key, n in ((N.failed_counter("math"), 3),
                   (N.failed_counter("math", "verifier", "error"), 2),
                   (N.failed_counter("math", "generator", "delivery_limit"), 1)):
        await client.call(client.sync.incrby, names.counter(key), n)
    why = Why(failed=3, groups=4, causes={"verifier:error": 2, "generator:delivery_limit": 1})
    await quarantine(roles["scheduler"], names, "math", why)
    # When the monitor (as its ACL user) reads the figures and summarises
    monitor = Monitor(ActorContext(config, roles["monitor"], names), tmp_path, eval_items=2)
    await monitor.refresh_domains()
    s = monitor.summary(names.run)
    # Then math has its dead letters by stage and cause, and is quarantined with the reason
    math, arith = s.domains["math"], s.domains["arith"]
    assert math["dead_letters"] == {
        "count": 3, "by_stage": {"verifier": 2, "generator": 1},
        "by_cause": {"verifier:error": 2, "generator:delivery_limit": 1},
    }
    assert math["quarantined"] is True and math["quarantine_reason"] == why.describe()
    assert arith["dead_letters"] == {"count": 0, "by_stage": {}, "by_cause": {}}
    assert arith["quarantined"] is False and arith["quarantine_reason"] is None
