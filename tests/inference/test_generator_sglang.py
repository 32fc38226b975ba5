"""The generator actor on ``generator.engine = "sglang"``: a real Redis, real serve-model
processes. A published weights event reaches every server; rollouts carry the version."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import trio

from streamrl.actors.generator import Generator, open_engine, serve_weight_updates
from streamrl.actors.scheduler import make_task
from streamrl.config.schema import ConfigError, load_config
from streamrl.domains.registry import get_domain
from streamrl.models import load_tokenizer
from streamrl.protocol import names as N
from streamrl.protocol.messages import (
    Rollout,
    Sampling,
    WeightsPublished,
    bytes_to_ids,
    new_id,
    now,
)
from streamrl.protocol.names import Names
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import FIELD
from streamrl.runtime.context import ActorContext
from streamrl.runtime.policies import Unavailable
from streamrl.testing.wait import wait_until
from tests.inference.conftest import ServeModel, free_port
from tests.inference.test_weight_sync import publish_perturbed


def test_config_selects_and_validates_the_engine() -> None:
    cfg = load_config(None, ['generator.engine="sglang"',
                             'generator.server_urls=["http://127.0.0.1:1"]'])
    assert cfg.generator.engine == "sglang"
    with pytest.raises(ConfigError, match="server_urls or router_url"):
        load_config(None, ['generator.engine="sglang"'])
    with pytest.raises(ConfigError, match=r"generator\.engine"):
        load_config(None, ['generator.engine="tgi"'])
    # vLLM without URLs: `up` starts its servers; broadcasting to them is GPU-only
    assert load_config(None, ['generator.engine="vllm"']).generator.engine == "vllm"
    with pytest.raises(ConfigError, match="GPU backends only"):
        load_config(None, ['generator.engine="vllm"', 'learner.weight_sync="broadcast"'])


async def test_published_weights_reach_every_server_and_rollouts(
    serve_models: Callable[[int], list[ServeModel]], redis_url: str, names: Names,
    tiny_dir: Path, tmp_path: Path,
) -> None:
    servers = serve_models(2)
    config = load_config(None, [
        f'run.name="{names.run}"', f'run.redis_url="{redis_url}"', 'generator.engine="sglang"',
        f"generator.server_urls={[s.url for s in servers]!r}".replace("'", '"'),
        "queues.block_ms=100",
    ])
    client = RedisClient(redis_url)
    ctx = ActorContext(config, client, names)
    tokenizer = load_tokenizer(tiny_dir)
    domain = get_domain("arith")
    item = domain.load_items("train")[0]
    task = make_task("arith", item, split="train", group_size=3,
                     sampling=Sampling(max_new_tokens=4, temperature=1.0), version=0)
    try:
        async with open_engine(config.generator, tiny_dir) as engine, \
                trio.open_nursery() as nursery:
            await nursery.start(serve_weight_updates, ctx, engine)
            generator = Generator(engine, tokenizer)
            [out] = await generator.handle(task)
            assert isinstance(out.message, Rollout) and out.message.policy_version == 0
            # When the learner publishes version 1 (the event it writes)
            path = await trio.to_thread.run_sync(publish_perturbed, tiny_dir, tmp_path / "w", 1)
            event = WeightsPublished(id=new_id(), created_at=now(), policy_version=1,
                                     version=1, path=str(path))
            await client.call(lambda: client.sync.xadd(names.stream(N.WEIGHTS),
                                                       {FIELD: encode(event)}))
            # Then every server serves it, and the next rollout was sampled under it
            await wait_until(lambda: engine.weight_version == 1, 30)
            for s in servers:
                assert httpx.get(s.url + "/model_info").json()["weight_version"] == "1"
            [out] = await generator.handle(task)
            rollout = out.message
            assert isinstance(rollout, Rollout) and rollout.policy_version == 1
            assert [s.weight_version for s in rollout.samples] == [1, 1, 1]
            assert bytes_to_ids(rollout.prompt_ids).tolist() == domain.render_prompt(
                item, tokenizer)
            nursery.cancel_scope.cancel()
    finally:
        client.close()


async def test_no_server_up_makes_the_task_unavailable_not_failed(tiny_dir: Path) -> None:
    # Given a generator whose only server is down
    config = load_config(None, ['generator.engine="sglang"', "generator.health_interval_s=60",
                                f'generator.server_urls=["http://127.0.0.1:{free_port()}"]'])
    item = get_domain("arith").load_items("train")[0]
    task = make_task("arith", item, split="train", group_size=2, sampling=Sampling(), version=0)
    async with open_engine(config.generator, tiny_dir) as engine:
        # When it handles a task, then the runtime is told to retry and release it
        with pytest.raises(Unavailable):
            await Generator(engine, load_tokenizer(tiny_dir)).handle(task)
