"""A ``WeightsPublished`` event is a claim (``protocol/versions.py``): one whose version is far
ahead of the run's chain of versions is refused by the scheduler and the generators, and a
generator that cannot load the weights an event names keeps serving the ones it has and
loads the next event's. Before: a well-formed event naming a path that does not exist made
both generators crash-loop (``FileNotFoundError: no .safetensors file``) and the scheduler's
version became 10^6. Real Redis (the events written as the learner's ACL user), the real
scheduler and the real transformers engine with the tiny model."""

from __future__ import annotations

from pathlib import Path

import structlog
import trio

from streamrl.actors.generator import serve_weight_updates
from streamrl.actors.scheduler import Scheduler
from streamrl.inference.transformers_engine import open_transformers_engine
from streamrl.models import resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import WeightsPublished
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.operations import read_counter
from streamrl.queues.streams import Producer, ensure_group
from streamrl.runtime.context import ActorContext
from streamrl.testing.wait import wait_until
from tests.helpers import run_config

FAR = 10**6


async def _announce(learner: RedisClient, names: N.Names, version: int, path: str) -> None:
    event = WeightsPublished(id=f"w{version}", created_at=0.0, policy_version=version,
                             version=version, path=path)
    await Producer(learner, names).publish(N.WEIGHTS, [encode(event)])


async def test_a_generator_keeps_its_weights_when_an_event_names_none(
    names: N.Names, roles: dict[str, RedisClient], redis_url: str, tmp_path: Path,
) -> None:
    # Given a generator serving version 1 (the tiny model's own weights, as published)
    model_dir = resolve_model("tiny")
    config = run_config(tmp_path, redis_url, names.run, "model.spec=tiny",
                        "queues.block_ms=100")
    ctx = ActorContext(config, roles["generator"], names)
    learner = roles["learner"]
    await _announce(learner, names, 1, str(model_dir))
    async with (open_transformers_engine(model_dir, max_batch=1, threads=1) as engine,
                trio.open_nursery() as nursery):
        with structlog.testing.capture_logs() as logs:
            await nursery.start(serve_weight_updates, ctx, engine)
            assert engine.weight_version == 1

            # When the learner's stream announces version 2 at a path with no weights, and
            # version 10^6 (the weights of version 1), then the real version 2
            await _announce(learner, names, 2, str(tmp_path / "no-such-weights"))
            await _announce(learner, names, FAR, str(model_dir))
            await _announce(learner, names, 2, str(model_dir))

            # Then it kept serving version 1 until the real version 2, which it loaded
            await wait_until(lambda: engine.weight_version == 2, 60)
        nursery.cancel_scope.cancel()
    events = [(e["event"], e.get("policy_version", e.get("version"))) for e in logs]
    assert ("weights not loaded: keeping the weights served", 2) in events
    assert ("weights event refused: not the next version", FAR) in events
    assert engine.weight_version == 2


async def test_the_scheduler_refuses_a_version_far_ahead(
    client: RedisClient, names: N.Names, roles: dict[str, RedisClient], redis_url: str,
    tmp_path: Path,
) -> None:
    # Given a synchronous run (one group per step, staleness 0) at version 1, with a forged
    # version 10^6 on top of the weights stream
    config = run_config(tmp_path, redis_url, names.run, "learner.groups_per_step=1",
                        "learner.max_staleness=0", "scheduler.max_backlog=20",
                        "scheduler.eval_every=0", "queues.block_ms=100")
    learner = roles["learner"]
    await ensure_group(client, names.stream(N.TASKS), "generator")
    await _announce(learner, names, 1, "/w/v1")
    await _announce(learner, names, FAR, "/w/far")
    scheduler = Scheduler(ActorContext(config, roles["scheduler"], names))

    async def admitted() -> int:
        return await read_counter(client, names.admitted)

    async with trio.open_nursery() as nursery:
        # When the scheduler starts, and then the learner announces version 2
        await nursery.start(scheduler.serve)
        await wait_until(lambda: _at_least(admitted, 2), 30)
        await _announce(learner, names, FAR + 1, "/w/far")
        await _announce(learner, names, 2, "/w/v2")
        await wait_until(lambda: _at_least(admitted, 3), 30)
        nursery.cancel_scope.cancel()

    # Then it admitted by versions 1 and 2 only: (V + 1) groups, not 20
    assert await admitted() == 3


async def _at_least(count: object, n: int) -> bool:
    return await count() >= n  # type: ignore[operator]
