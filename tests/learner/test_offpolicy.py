"""Off-policy corrections and the KL penalty in a real Trainer step on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streamrl.learner.train import TrainConfig, Trainer
from streamrl.models import load_model
from streamrl.protocol.messages import Trajectory
from streamrl.testing.messages import make_trajectory


def _groups(behaviour_logprob: float) -> list[Trajectory]:
    completions = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]
    return [
        make_trajectory(
            [1, 2, 3],
            completions,
            [[behaviour_logprob] * len(c) for c in completions],
            [1.0, 0.0, 0.0, 1.0],
            temperature=0.7,
        )
    ]


def test_truncated_importance_weight_scales_the_step_by_its_cap(tiny_dir: Path) -> None:
    # Given behaviour logprobs far below the learner's own (-50: pi_old / pi_b = e^40 or so),
    # every token's importance weight is truncated to the cap
    groups = _groups(-50.0)
    stats = {}
    for cap in (1.0, 2.0):
        cfg = TrainConfig(recompute_old_logprobs=True, tis_cap=cap, max_grad_norm=1e9)
        stats[cap] = Trainer(load_model(tiny_dir), cfg).step(groups)
    # Then the ratio's anchor is the learner itself (ratio 1, nothing clipped) and the loss
    # and gradient scale with the cap exactly
    for s in stats.values():
        assert s.ratio_mean == pytest.approx(1.0, abs=1e-5)
        assert s.clip_frac == 0.0
    assert stats[2.0].loss == pytest.approx(2 * stats[1.0].loss, rel=1e-5)
    assert stats[2.0].grad_norm == pytest.approx(2 * stats[1.0].grad_norm, rel=1e-4)
    # Without recomputation the same data is clipped against the behaviour logprobs instead
    plain = Trainer(load_model(tiny_dir), TrainConfig(max_grad_norm=1e9)).step(groups)
    assert plain.ratio_mean > 1e6 and plain.clip_frac > 0


def test_kl_to_the_reference_is_zero_at_start_and_grows_as_the_policy_moves(
    tiny_dir: Path,
) -> None:
    groups = _groups(-5.0)
    with_kl = Trainer(load_model(tiny_dir), TrainConfig(lr=1e-2, kl_coef=0.5))
    without = Trainer(load_model(tiny_dir), TrainConfig(lr=1e-2))
    # First step: the policy is the reference, k3 is 0 and so is its gradient
    a, b = with_kl.step(groups), without.step(groups)
    assert a.kl_ref == pytest.approx(0.0, abs=1e-6)
    assert a.loss == pytest.approx(b.loss, rel=1e-5)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    # After a large step the policy has moved away from its frozen reference
    second = with_kl.step(groups)
    assert second.kl_ref > 1e-4
    ref = dict(with_kl.ref_model.named_parameters())
    moved = dict(with_kl.model.named_parameters())
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(ref[name], moved[name])
    assert not ref[name].requires_grad


def test_off_policy_config_is_validated() -> None:
    with pytest.raises(ValueError, match="tis_cap"):
        TrainConfig(tis_cap=0.0)
    with pytest.raises(ValueError, match="kl_coef"):
        TrainConfig(kl_coef=-1.0)
