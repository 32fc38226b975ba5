"""The learner actor under torchrun: 2 gloo ranks, rank 0 reads the groups from Redis and
broadcasts them, both ranks step, only rank 0 writes and publishes; the weights it
publishes equal those of the single-process learner on the same groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio
from safetensors.torch import load_file

from streamrl.actors.learner import serve
from streamrl.config.schema import load_config
from streamrl.protocol import names as N
from streamrl.protocol.messages import WeightsPublished
from streamrl.protocol.names import Names
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.messages import make_trajectory
from tests.torchrun import learner_ranks

ROOT = Path(__file__).resolve().parents[2]


def _groups() -> list[bytes]:
    return [
        encode(make_trajectory([1, 2, 3], [[5, 6, 7], [8], [9, 10]], [[-3.0] * 3, [-2.0],
                               [-4.0, -1.0]], [1.0, 0.0, 0.5]))
        for _ in range(4)
    ]  # fmt: skip


def _overrides(run: str, redis_url: str, work: Path) -> list[str]:
    return [
        f"run.name={run}", f"run.redis_url={redis_url}", f"run.work_dir={work}",
        "auth.enabled=false", "model.spec=tiny", "learner.groups_per_step=2",
        "learner.max_steps=2", "learner.lr=1e-3", "learner.micro_batch_size=1",
        "queues.block_ms=100",
    ]  # fmt: skip


@pytest.mark.system
async def test_two_rank_learner_publishes_what_one_process_would(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    groups = _groups()
    # Given the same four groups in two runs
    solo, multi = Names(names.run + "s"), Names(names.run + "m")
    for run in (solo, multi):
        await Producer(client, run).publish(N.TRAJECTORIES, groups)
    # When one run's learner is a single process, the other's two torchrun ranks
    solo_cfg = load_config(None, _overrides(solo.run, redis_url, tmp_path / "solo"))
    with trio.fail_after(120):
        await serve(ActorContext(solo_cfg, client, solo))
    await learner_ranks(_overrides(multi.run, redis_url, tmp_path / "multi"), deadline_s=180)
    # Then the two-rank run published versions 1 and 2 (rank 0 only: once each)
    rows = await client.call(client.sync.xrange, multi.stream(N.WEIGHTS))
    assert [decode(f[b"d"], WeightsPublished).version for _, f in rows] == [1, 2]
    # and its weights equal the single process's within float tolerance
    a = load_file(tmp_path / "solo" / "weights" / "v000002" / "model.safetensors")
    b = load_file(tmp_path / "multi" / "weights" / "v000002" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
