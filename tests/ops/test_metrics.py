"""Prometheus metrics: real actors (verifier, archiver, learner with the tiny model,
scheduler) recording into the process's registry, served on /metrics and scraped over HTTP."""

from __future__ import annotations

import contextlib
import itertools
import socket
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

import streamrl.domains.arith.domain  # noqa: F401  (registers the arith domain)
from streamrl.actors import archiver
from streamrl.actors.learner import serve as serve_learner
from streamrl.actors.scheduler import Scheduler
from streamrl.actors.verifier import serve
from streamrl.cli.up import _children
from streamrl.learner.weights import save_weights
from streamrl.models import load_model, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import StepMetrics, Task, Trajectory, new_id, now
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer, ensure_group
from streamrl.runtime.context import ActorContext
from streamrl.runtime.metrics import start_metrics_server
from streamrl.testing.messages import make_trajectory
from streamrl.testing.wait import wait_until
from tests.ops.helpers import config, executed

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture
def port() -> Iterator[int]:
    """A /metrics endpoint of this process's registry, on a free loopback port."""
    server = start_metrics_server(-1)
    yield server.server_port
    server.shutdown()


def _scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_actor_metrics_are_scraped_from_a_real_endpoint(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    server = start_metrics_server(0)
    port = server.server_port
    run = names.run
    try:
        # Given two good groups (rewards 1,0 and 1,1), an eval group, and a malformed entry
        producer = Producer(client, names)
        await producer.publish(N.EXECUTED, [
            encode(executed("7", ["7", "8"])),
            encode(executed("7", ["7", "7"])),
            encode(executed("3", ["3", "4", "5", "6"], split="eval")),
            b"not msgpack",
        ])
        ctx = ActorContext(config(tmp_path, redis_url, run), client, names)

        stage = (("run", run), ("stage", "verifier"))
        handled = ("streamrl_handled_total", stage)
        dead = ("streamrl_dead_letters_total", (("reason", "malformed message"), *stage))

        # When the verifier handles them
        async with trio.open_nursery() as nursery:
            await nursery.start(serve, ctx)
            # every entry settled (the counters move just after the hand-off)
            await wait_until(
                lambda: (s := _scrape(port)).get(handled, 0) + s.get(dead, 0) >= 4, timeout=20
            )
            nursery.cancel_scope.cancel()
        # ... and the learner announces a step, which the archiver process records
        await producer.publish(N.METRICS, [encode(StepMetrics(
            id=new_id(), created_at=now(), policy_version=1, step=1, loss=0.1, grad_norm=1.0,
            reward_mean=0.5, groups=2, samples=4, tokens=12, dropped_stale=0,
            max_staleness_seen=1, step_seconds=3.0, wait_seconds=1.0,
        ))])
        busy = ("streamrl_learner_busy_fraction", (("run", run),))
        observer = ActorContext(
            config(tmp_path, redis_url, run, "ops.metrics_port=1"), client, names
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(archiver.serve, observer)
            await wait_until(lambda: busy in _scrape(port), 20)
            nursery.cancel_scope.cancel()

        # Then the endpoint shows exactly what happened
        m = _scrape(port)
        assert m[handled] == 3
        assert m[("streamrl_handle_seconds_count", stage)] == 3
        assert m[dead] == 1
        assert await client.call(client.sync.xlen, names.stream(N.TRAJECTORIES)) == 2
        train = (("domain", "arith"), ("run", run), ("split", "train"))
        evals = (("domain", "arith"), ("run", run), ("split", "eval"))
        assert m[("streamrl_reward_count", train)] == 4
        assert m[("streamrl_reward_sum", train)] == 3.0
        assert m[("streamrl_group_reward", evals)] == 0.25
        assert m[("streamrl_learner_busy_fraction", (("run", run),))] == 0.75
        assert m[("streamrl_staleness_versions_count", (("run", run),))] == 1
        # queue gauges of every work stream: the verifier's input is drained, the learner's
        # holds the two groups, the monitor's the evaluation result
        lag = {s: m[("streamrl_queue_lag", (("run", run), ("stream", s)))]
               for s in (N.EXECUTED, N.TRAJECTORIES, N.EVALS)}
        assert lag == {N.EXECUTED: 0, N.TRAJECTORIES: 2, N.EVALS: 1}
    finally:
        server.shutdown()


def _group(domain: str, version: int, rewards: list[float]) -> bytes:
    """A tiny-model group of ``domain`` sampled by policy ``version``."""
    n = len(rewards)
    traj = make_trajectory(
        [1, 2, 3], [[5, 6, 7]] * n, [[-1.0, -1.0, -1.0]] * n, rewards, weight_versions=version
    )
    task = msgspec.structs.replace(traj.rollout.task, domain=domain)
    rollout = msgspec.structs.replace(traj.rollout, task=task)
    return encode(msgspec.structs.replace(traj, rollout=rollout))


def _by_domain(m: Samples, name: str, run: str) -> dict[str, float]:
    return {
        dict(labels)["domain"]: value
        for (n, labels), value in m.items()
        if n == name and dict(labels).get("run") == run
    }


async def test_learner_process_metrics_after_a_real_step(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path, port: int
) -> None:
    # Given a learner resuming at policy version 2 (weights v2 of the tiny model on disk)
    base = resolve_model("tiny")
    await trio.to_thread.run_sync(save_weights, load_model(base), base, tmp_path / "weights", 2, 2)
    cfg = config(
        tmp_path, redis_url, names.run, "learner.groups_per_step=3", "learner.max_staleness=1",
        "learner.max_steps=3", "learner.lr=1e-4",
    )
    # and four groups: one sampled by v0 (2 versions old: dropped), three trainable, one and
    # zero versions old, of two domains
    groups = [
        _group("arith", 0, [1.0, 0.0]),
        _group("arith", 1, [1.0, 0.0]),
        _group("math", 2, [0.0, 1.0, 1.0]),
        _group("arith", 2, [0.0, 1.0]),
    ]
    # admitted, as the scheduler records them (a stale drop counts in `dropped_stale` only
    # for a group its hand-off takes out of the admission record)
    admitted = [decode(g, Trajectory).episode_id for g in groups]
    await client.call(client.sync.sadd, names.admitted_groups, *admitted)
    await Producer(client, names).publish(N.TRAJECTORIES, groups)

    # When the learner takes its one step (v2 -> v3) and stops
    with trio.fail_after(120):
        await serve_learner(ActorContext(cfg, client, names))

    # Then its endpoint shows that step, as published in the metrics stream
    [(_, fields)] = await client.call(client.sync.xrange, names.stream(N.METRICS))
    step = decode(fields[b"d"], StepMetrics)
    assert (step.step, step.groups, step.dropped_stale, step.max_staleness_seen) == (3, 3, 1, 1)
    m = _scrape(port)
    run = (("run", names.run),)
    assert m[("streamrl_learner_steps_total", run)] == 1
    assert m[("streamrl_policy_version", run)] == 3
    assert m[("streamrl_learner_step_latency_seconds_count", run)] == 1
    assert m[("streamrl_learner_step_latency_seconds_sum", run)] == step.step_seconds
    assert m[("streamrl_learner_busy_fraction", run)] == step.step_seconds / (
        step.step_seconds + step.wait_seconds
    )
    assert 0 < m[("streamrl_learner_busy_fraction", run)] <= 1
    assert m[("streamrl_learner_wait_seconds_total", run)] == step.wait_seconds
    assert m[("streamrl_learner_loss", run)] == step.loss
    assert m[("streamrl_learner_grad_norm", run)] == step.grad_norm
    assert {("ref", "streamrl_learner_kl"), ("old", "streamrl_learner_kl")} <= {
        (dict(labels).get("to"), n) for n, labels in m if dict(labels).get("run") == names.run
    }
    # staleness of each trained group: 1, 0, 0 versions (the per-step max: 1)
    assert m[("streamrl_trained_staleness_versions_count", run)] == 3
    assert m[("streamrl_trained_staleness_versions_sum", run)] == 1
    assert m[("streamrl_trained_staleness_versions_bucket", (("le", "0.0"), *run))] == 2
    assert m[("streamrl_staleness_versions_count", run)] == 1
    assert m[("streamrl_staleness_versions_sum", run)] == 1
    assert m[("streamrl_learner_dropped_stale_total", run)] == 1
    assert m[("streamrl_learner_dropped_stale_total", run)] == int(
        await client.call(client.sync.get, names.counter("dropped_stale"))
    )
    # trained groups, samples and rewards per domain (not the dropped group's)
    assert _by_domain(m, "streamrl_learner_groups_total", names.run) == {"arith": 2, "math": 1}
    assert _by_domain(m, "streamrl_learner_samples_total", names.run) == {"arith": 4, "math": 3}
    assert _by_domain(m, "streamrl_learner_reward_sum", names.run) == {"arith": 2, "math": 2}
    assert _by_domain(m, "streamrl_learner_reward_count", names.run) == {"arith": 4, "math": 3}


async def test_scheduler_process_metrics_match_its_admissions(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path, port: int
) -> None:
    # Given a scheduler over two domains, at most 5 training groups per run (the bound that
    # holds: staleness and backlog are far away)
    cfg = config(
        tmp_path, redis_url, names.run, 'scheduler.domains=["arith", "math"]',
        "scheduler.max_train_groups=5", "scheduler.max_backlog=100", "scheduler.eval_items=2",
        "learner.max_staleness=100",
    )
    await ensure_group(client, names.stream(N.TASKS), "generator")
    run = (("run", names.run),)

    def blocked(m: Samples) -> dict[str, float]:
        return {
            dict(labels)["reason"]: v for (n, labels), v in m.items()
            if n == "streamrl_admission_blocked" and dict(labels)["run"] == names.run
        }

    async with trio.open_nursery() as nursery:
        await nursery.start(Scheduler(ActorContext(cfg, client, names)).serve)
        # When it admits all it may
        await wait_until(lambda: blocked(_scrape(port)).get("limit") == 1, 20)
        m = _scrape(port)
        # ... and then the run is stopped
        await client.call(client.sync.set, names.stop, 1)
        await wait_until(lambda: blocked(_scrape(port)).get("stopped") == 1, 20)
        nursery.cancel_scope.cancel()

    # Then admitted per domain is what reached the tasks stream, and adds up to the counter
    rows = await client.call(client.sync.xrange, names.stream(N.TASKS))
    tasks = [decode(f[b"d"], Task) for _, f in rows]
    train = Counter(t.domain for t in tasks if t.split == "train")
    admitted = _by_domain(m, "streamrl_admitted_total", names.run)
    assert admitted == dict(train)
    assert sum(admitted.values()) == int(await client.call(client.sync.get, names.admitted)) == 5
    assert m[("streamrl_eval_rounds_total", run)] == 1
    assert m[("streamrl_admission_headroom", run)] == 0
    assert blocked(m) == {"limit": 1, "staleness": 0, "backlog": 0, "stopped": 0, "sft": 0}
    assert blocked(_scrape(port)) == {"limit": 0, "staleness": 0, "backlog": 0, "stopped": 1,
                                     "sft": 0}


def test_up_gives_each_actor_process_its_own_metrics_port(tmp_path: Path) -> None:
    # Given `up` with ops.metrics_port = 9400 (from the command line)
    cfg = config(tmp_path, "", "metrics-up", "ops.metrics_port=9400", "up.executors=2")
    children = _children(cfg, tmp_path / "config.json", {})

    # Then each actor process's own command line ends with a port of its own, which wins
    def port_of(argv: list[str]) -> int:
        return next(int(v) for k, v in itertools.pairwise(argv) if k == "--metrics-port")

    ports = [port_of(c.argv) for c in children]
    assert ports == list(range(9400, 9400 + len(children)))
    assert len(children) >= 5
    # ... and with -1, ports free at start from 9400 up, one each (9400 taken: skipped)
    cfg = config(tmp_path, "", "metrics-up", "ops.metrics_port=-1", "up.executors=2")
    with contextlib.ExitStack() as stack:
        taken = stack.enter_context(socket.socket())
        with contextlib.suppress(OSError):  # else it is taken already
            taken.bind(("127.0.0.1", 9400))
            taken.listen()
        auto = [port_of(c.argv) for c in _children(cfg, tmp_path / "config.json", {})]
    assert len(set(auto)) == len(children)
    assert all(9400 < p < 32768 for p in auto)
