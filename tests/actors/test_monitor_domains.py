"""The summary's per-domain table (``Summary.domains``) and forgetting: admitted and trained
groups and train reward from the run's counters, the held-out reward per round from the
monitor's evaluation rounds, an eval-only domain's drop past ``scheduler.forgetting_margin``
flagged."""

from __future__ import annotations

from pathlib import Path

import structlog
import trio

from streamrl.actors.monitor import Monitor, _domain_means_text
from streamrl.actors.scheduler import Scheduler, make_task
from streamrl.domains.math import MathItem
from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling, StepMetrics
from streamrl.protocol.quarantine import Why, quarantine
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.operations import increment
from streamrl.queues.payloads import REF_PREFIX
from streamrl.queues.streams import ConsumerSettings, Producer, ensure_group, open_stream_consumer
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until
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
    assert s.skipped_zero_variance == 0  # no group skipped for equal rewards


async def test_summary_counts_the_groups_dynamic_sampling_skipped(
    client: RedisClient, roles: dict[str, RedisClient], names: N.Names, redis_url: str,
    tmp_path: Path,
) -> None:
    config = run_config(tmp_path, redis_url, names.run, "verifier.dynamic_sampling=true")
    # Given 5 training groups the verifier skipped for equal rewards, as its hand-offs count
    await client.call(client.sync.incrby, names.counter("zero_variance"), 5)
    # When the monitor (as its ACL user) reads the counters and summarises
    monitor = Monitor(ActorContext(config, roles["monitor"], names), tmp_path, eval_items=2)
    await monitor.refresh_domains()
    # Then the summary has them beside the stale drops: generated = trained + skipped + stale
    assert monitor.summary(names.run).skipped_zero_variance == 5


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


async def test_a_round_ends_when_its_other_items_were_dead_lettered(
    client: RedisClient, roles: dict[str, RedisClient], names: N.Names, redis_url: str,
    tmp_path: Path,
) -> None:
    config = run_config(tmp_path, redis_url, names.run)
    monitor = Monitor(ActorContext(config, roles["monitor"], names), tmp_path, eval_items=3)
    # Given a held-out round the run opened, of three items: one scored, two dead-lettered on
    # their way by the generator (a prompt too long for the model), one of them twice (a
    # replayed letter)
    await increment(client, names.eval_round)
    monitor._add(0, "m0", "math", [1.0], [0])
    lost = [make_task("math", MathItem(id=f"m{i}", prompt=f"{i} + 1?", answer=str(i + 1),
                                       kind="add"),
                      split="eval", group_size=1, sampling=Sampling(), version=0, eval_round=0)
            for i in (1, 2)]
    train = make_task("math", MathItem(id="t", prompt="2 + 2?", answer="4", kind="add"),
                      split="train", group_size=2, sampling=Sampling(), version=0)
    await Producer(client, names).publish(N.TASKS, [encode(t) for t in (*lost, lost[0], train)])
    settings = ConsumerSettings(block_ms=50)
    async with open_stream_consumer(roles["generator"], names, N.TASKS, stage="generator",
                                    settings=settings) as generator:
        for delivery in await generator.read(10):
            await generator.dead_letter(delivery, "prompt + max_new_tokens exceeds 2048")
    # When the monitor follows the dead letters, as its ACL user
    async with trio.open_nursery() as nursery:
        nursery.start_soon(monitor._serve_dead_letters, names)
        with trio.fail_after(10):
            done = await monitor.wait_round(0)
        nursery.cancel_scope.cancel()
    # Then the round ended: its two lost items counted once each, out of its mean; the
    # training group's letter counted nothing
    assert (done.lost, done.rewards, done.mean) == (2, [1.0], 1.0)
    assert monitor.completed_rounds() == [done]


def test_the_progress_line_summarises_many_domains() -> None:
    # Given a held-out round over 101 domains, and one over 3
    many = {f"d{i:03d}": i / 100 for i in range(101)}
    few = {"arith": 0.5, "math": 0.25, "code": 0.0}
    # Then the line names the spread for many (lowest and highest three), each for few
    assert _domain_means_text(many) == (
        "101 domains, lowest d000 0.00 d001 0.01 d002 0.02; highest d098 0.98 d099 0.99 d100 1.00")
    assert _domain_means_text(few) == "arith 0.50 math 0.25 code 0.00"


def _step_metrics(step: int) -> bytes:
    return encode(StepMetrics(
        id=f"m{step}", created_at=0.0, policy_version=step, step=step, loss=0.0, grad_norm=0.0,
        reward_mean=0.5, groups=1, samples=2, tokens=8, dropped_stale=0, max_staleness_seen=0,
        step_seconds=0.1, wait_seconds=0.0,
    ))


async def test_the_monitor_passes_over_a_forged_metrics_event(
    roles: dict[str, RedisClient], names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a monitor following the metrics stream (as its own ACL user)
    config = run_config(tmp_path, redis_url, names.run)
    monitor = Monitor(ActorContext(config, roles["monitor"], names), tmp_path, eval_items=2)
    # When the learner's role adds a step, garbage and a forged claim-check reference, then
    # another step
    forged = REF_PREFIX + names.admitted.encode()
    await Producer(roles["learner"], names).publish(
        N.METRICS, [_step_metrics(1), b"\xc1junk", forged, _step_metrics(2)]
    )
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(monitor._serve_metrics)
            await wait_until(lambda: len(monitor.steps) >= 2, timeout=10)
            nursery.cancel_scope.cancel()
    # Then both steps are read in order, the follower is still alive, and each bad event is
    # logged (it has no dead-letter stream)
    assert [m.step for m in monitor.steps] == [1, 2]
    assert sum(e["event"] == "undecodable event skipped" for e in logs) == 2
