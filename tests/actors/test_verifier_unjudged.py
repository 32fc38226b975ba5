"""A verifier that cannot judge is not a wrong answer (issue 32 item 3): a group with a sample
the domain could not judge (:class:`~streamrl.domains.base.VerifierFailed`: a test script that
wrote no reward, a crashed harness, a scorer that raised) is dead-lettered at once under cause
``unjudged``, never trained, counted against its domain (what ``streamrl status``, the
summary and the quarantine read) and shown by ``streamrl replay show``. Real Redis, the real
runtime and verifier, real scorer processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from streamrl.actors.executor import to_outcome
from streamrl.actors.monitor import Monitor
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import SCORER_PRELOAD, Verifier
from streamrl.protocol import names as N
from streamrl.protocol.admission import counted
from streamrl.protocol.health import domain_health
from streamrl.protocol.messages import Executed, Rollout, Sample, Sampling, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import DeadLetter, decode, encode
from streamrl.queues.streams import ConsumerSettings, Producer, open_stream_consumer
from streamrl.runtime.context import ActorContext
from streamrl.runtime.policies import Policies, RetryPolicy
from streamrl.runtime.serve import ActorRuntime, RuntimeSettings
from streamrl.runtime.workers import open_worker_pool
from streamrl.testing.wait import wait_until
from tests.actors import planted_scorers
from tests.actors.planted_scorers import UNJUDGED_REASON, PlantedItem
from tests.helpers import run_config

UNJUDGED = "planted-unjudged"


def _executed(domain: str, split: str = "train", size: int = 2) -> Executed:
    task = make_task(domain, PlantedItem(id=domain, prompt="p"), split=split, group_size=size,
                     sampling=Sampling(), version=0, eval_round=0 if split == "eval" else -1)
    sample = Sample(tokens=b"\0\0\0\0", logprobs=b"\0\0\0\0", text="x", finish_reason="stop",
                    weight_version=0)
    rollout = Rollout(id=new_id(), created_at=now(), policy_version=0, task=task,
                      prompt_ids=b"\0\0\0\0", samples=[sample] * size)
    return Executed(id=new_id(), created_at=now(), policy_version=0, rollout=rollout,
                    outcomes=[to_outcome(None)] * size)


async def _verify(client: RedisClient, names: N.Names, groups: list[Executed]) -> ActorRuntime:
    await Producer(client, names).publish(N.EXECUTED, [encode(g) for g in groups])
    policies = Policies(retry=RetryPolicy(max_retries=2, backoff_s=0.05, max_backoff_s=0.1))
    async with (
        open_worker_pool(1, planted_scorers.setup, SCORER_PRELOAD) as scorers,
        open_stream_consumer(client, names, N.EXECUTED, stage="verifier",
                             settings=ConsumerSettings(block_ms=50)) as consumer,
    ):
        runtime = ActorRuntime(consumer, Verifier(scorers=scorers), policies,
                               RuntimeSettings(concurrency=2))
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime.serve)
            await wait_until(
                lambda: (s := runtime.statistics()).handled + s.dead_lettered >= len(groups),
                timeout=60,
            )
            nursery.cancel_scope.cancel()
    return runtime


async def test_an_unjudged_group_is_dead_lettered_once_counted_and_never_trained(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given an admitted training group the domain cannot judge, its held-out twin, and a
    # group of a domain that judges
    train, held_out = _executed(UNJUDGED), _executed(UNJUDGED, "eval")
    good = _executed("planted-ok")
    await client.call(client.sync.sadd, names.admitted_groups, train.episode_id)
    # When the verifier serves them
    runtime = await _verify(client, names, [train, held_out, good])
    # Then the unjudged ones are dead-lettered at once (no retry), saying why
    stats = runtime.statistics()
    assert (stats.handled, stats.dead_lettered, stats.retried) == (1, 2, 0)
    rows = await client.call(client.sync.xrange, names.stream(N.DEAD))
    letters = [decode(f[b"d"], DeadLetter) for _, f in rows]
    assert {x.error for x in letters} == {f"unjudged: sample 0: {UNJUDGED_REASON}; "
                                          f"sample 1: {UNJUDGED_REASON}"}
    # and never reach the learner nor the held-out results: only the judged group does
    assert await client.call(client.sync.xlen, names.stream(N.TRAJECTORIES)) == 1
    assert await client.call(client.sync.xlen, names.stream(N.EVALS)) == 0
    # and the training group counts against its domain under its own cause, frees its
    # admission slot, and is resolved, not trained
    health = (await domain_health(client, names, [UNJUDGED]))[UNJUDGED]
    assert (health.failed, health.causes) == (1, {"verifier:unjudged": 1})
    assert (health.resolved, health.trained, health.scored) == (1, 0, 0)
    assert int(await client.call(client.sync.get, names.dead_groups) or 0) == 1
    assert await counted(client, names, N.failed_counter(UNJUDGED, "verifier", "unjudged")) == 1
    # and the run's summary and progress line say so
    config = run_config(tmp_path, redis_url, names.run, f'scheduler.domains=["{UNJUDGED}"]')
    monitor = Monitor(ActorContext(config, client, names), tmp_path, eval_items=1)
    await monitor.refresh_domains()
    summary = monitor.summary(names.run)
    assert summary.unjudged == 1
    assert summary.domains[UNJUDGED]["dead_letters"]["by_cause"] == {"verifier:unjudged": 1}
    assert "| unjudged 1" in monitor.progress_line()


async def test_replay_show_names_the_unjudged_group_and_why(
    client: RedisClient, names: N.Names
) -> None:
    from streamrl.cli.replay import Query, render_episode, select_unjudged

    # Given a training group the verifier could not judge
    train = _executed(UNJUDGED)
    await _verify(client, names, [train])
    # When replay selects and shows what the run has
    [found] = await select_unjudged(client, names, Query())
    shown = render_episode(found)
    # Then the episode is there, marked unjudged and not trained, with the reason, no reward
    assert found.trajectory.episode_id == train.episode_id and found.source == "dead"
    assert f"unjudged (not trained): sample 0: {UNJUDGED_REASON}" in shown
    assert "--- reward" not in shown and shown.count("--- unjudged") == 2


async def test_replay_list_keeps_to_the_query_with_unjudged_groups(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from streamrl.cli.main import _parser
    from streamrl.cli.replay import Query, run_replay, select_unjudged

    # Given two training groups the verifier could not judge
    await _verify(client, names, [_executed(UNJUDGED), _executed(UNJUDGED)])
    config = run_config(tmp_path, redis_url, names.run)

    async def listed(*selection: str) -> list[dict]:
        args = _parser().parse_args(["replay", "list", "--source", "live", *selection])
        capsys.readouterr()
        assert await run_replay(client, names, config, args) == 0
        return json.loads(capsys.readouterr().out)

    # When replay lists them with a limit, for another stream, or by a reward bound
    # Then the limit holds, and groups without a reward match neither the stream nor the bound
    assert len(await listed()) == 2
    assert len(await listed("--limit", "1")) == 1
    assert await listed("--stream", "evals") == []
    assert await listed("--max-reward", "0") == []
    assert len(await select_unjudged(client, names, Query(limit=1))) == 1
