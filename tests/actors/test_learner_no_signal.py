"""A step without learning signal is no step (issue 32 item 6): when every group of a batch
has equal rewards (every advantage zero), the learner publishes no weights version and no
metrics; it acknowledges the groups, counts them (``count:no_signal``, what the summary and
the progress line show), and frees their admission slots, so the run goes on to batches that
do teach. Real Redis, the tiny model; the FSDP case under torchrun with 2 gloo ranks."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import trio

from streamrl.actors.learner import serve
from streamrl.actors.monitor import Monitor
from streamrl.config.schema import load_config
from streamrl.learner.checkpoint import LEDGER_FILE
from streamrl.protocol import names as N
from streamrl.protocol.admission import admission_state, counted
from streamrl.protocol.messages import StepMetrics, Trajectory, WeightsPublished
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.messages import make_trajectory
from tests.actors.test_learner_torchrun import _overrides
from tests.torchrun import learner_ranks


def _group(rewards: list[float]) -> bytes:
    n = len(rewards)
    return encode(make_trajectory([1, 2, 3], [[5, 6, 7]] * n, [[-1.0] * 3] * n, rewards))


# two batches (groups_per_step=2): the first without signal, the second with
NO_SIGNAL = [[0.0, 0.0], [1.0, 1.0]]
SIGNAL = [[0.0, 1.0], [1.0, 0.0]]


async def _publish(client: RedisClient, names: N.Names) -> list[str]:
    """The four groups, admitted (as by the scheduler); the episode ids of those with signal."""
    groups = [_group(r) for r in (*NO_SIGNAL, *SIGNAL)]
    episodes = [decode(g, Trajectory).episode_id for g in groups]
    await client.call(client.sync.sadd, names.admitted_groups, *episodes)
    await Producer(client, names).publish(N.TRAJECTORIES, groups)
    return episodes[2:]


async def _published(client: RedisClient, names: N.Names) -> list[int]:
    rows = await client.call(client.sync.xrange, names.stream(N.WEIGHTS))
    return [decode(f[b"d"], WeightsPublished).version for _, f in rows]


async def test_a_batch_without_signal_publishes_nothing_and_is_counted(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a batch whose groups all have equal rewards, then one whose groups teach
    taught = await _publish(client, names)
    config = load_config(None, [*_overrides(names.run, redis_url, tmp_path), "learner.max_steps=1"])
    ctx = ActorContext(config, client, names)
    # When the learner runs to its one step
    with trio.fail_after(120):
        await serve(ctx)
    # Then version 1 is the step on the groups with signal, and the only version published
    assert await _published(client, names) == [1]
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.METRICS))
    metrics = decode(fields[b"d"], StepMetrics)
    assert (metrics.step, metrics.groups) == (1, 2) and metrics.grad_norm > 0
    [line] = (tmp_path / "weights" / LEDGER_FILE).read_text().splitlines()
    assert sorted(msgspec.json.decode(line)["episode_ids"]) == sorted(taught)
    # and the groups without signal were acknowledged, counted once each, their slots freed
    pending = await client.call(client.sync.xpending, names.stream(N.TRAJECTORIES), "learner")
    assert pending["pending"] == 0
    assert await counted(client, names, "no_signal") == 2
    state = await admission_state(client, names, dynamic_sampling=False)
    assert state.never_trained == 2
    # and the summary and the progress line say so
    monitor = Monitor(ctx, tmp_path, eval_items=1)
    await monitor.refresh_domains()
    assert monitor.summary(names.run).skipped_no_signal == 2
    assert "no signal 2" in monitor.progress_line()


@pytest.mark.system
async def test_fsdp_ranks_skip_a_step_without_signal_together(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given the same two batches, for a learner of two FSDP ranks
    await _publish(client, names)
    overrides = [*_overrides(names.run, redis_url, tmp_path), "learner.max_steps=1",
                 "learner.parallelism=fsdp"]
    # When it runs to its one step, Then both ranks end (no rank waits in a collective the
    # other skipped) and only the step with signal is published
    await learner_ranks(overrides, deadline_s=240)
    assert await _published(client, names) == [1]
    assert await counted(client, names, "no_signal") == 2


async def test_a_wiring_check_may_publish_a_step_without_signal_marked_so(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given the same batches, and a learner told to step without signal (configs/tiny.toml)
    await _publish(client, names)
    overrides = [*_overrides(names.run, redis_url, tmp_path), "learner.max_steps=1",
                 "learner.step_without_signal=true"]
    ctx = ActorContext(load_config(None, overrides), client, names)
    # When it runs to its one step
    with trio.fail_after(120):
        await serve(ctx)
    # Then version 1 is the batch without signal, marked so, and nothing was skipped
    assert await _published(client, names) == [1]
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.METRICS))
    metrics = decode(fields[b"d"], StepMetrics)
    assert (metrics.step, metrics.groups, metrics.no_signal) == (1, 2, True)
    assert await counted(client, names, "no_signal") == 0
    # and the summary and the progress line count its groups as taught nothing
    monitor = Monitor(ctx, tmp_path, eval_items=1)
    monitor.steps.append(metrics)
    await monitor.refresh_domains()
    summary = monitor.summary(names.run)
    assert (summary.steps, summary.published_without_signal, summary.skipped_no_signal) == (1, 2, 0)
    assert "no signal 2" in monitor.progress_line()


def test_the_summary_line_counts_groups_without_learning_signal() -> None:
    from streamrl.actors.monitor import Summary
    from streamrl.cli.up import _summary_text

    fields = {"run": "r", "minutes": 1.0, "steps": 0, "policy_version": 0, "trajectories": 0,
              "samples": 0, "eval_reward_before": None, "eval_reward_after": None,
              "eval_rounds": [], "reward_first_steps": None, "reward_last_steps": None,
              "dropped_stale": 0, "dead_letters": 3, "learner_step_seconds": None,
              "learner_busy_fraction": None, "trained_tokens_per_second": None}
    summary = msgspec.convert({**fields, "skipped_no_signal": 610, "unjudged": 3}, Summary)
    line = _summary_text(summary, interrupted=False).splitlines()[1]
    assert line.endswith("0 steps, policy v0, 0 groups (0 samples) trained, 0 stale dropped, "
                         "3 dead letters, 610 groups skipped for no learning signal, 3 groups "
                         "the verifier could not judge (never trained)"), line
    plain = _summary_text(msgspec.convert(fields, Summary), interrupted=False)
    assert plain.splitlines()[1].endswith("3 dead letters")
