"""The learner actor under torchrun with ``learner.parallelism = "fsdp"``: 2 gloo ranks, the
model sharded; rank 0 publishes the gathered weights, which equal the single-process
learner's on the same groups; the newest version holds the sharded checkpoint (older ones
are pruned), and a single-process learner resumes from it; a step whose ranks' micro-batches
would take different forwards (the shared prefix on one rank only) finishes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import trio
from safetensors.torch import load_file

from streamrl.actors.learner import open_trainer, serve
from streamrl.config.schema import load_config
from streamrl.learner.fsdp import SHARDED_DIR
from streamrl.protocol import names as N
from streamrl.protocol.messages import WeightsPublished
from streamrl.protocol.names import Names
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer
from streamrl.runtime.context import ActorContext
from streamrl.testing.messages import make_trajectory
from tests.actors.test_learner_torchrun import _groups, _overrides
from tests.torchrun import learner_ranks


@pytest.mark.system
async def test_fsdp_learner_publishes_what_one_process_would_and_resumes(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    groups = _groups()
    # Given the same four groups in two runs
    solo, multi = Names(names.run + "s"), Names(names.run + "f")
    for run in (solo, multi):
        await Producer(client, run).publish(N.TRAJECTORIES, groups)
    # When one run's learner is a single process, the other's two torchrun ranks under FSDP
    solo_cfg = load_config(None, _overrides(solo.run, redis_url, tmp_path / "solo"))
    with trio.fail_after(120):
        await serve(ActorContext(solo_cfg, client, solo))
    overrides = [*_overrides(multi.run, redis_url, tmp_path / "multi"), "learner.parallelism=fsdp"]
    await learner_ranks(overrides, deadline_s=180)
    # Then the FSDP run published versions 1 and 2, once each
    rows = await client.call(client.sync.xrange, multi.stream(N.WEIGHTS))
    assert [decode(f[b"d"], WeightsPublished).version for _, f in rows] == [1, 2]
    # and its gathered weights equal the single process's within float tolerance
    weights = tmp_path / "multi" / "weights"
    a = load_file(tmp_path / "solo" / "weights" / "v000002" / "model.safetensors")
    b = load_file(weights / "v000002" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    # and only the newest version keeps the sharded checkpoint
    assert (weights / "v000002" / SHARDED_DIR).is_dir()
    assert not (weights / "v000001" / SHARDED_DIR).exists()
    # When a single-process learner opens the run
    trainer, version, resumed = open_trainer(load_config(None, overrides))
    # Then it resumes version 2 from the shards: the step count, the weights and AdamW moments
    assert (version, resumed, trainer.steps) == (2, True, 2)
    state = trainer.model.state_dict()
    for name in b:
        torch.testing.assert_close(state[name], b[name], rtol=0, atol=0)
    assert all(s["exp_avg_sq"].abs().sum() > 0 for s in trainer.optimizer.state.values())


@pytest.mark.system
async def test_fsdp_learner_continues_a_run_saved_without_shards(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given a run whose single-process learner saved versions 1 and 2 (trainer_state.pt)
    await Producer(client, names).publish(N.TRAJECTORIES, _groups())
    base = _overrides(names.run, redis_url, tmp_path)
    with trio.fail_after(120):
        await serve(ActorContext(load_config(None, base), client, names))
    before = load_file(tmp_path / "weights" / "v000002" / "model.safetensors")
    # When two FSDP ranks continue it for one more step
    await Producer(client, names).publish(N.TRAJECTORIES, _groups()[:2])
    overrides = [*base, "learner.max_steps=3", "learner.parallelism=fsdp"]
    output = await learner_ranks(overrides, deadline_s=180)
    # Then they start from version 2's weights with a fresh AdamW state (whole AdamW state
    # does not load into shards) and publish version 3 with its shards
    assert "resumed_optimizer" in output
    rows = await client.call(client.sync.xrange, names.stream(N.WEIGHTS))
    assert [decode(f[b"d"], WeightsPublished).version for _, f in rows] == [1, 2, 3]
    after = load_file(tmp_path / "weights" / "v000003" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert (tmp_path / "weights" / "v000003" / SHARDED_DIR).is_dir()


@pytest.mark.system
async def test_fsdp_learner_finishes_a_step_whose_ranks_differ_in_prefix(
    client: RedisClient, names: N.Names, redis_url: str, tmp_path: Path
) -> None:
    # Given one group of 3 samples with a 20-token prompt and micro-batches of 2: rank 0's two
    # rows share the prompt (the shared-prefix forward), rank 1's one row does not
    group = make_trajectory(list(range(100, 120)), [[5, 6, 7], [8, 9], [10, 11, 12, 13]],
                            [[-3.0] * 3, [-2.0] * 2, [-1.0] * 4], [1.0, 0.0, 0.5])  # fmt: skip
    solo, multi = Names(names.run + "s"), Names(names.run + "f")
    for run in (solo, multi):
        await Producer(client, run).publish(N.TRAJECTORIES, [encode(group)])
    settings = ["learner.groups_per_step=1", "learner.max_steps=1", "learner.micro_batch_size=2"]
    solo_cfg = load_config(None, [*_overrides(solo.run, redis_url, tmp_path / "solo"), *settings])
    with trio.fail_after(120):
        await serve(ActorContext(solo_cfg, client, solo))
    # When two FSDP ranks take the step (an overdue step is reported after 20 s)
    overrides = [*_overrides(multi.run, redis_url, tmp_path / "multi"), *settings,
                 "learner.parallelism=fsdp", "learner.step_deadline_s=20"]  # fmt: skip
    await learner_ranks(overrides, deadline_s=180)
    # Then they finish it within the deadline, and publish the single process's weights
    a = load_file(tmp_path / "solo" / "weights" / "v000001" / "model.safetensors")
    b = load_file(tmp_path / "multi" / "weights" / "v000001" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
