"""The Docker backend's fleet controls against a real engine (sandbox/docker.py, "Fleet
controls"): the cap on containers being created at once, the creation rate, the session age
limit and how the executor ends a member for it, the sweeper that reaps what dead executors
leaked while the backend serves, and that no sweep takes a live backend's containers.

Skips (with the reason) without an engine or the image, fails in CI (tests/sandbox/
docker_engine.py); the token bucket and the config checks run everywhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from functools import partial
from types import SimpleNamespace
from typing import Any
from urllib.parse import quote, urlencode

import pytest
import trio
from prometheus_client import REGISTRY

from streamrl.actors.episodes import EpisodeSessions
from streamrl.actors.executor import (
    Executor,
    Sandboxes,
    record_fleet,
    sandboxes_for,
    serve_fleet_metrics,
)
from streamrl.actors.generator import Generator
from streamrl.actors.scheduler import make_task
from streamrl.cli.status import read_fleet, render, snapshot
from streamrl.config.schema import Config, DomainConfig, DomainSandboxConfig, ExecutorConfig
from streamrl.domains.base import SandboxSpec
from streamrl.domains.registry import get_domain
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Executed, Sampling
from streamrl.queues.client import RedisClient
from streamrl.sandbox import ExecRequest, Limits, Sandbox
from streamrl.sandbox.base import SandboxUnavailable, SessionExpired
from streamrl.sandbox.docker import DockerSandbox, TokenBucket, _host, _owner, open_docker_sandbox
from streamrl.testing.wait import wait_until
from tests.actors.test_multiturn import ScriptedEngine
from tests.domains.test_terminal import fence, item_of
from tests.sandbox.docker_engine import IMAGE, engine_get, require_docker

QUICK = Limits(timeout_s=60)

pytestmark = pytest.mark.serial
"""Alone, after the parallel part (make test): these tests count what a backend's sweeps
reap, and any other backend on the engine (another worker's test) reaps leftovers too."""


@pytest.fixture(scope="module")
def docker_image() -> str:
    require_docker("Docker fleet tests")
    return IMAGE


def echo(text: str) -> ExecRequest:
    return ExecRequest(["echo", text], limits=QUICK)


def _exists(name: str) -> bool:
    return engine_get(f"/containers/{quote(name)}/json")[0] == 200


def _created(name: str) -> int:
    """The engine's creation time of container ``name`` (unix seconds)."""
    filters = quote(json.dumps({"name": [f"^/{name}$"]}))
    status, body = engine_get(f"/containers/json?all=1&filters={filters}")
    assert status == 200
    [found] = json.loads(body)
    return int(found["Created"])


def _create_events(instance: str, since: float) -> list[float]:
    """When the engine created each container of backend ``instance`` since ``since``
    (its own event log, seconds), in order."""
    query = urlencode({
        "since": int(since) - 1, "until": int(time.time()) + 1,
        "filters": json.dumps({"type": ["container"], "event": ["create"],
                               "label": [f"streamrl.instance={instance}"]}),
    })
    status, body = engine_get(f"/events?{query}")  # one JSON object a line
    assert status == 200
    return sorted(json.loads(line)["timeNano"] / 1e9 for line in body.splitlines() if line)


@pytest.fixture
def planted() -> Iterator[list[str]]:
    """Names of containers a test plants; removed after it whatever happened."""
    names: list[str] = []
    yield names
    if names:
        subprocess.run(["docker", "rm", "-f", *names], capture_output=True, timeout=60)


def plant(names: list[str], owner: str) -> str:
    """A sleeping container labelled as another executor's sandbox, owned by ``owner``."""
    name = f"streamrl-planted-{len(names)}-{time.monotonic_ns()}"
    names.append(name)
    subprocess.run(
        ["docker", "run", "-d", "--network", "none", "--name", name,
         "--label", "streamrl.sandbox=1", "--label", "streamrl.instance=planted",
         "--label", f"streamrl.owner={owner}", "--entrypoint", "sleep", IMAGE, "300"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return name


# -- creation: how many at once, how fast ------------------------------------------------


async def test_a_burst_of_100_episodes_never_has_more_than_max_starting_creating(
    docker_image: str,
) -> None:
    # Given a small pool, at most 3 containers being created at once, room for all 100
    async with open_docker_sandbox(docker_image, pool_size=2, max_starting=3,
                                   max_containers=110, reap_at_start=False) as box:
        outputs: dict[int, bytes] = {}
        watched: list[int] = []  # `starting` as an observer sees it

        async def episode(i: int) -> None:
            outputs[i] = (await box.run(echo(str(i)))).stdout

        async def watch() -> None:
            while True:
                watched.append(box.statistics().starting)
                await trio.sleep(0.005)

        # When 100 episodes arrive at once
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as episodes:
                for i in range(100):
                    episodes.start_soon(episode, i)
            nursery.cancel_scope.cancel()
        stats = box.statistics()
    # Then every one of them completed, with its own output
    assert outputs == {i: f"{i}\n".encode() for i in range(100)}
    # And never more than 3 containers were being created at once, though 3 were
    assert stats.max_starting_seen == 3, stats
    assert max(watched) <= 3 and 3 in watched
    assert stats.created >= 98


async def test_the_token_bucket_lets_a_burst_through_then_the_rate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    bucket, rate, burst = TokenBucket(rate_per_s=5, burst=3), 5, 3
    times: list[float] = []

    async def take() -> None:
        await bucket.take()
        times.append(trio.current_time())

    async def takes(n: int) -> list[float]:
        times.clear()
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(take)
        return [t - start for t in times]

    # When 13 callers come at once: 3 through at once, then one every 1/5 s
    first = await takes(13)
    assert first == pytest.approx([0, 0, 0] + [k / rate for k in range(1, 11)])
    # And in no span of t seconds more than burst + t * rate
    for i, a in enumerate(first):
        for j in range(i, len(first)):
            assert j - i + 1 <= burst + (first[j] - a) * rate + 1e-9
    # After a quiet spell the burst is back, never more than it
    await trio.sleep(60)
    assert await takes(4) == pytest.approx([0, 0, 0, 1 / rate])
    # And a rate of 0 never waits
    unlimited = TokenBucket(0)
    start = trio.current_time()
    for _ in range(100):
        await unlimited.take()
    assert trio.current_time() == start


async def test_creates_keep_to_the_rate_as_the_engine_sees_them(docker_image: str) -> None:
    n, rate, burst = 12, 4.0, 3
    # Given no pool (every run creates its container) and 4 creates a second, 3 at once
    async with open_docker_sandbox(docker_image, pool_size=0, max_starting=n,
                                   create_rate_per_s=rate, create_burst=burst,
                                   reap_at_start=False) as box:
        since, start = time.time(), time.monotonic()
        # When 12 runs come at once
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(box.run, echo(str(i)))
        took = time.monotonic() - start
        instance = box.instance
    # Then they took at least (12 - 3) / 4 s
    assert took >= (n - burst) / rate, took
    # And the engine's own log shows no span of t seconds with more than burst + t * rate
    # creates (two more for an engine that stalls a moment on a loaded machine; all 12 come
    # within about 1 s without the limit)
    created = _create_events(instance, since)
    assert len(created) == n
    for i, a in enumerate(created):
        for j in range(i, n):
            assert j - i + 1 <= burst + (created[j] - a) * rate + 2, created


# -- sessions past their age -------------------------------------------------------------


async def test_a_session_past_session_max_s_is_refused_and_its_container_removed(
    docker_image: str,
) -> None:
    # (5 s: under load a container's start took more than the 1 s this had, and the "young"
    # session was refused its first call; flake-watch, 1 of 5 runs)
    async with open_docker_sandbox(docker_image, pool_size=0, session_max_s=5.0,
                                   sweep_interval_s=0.3, reap_at_start=False) as box:
        async with box.session(QUICK, label="used") as used, \
                box.session(QUICK, label="abandoned") as abandoned:
            # Given a session that ran a command while young, and one nobody calls again
            assert (await used.run(echo("young"))).stdout == b"young\n"
            names = [used.container_name, abandoned.container_name]
            assert all(name is not None and _exists(name) for name in names)
            # When both are older than session_max_s
            await trio.sleep(5.1)
            # Then every call on the first is refused
            with pytest.raises(SessionExpired, match="session_max_s"):
                await used.run(echo("old"))
            with pytest.raises(SessionExpired):
                await used.put_files({"f": b"x"})
            with pytest.raises(SessionExpired):
                await used.get_files(["f"])
            with pytest.raises(SessionExpired):
                await used.reset()
            # And the sweep removes both containers, the abandoned one's too
            await wait_until(lambda: not any(_exists(str(name)) for name in names), timeout=5)
            assert box.statistics().expired == 2
        # And a session opened now is young
        async with box.session(QUICK) as fresh:
            assert (await fresh.run(echo("new"))).stdout == b"new\n"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model("tiny"))


async def test_the_executor_ends_a_member_whose_session_expired(
    docker_image: str, tokenizer: Any
) -> None:
    item = item_of("count_matching")
    generator = Generator(ScriptedEngine(tokenizer, lambda t, p: fence("echo a >> log.txt")),
                          tokenizer)
    sandboxes = Sandboxes("docker", {"terminal": DomainSandboxConfig(image=docker_image)},
                          pool_size=1, docker={"session_max_s": 2.0, "sweep_interval_s": 0.3,
                                               "reap_at_start": False})
    executor = Executor(sandboxes, EpisodeSessions(sandboxes),
                        {"terminal": DomainConfig(max_turns=4)})
    async with sandboxes.opened():
        try:
            # Given turn 1 of a group of 2 run in Docker sessions
            [r1] = await generator.handle(make_task("terminal", item, split="train",
                                                    group_size=2, sampling=Sampling(), version=0))
            [c1] = await executor.handle(r1.message)  # type: ignore[arg-type]
            assert c1.stream == N.TASKS and len(executor.sessions) == 2
            # When the next turn comes after session_max_s (the episode set no wall clock)
            await trio.sleep(2.2)
            [r2] = await generator.handle(c1.message)  # type: ignore[arg-type]
            [done] = await executor.handle(r2.message)  # type: ignore[arg-type]
            # Then both members ended as expired, no check run, their sessions released
            assert done.stream == N.EXECUTED and isinstance(done.message, Executed)
            episode = done.message.rollout.task.episode
            assert episode is not None and episode.ended == ["expired", "expired"]
            for outcome in done.message.outcomes:
                assert outcome.exit_code is None and "session_max_s" in outcome.stderr
            assert len(executor.sessions) == 0
            # And the executor's metrics count them
            record_fleet(sandboxes, "fleet-test")
            labels = {"run": "fleet-test", "image": docker_image}
            assert REGISTRY.get_sample_value(
                "streamrl_sandbox_fleet_total", {**labels, "event": "expired"}) == 2
            assert REGISTRY.get_sample_value(
                "streamrl_sandbox_containers", {**labels, "state": "starting"}) is not None
        finally:
            await executor.sessions.aclose()


# -- leaks -------------------------------------------------------------------------------


async def test_the_sweeper_reaps_leaked_containers_while_the_backend_serves(
    docker_image: str, planted: list[str]
) -> None:
    # Given a container left by an executor that died (its owner's pid is gone) and one of
    # a live owner that will grow older than leak_age_s
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = plant(planted, f"{_host()}/{dead.pid}/1")
    old = plant(planted, _owner())
    born = _created(old)
    # When a backend serves that sweeps every 0.5 s for containers older than 4 s (not at
    # its start: the periodic sweeper has to find them)
    async with open_docker_sandbox(docker_image, pool_size=0, reap_at_start=False,
                                   sweep_interval_s=0.5, leak_age_s=4.0) as box:
        # Then the orphan is reaped within a few sweeps, the young live one left alone (the
        # orphan by any sweeper of this host: its owner's pid is gone for every backend, and
        # in one CI run another one took it first)
        await wait_until(lambda: not _exists(orphan), timeout=4)
        assert _exists(old) and time.time() - born < 4
        by_this_box = box.statistics().reaped
        # And the live one is reaped once older than leak_age_s, not before: only this box
        # sweeps at that age, and its owner is alive
        await wait_until(lambda: not _exists(old), timeout=4 + 4)
        assert time.time() - born >= 4
        # (the engine's delete returns before the sweeper counts it: wait for the count)
        await wait_until(lambda: box.statistics().reaped >= by_this_box + 1, timeout=2)
        stats = box.statistics()
        assert stats.reaped >= by_this_box + 1 and stats.leaked >= stats.reaped
        assert (await box.run(echo("still serving"))).ok


async def test_a_sweep_never_takes_a_live_backends_containers(docker_image: str) -> None:
    # Given two backends on one engine, each sweeping every second for containers older
    # than 4 s (each retires its own at 2 s: half the age, and 4 - 2 sweep intervals)
    fleet: dict[str, Any] = {"sweep_interval_s": 1.0, "leak_age_s": 4.0, "reap_at_start": False}
    async with open_docker_sandbox(docker_image, pool_size=0, **fleet) as sweeper, \
            open_docker_sandbox(docker_image, pool_size=1, **fleet) as worker:
        # When the worker serves runs for 7 s and holds a session that long
        async with worker.session(QUICK, label="long") as session:
            name = session.container_name
            results = []
            deadline = trio.current_time() + 7
            while trio.current_time() < deadline:
                results.append(await worker.run(echo("x")))
                await trio.sleep(0.2)
            # Then the worker took the session's container away itself before that age
            assert name is not None and not _exists(name)
            with pytest.raises(SandboxUnavailable, match="gone"):
                await session.run(echo("late"))
        stats, swept = worker.statistics(), sweeper.statistics()
    # And every run succeeded in containers it replaced before they were that old
    assert all(r.ok for r in results) and len(results) >= 20
    assert stats.created >= 3
    # And the other backend's sweeps never found one of them left over
    assert swept.leaked == 0 and swept.reaped == 0, swept


# -- config ------------------------------------------------------------------------------


def test_the_fleet_controls_reach_the_docker_backend_from_the_config() -> None:
    opened: list[tuple[str, dict[str, Any]]] = []

    def opener(backend: str, **options: Any) -> Sandbox:
        opened.append((backend, options))
        return DockerSandbox(**options)

    config = Config(executor=ExecutorConfig(
        backend="docker", max_containers=20, max_starting=3, create_rate_per_s=2.5,
        create_burst=5, session_max_s=900, sweep_interval_s=30, leak_age_s=3600))
    fleet = sandboxes_for(config).docker
    assert fleet == {"max_containers": 20, "max_starting": 3, "create_rate_per_s": 2.5,
                     "create_burst": 5, "session_max_s": 900, "sweep_interval_s": 30,
                     "leak_age_s": 3600}
    Sandboxes("docker", opener=opener, pool_size=2, docker=fleet).open_for([get_domain("arith")])
    assert opened == [("docker", {"pool_size": 2, **fleet})]


@pytest.mark.parametrize(("fields", "refused"), [
    ({"session_max_s": 60.0, "time_limit_s": 120.0}, "above executor.time_limit_s"),
    ({"leak_age_s": 100.0, "sweep_interval_s": 60.0}, "at least 4 \\* sweep_interval_s"),
    ({"leak_age_s": 100.0, "sweep_interval_s": 0.0}, "needs sweep_interval_s"),
])
def test_fleet_settings_that_would_reap_live_containers_are_refused(
    fields: dict[str, float], refused: str
) -> None:
    with pytest.raises(ValueError, match=refused):
        ExecutorConfig(**fields)  # type: ignore[arg-type]
    if "time_limit_s" not in fields:  # the backend refuses them too
        with pytest.raises(ValueError, match=refused):
            DockerSandbox(**fields)  # type: ignore[arg-type]


async def test_streamrl_status_shows_each_executors_fleet(
    docker_image: str, planted: list[str], client: RedisClient, names: N.Names
) -> None:
    # Given an executor whose Docker backend reaped a leaked container at its start
    dead = subprocess.Popen(["true"])
    dead.wait()
    plant(planted, f"{_host()}/{dead.pid}/1")
    sandboxes = Sandboxes("docker", pool_size=1)
    async with sandboxes.opened(), trio.open_nursery() as nursery:
        domain = SimpleNamespace(name="fleet_status", sandbox=SandboxSpec(image=docker_image))
        assert (await sandboxes.run(domain, echo("hi"))).ok
        # When it publishes its fleet counts (as its serve loop does every few seconds)
        await nursery.start(partial(serve_fleet_metrics, sandboxes, names.run,
                                    client=client, names=names))
        await wait_until(lambda: read_fleet(client, names), timeout=10)
        nursery.cancel_scope.cancel()
    # Then `streamrl status` shows them, one line per executor and image
    snap = await snapshot(client, names)
    [(key, counts)] = snap.fleet.items()
    assert key.endswith(f"/{os.getpid()}/{docker_image}")
    assert counts["leaked"] >= 1 and counts["reaped"] >= 1 and counts["created"] >= 1
    [line] = [x for x in render(snap).splitlines() if x.startswith("sandboxes ")]
    assert f"reaped {counts['reaped']}, leaked {counts['leaked']}" in line
