"""Prometheus metrics: a real verifier actor serving /metrics, scraped over HTTP."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import trio
from prometheus_client.parser import text_string_to_metric_families

import domains.arith.domain  # noqa: F401  (registers the arith domain)
from actors import archiver
from actors.context import ActorContext
from actors.metrics import start_metrics_server
from actors.verifier import serve
from queues import names as N
from queues.client import RedisClient
from queues.messages import StepMetrics, encode, new_id, now
from queues.streams import Producer
from tests.ops.helpers import config, executed


def _scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
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
            with trio.fail_after(20):
                # every entry settled (the counters move just after the hand-off)
                while _scrape(port).get(handled, 0) + _scrape(port).get(dead, 0) < 4:
                    await trio.sleep(0.05)
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
            with trio.fail_after(20):
                while busy not in _scrape(port):
                    await trio.sleep(0.05)
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
