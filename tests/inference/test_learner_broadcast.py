"""Weight sync in the loop (``learner.weight_sync = "broadcast"``): the real learner actor
sends each version to two real ``serve-model`` processes over a gloo weight-update group,
bucketed, before announcing it; the generator's real weight follower then finds every server
on that version and loads nothing from disk. Disk stays the fallback: a server lost
mid-run makes the learner reload the others from disk, and the run goes on syncing by disk;
a server that cannot join at the start costs nothing but the broadcast."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from structlog.testing import capture_logs

from streamrl.actors import learner as learner_actor
from streamrl.actors.generator import serve_weight_updates
from streamrl.actors.weight_sync import named_tensors
from streamrl.inference.sglang_client import buckets, open_sglang_engine
from streamrl.learner.weights import version_dir
from streamrl.models import load_model
from streamrl.net import free_port
from streamrl.protocol import names as N
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.messages import make_trajectory
from streamrl.testing.wait import wait_until
from tests.helpers import run_config
from tests.inference.conftest import ServeModel, assert_serves

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356]


def _config(tmp_path: Path, redis_url: str, run: str, urls: list[str], steps: int) -> Any:
    return run_config(
        tmp_path, redis_url, run,
        "model.spec=tiny",
        "generator.engine=sglang",
        f"generator.server_urls={urls!r}".replace("'", '"'),
        "learner.weight_sync=broadcast",
        "learner.broadcast_bucket_mb=1",  # the tiny model in several buckets
        "learner.broadcast_timeout_s=10",
        "learner.groups_per_step=1",
        "learner.lr=1e-2",  # each version visibly different
        f"learner.max_steps={steps}",
        "queues.block_ms=50",
    )  # fmt: skip


async def _publish_groups(ctx: ActorContext, n: int) -> None:
    groups = [make_trajectory(PROMPT, [[5, 6, 7], [8]], [[-2.0] * 3, [-3.0]], [1.0, 0.0])
              for _ in range(n)]  # fmt: skip
    await Producer(ctx.client, ctx.names).publish(N.TRAJECTORIES, [encode(g) for g in groups])


async def _info(client: httpx.AsyncClient, url: str) -> tuple[str, dict[str, int]]:
    """(weight_version, weight updates by route) of a serve-model."""
    version = (await client.get(url + "/model_info")).json()["weight_version"]
    state = (await client.get(url + "/server_info")).json()["internal_states"][0]
    return version, state["weight_updates"]


def _context(tmp_path: Path, redis_url: str, client: RedisClient, names: N.Names,
             urls: list[str], steps: int) -> ActorContext:  # fmt: skip
    return ActorContext(_config(tmp_path, redis_url, names.run, urls, steps), client, names)


async def _all_at(http: httpx.AsyncClient, urls: list[str], version: str) -> bool:
    try:
        return [(await _info(http, u))[0] for u in urls] == [version] * len(urls)
    except httpx.HTTPError:
        return False


async def _serves_saved(http: httpx.AsyncClient, url: str, ctx: ActorContext, v: int) -> None:
    """The server serves exactly the weights the learner saved as version ``v``."""
    model = load_model(version_dir(ctx.config.run.path / "weights", v)).eval()
    await assert_serves(http, url, model, PROMPT)


async def test_each_version_is_broadcast_and_the_generators_load_nothing(
    serve_models: Callable[[int], list[ServeModel]], client: RedisClient, names: N.Names,
    redis_url: str, tmp_path: Path, http: httpx.AsyncClient,
) -> None:
    # Given two servers and the learner set to broadcast, the generator's follower running
    servers = serve_models(2)
    urls = [s.url for s in servers]
    ctx = _context(tmp_path, redis_url, client, names, urls, steps=3)
    with trio.fail_after(240), capture_logs() as logs:
        async with open_sglang_engine(urls) as engine, trio.open_nursery() as nursery:
            await nursery.start(serve_weight_updates, ctx, engine)
            # When it trains three steps
            await _publish_groups(ctx, 3)
            await learner_actor.serve(ctx)
            await wait_until(lambda: _all_at(http, urls, "3"), timeout=60)
            nursery.cancel_scope.cancel()
    # Then every server got every version over the group, in several buckets each, and
    # none from disk (the follower found each server on the announced version)
    model = load_model(version_dir(ctx.config.run.path / "weights", 3))
    n_buckets = len(buckets(named_tensors(model), 1 << 20))
    assert n_buckets > 1
    for url in urls:
        version, updates = await _info(http, url)
        assert (version, updates) == ("3", {"disk": 0, "distributed": 3 * n_buckets})
        # And it serves exactly the weights the learner saved as version 3
        await _serves_saved(http, url, ctx, 3)
    sent = [e for e in logs if e["event"] == "weights broadcast"]
    assert [e["policy_version"] for e in sent] == [1, 2, 3]



async def test_a_server_lost_mid_run_falls_back_to_disk(
    serve_models: Callable[[int], list[ServeModel]], client: RedisClient, names: N.Names,
    redis_url: str, tmp_path: Path, http: httpx.AsyncClient,
) -> None:
    # Given two servers in the group, and the generator's follower
    servers = serve_models(2)
    urls = [s.url for s in servers]
    ctx = _context(tmp_path, redis_url, client, names, urls, steps=3)
    with trio.fail_after(240), capture_logs() as logs:
        async with (
            open_sglang_engine(urls, health_interval_s=0.5) as engine,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(serve_weight_updates, ctx, engine)
            learner_done = trio.Event()

            async def learn() -> None:
                await learner_actor.serve(ctx)
                learner_done.set()

            nursery.start_soon(learn)
            # When version 1 went out over the group ...
            await _publish_groups(ctx, 1)
            await wait_until(lambda: _all_at(http, urls, "1"), timeout=60)
            # ... and then one server dies before version 2
            servers[1].kill()
            await _publish_groups(ctx, 2)
            await learner_done.wait()
            # Then the run goes on: the other server serves the last version
            await wait_until(lambda: _all_at(http, urls[:1], "3"), timeout=60)
            nursery.cancel_scope.cancel()
    # having got version 1 over the group, and the later ones from disk (at least versions 2
    # and 3: a reload more when the lost server is noticed late, as in one CI run under load)
    version, updates = await _info(http, urls[0])
    assert version == "3" and updates["disk"] >= 2 and updates["distributed"] >= 1, updates
    await _serves_saved(http, urls[0], ctx, 3)
    events = [e["event"] for e in logs]
    assert "weight broadcast failed: reloading from disk, syncing by disk from now" in events


async def test_a_server_that_cannot_join_costs_only_the_broadcast(
    serve_models: Callable[[int], list[ServeModel]], client: RedisClient, names: N.Names,
    redis_url: str, tmp_path: Path, http: httpx.AsyncClient,
) -> None:
    # Given one live server and one URL nothing listens on
    [server] = serve_models(1)
    urls = [server.url, f"http://127.0.0.1:{free_port()}"]
    ctx = _context(tmp_path, redis_url, client, names, urls, steps=2)
    with trio.fail_after(240), capture_logs() as logs:
        async with open_sglang_engine(urls) as engine, trio.open_nursery() as nursery:
            await nursery.start(serve_weight_updates, ctx, engine)
            # When the learner starts (the group cannot form) and trains
            await _publish_groups(ctx, 2)
            await learner_actor.serve(ctx)
            await wait_until(lambda: _all_at(http, urls[:1], "2"), timeout=60)
            nursery.cancel_scope.cancel()
    # Then it said so and the live server got every version from disk
    assert "weight broadcast unavailable: syncing by disk" in [e["event"] for e in logs]
    version, updates = await _info(http, urls[0])
    assert (version, updates["distributed"]) == ("2", 0) and updates["disk"] >= 1


def test_broadcast_without_servers_is_refused_at_load() -> None:
    from streamrl.config.schema import ConfigError, load_config

    with pytest.raises(ConfigError, match="needs the inference servers' URLs"):
        load_config(None, ["learner.weight_sync=broadcast"])
    with pytest.raises(ConfigError, match="router alone"):
        load_config(None, ["learner.weight_sync=broadcast", "generator.engine=sglang",
                           'generator.router_url="http://127.0.0.1:1"'])
    assert load_config(None, ["learner.weight_sync=broadcast", "up.serve_models=2"])
