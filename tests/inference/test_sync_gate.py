"""The generator's version gate: a task admitted at policy version V waits for V. In
synchronous mode it is never generated on older weights (real Redis weights stream, real
in-process engine); in async mode it waits a short while, then goes ahead."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from streamrl.actors.generator import Generator, VersionGate, serve_weight_updates
from streamrl.actors.scheduler import make_task
from streamrl.config.schema import load_config
from streamrl.domains.registry import get_domain
from streamrl.inference.transformers_engine import open_transformers_engine
from streamrl.models import load_tokenizer
from streamrl.protocol import names as N
from streamrl.protocol.messages import Rollout, Sampling, WeightsPublished, new_id, now
from streamrl.protocol.names import Names
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import FIELD
from streamrl.runtime.context import ActorContext
from streamrl.runtime.policies import Unavailable
from streamrl.testing.wait import wait_until
from tests.inference.test_weight_sync import publish_perturbed


async def test_task_waits_for_the_version_it_was_admitted_for(
    redis_url: str, names: Names, tiny_dir: Path, tmp_path: Path
) -> None:
    config = load_config(None, [f'run.name="{names.run}"', f'run.redis_url="{redis_url}"',
                                "learner.max_staleness=0", "queues.block_ms=100"])
    client = RedisClient(redis_url)
    ctx = ActorContext(config, client, names)
    item = get_domain("arith").load_items("train")[0]
    sampling = Sampling(max_new_tokens=4, temperature=1.0)
    # Given a task admitted at version 1 while the generator still serves version 0
    task = make_task("arith", item, split="train", group_size=2, sampling=sampling, version=1)
    gate = VersionGate(timeout_s=60)
    rollouts: list[Rollout] = []
    try:
        async with open_transformers_engine(tiny_dir) as engine, trio.open_nursery() as nursery:
            await nursery.start(serve_weight_updates, ctx, engine, gate)
            generator = Generator(engine, load_tokenizer(tiny_dir))
            generator.gate = gate

            async def handle() -> None:
                [out] = await generator.handle(task)
                assert isinstance(out.message, Rollout)
                rollouts.append(out.message)

            nursery.start_soon(handle)
            # When no version 1 is published, nothing is generated
            await trio.sleep(1.0)
            assert not rollouts and engine.statistics().rows == 0
            # When the learner publishes version 1
            path = await trio.to_thread.run_sync(publish_perturbed, tiny_dir, tmp_path / "w", 1)
            event = WeightsPublished(id=new_id(), created_at=now(), policy_version=1,
                                     version=1, path=str(path))
            await client.call(lambda: client.sync.xadd(names.stream(N.WEIGHTS),
                                                       {FIELD: encode(event)}))
            await wait_until(lambda: rollouts, 30)
            # Then the task was generated on version 1 only, every token of it
            [rollout] = rollouts
            assert rollout.policy_version == 1
            assert {int(v) for s in rollout.samples for v in s.token_versions()} == {1}
            assert all(len(s.versions) == len(s.tokens) for s in rollout.samples)
            nursery.cancel_scope.cancel()
    finally:
        client.close()


async def test_gate_gives_up_with_a_retryable_error(autojump_clock: trio.abc.Clock) -> None:
    gate = VersionGate(timeout_s=0.2)
    gate.advance(3)
    await gate.wait_for(2)  # older versions pass at once
    with pytest.raises(Unavailable, match="v4 not served"):
        await gate.wait_for(4)


@pytest.mark.parametrize("strict", [True, False])
async def test_a_draining_generator_releases_a_waiting_task_at_once(
    autojump_clock: trio.abc.Clock, strict: bool
) -> None:
    # Given a generator serving version 3 and a task waiting for version 4
    shutdown = trio.Event()
    gate = VersionGate(timeout_s=60, soft_timeout_s=5, shutdown=shutdown)
    gate.advance(3)

    async def drain_later() -> None:
        await trio.sleep(1)
        shutdown.set()

    # When the process drains (SIGTERM) while it waits: version 4 may never come, the
    # learner stops first
    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain_later)
        t0 = trio.current_time()
        # Then the task gives up at once, retryably (released for another generator), in
        # both modes: a draining process starts no new generation
        with pytest.raises(Unavailable, match="draining"):
            await gate.wait_for(4, strict=strict)
        assert trio.current_time() - t0 == pytest.approx(1)
    # and a version already served still passes while draining
    await gate.wait_for(3)


async def test_async_mode_waits_a_short_while_then_generates_on_what_is_served(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Given a generator serving version 3 and the async mode's soft wait
    gate = VersionGate(timeout_s=60, soft_timeout_s=5)
    gate.advance(3)

    async def publish_later() -> None:
        await trio.sleep(1)
        gate.advance(4)

    # When a task admitted at version 4 comes in just before that version is loaded
    async with trio.open_nursery() as nursery:
        nursery.start_soon(publish_later)
        t0 = trio.current_time()
        await gate.wait_for(4, strict=False)
        # Then it waited for it (and no longer)
        assert trio.current_time() - t0 == pytest.approx(1)
    # When the version it was admitted at never comes
    t0 = trio.current_time()
    await gate.wait_for(9, strict=False)
    # Then it goes ahead on the weights served after the soft wait, with no error
    assert trio.current_time() - t0 == pytest.approx(5)
    assert gate.version == 4
