"""The loss menu's switches: shaping and schedules by hand, then wired through a real step."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
import torch

from streamrl.learner.batch import build_batch
from streamrl.learner.loss import group_advantages, kl_penalty
from streamrl.learner.shaping import lr_factor, sequence_kl, soft_length_penalty
from streamrl.learner.train import TrainConfig, Trainer, token_logprobs
from streamrl.models import load_model
from streamrl.protocol.messages import Trajectory
from streamrl.testing.messages import make_trajectory


def test_soft_length_penalty_by_hand() -> None:
    # budget 10, last 4 tokens: 0 up to 6 tokens, then -1/4 per token, -1 from 10 on
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    out = soft_length_penalty(lengths, torch.tensor(10), 4)
    assert out.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert soft_length_penalty(lengths, torch.tensor(10), 0).tolist() == [0.0] * 6


@pytest.mark.parametrize(
    ("kwargs", "factors"),
    [
        ({}, [1.0, 1.0, 1.0]),  # the default: lr exactly as configured
        ({"warmup_steps": 4}, [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]),
        # warmup 2, then cosine over steps 2..6 to 0.1: 1, (1 + cos pi/4)/2 scaled, 0.55, ..
        ({"warmup_steps": 2, "decay": "cosine", "decay_steps": 6, "min_ratio": 0.1},
         [0.5, 1.0, 1.0, 0.1 + 0.9 * (1 + math.cos(math.pi / 4)) / 2, 0.55,
          0.1 + 0.9 * (1 + math.cos(3 * math.pi / 4)) / 2, 0.1, 0.1]),
    ],
)  # fmt: skip
def test_lr_schedule_at_given_steps(kwargs: dict[str, object], factors: list[float]) -> None:
    got = [lr_factor(step, **kwargs) for step in range(len(factors))]  # type: ignore[arg-type]
    assert got == pytest.approx(factors)


def test_sequence_kl_sums_each_sequence_by_hand() -> None:
    # k1 = new - ref: seq 0 (1 - 0) + (0 - 2) = -1; seq 1: 3 (column 1 masked)
    new = torch.tensor([[1.0, 0.0], [3.0, 50.0]])
    ref = torch.tensor([[0.0, 2.0], [0.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert sequence_kl(new, ref, mask, "k1").tolist() == [-1.0, 3.0]
    k3 = kl_penalty(new[0], ref[0]).sum()
    assert sequence_kl(new, ref, mask)[0].item() == pytest.approx(k3.item())


def _group(rewards: list[float], completions: list[list[int]]) -> Trajectory:
    lps = [[-1.0] * len(c) for c in completions]
    return make_trajectory([1, 2, 3], completions, lps, rewards, temperature=0.7)


def _with_sample(traj: Trajectory, i: int, **changes: object) -> Trajectory:
    samples = list(traj.rollout.samples)
    samples[i] = msgspec.structs.replace(samples[i], **changes)
    rollout = msgspec.structs.replace(traj.rollout, samples=samples)
    return msgspec.structs.replace(traj, rollout=rollout)


def test_overlong_filter_masks_samples_that_hit_the_token_limit() -> None:
    traj = _with_sample(_group([1.0, 0.0], [[5, 6], [7, 8]]), 1, finish_reason="length")
    plain = build_batch([traj])
    filtered = build_batch([traj], overlong_filter=True)
    assert plain.loss_mask[1].sum() == 2
    assert filtered.loss_mask[1].sum() == 0 and filtered.advantages[1].abs().sum() == 0
    # the finished sample is untouched; its advantage still has the other as baseline
    assert torch.equal(filtered.loss_mask[0], plain.loss_mask[0])
    assert torch.equal(filtered.advantages[0], plain.advantages[0])


def test_length_penalty_shapes_rewards_before_advantages() -> None:
    # budget 4 tokens, penalty over the last 2: 4 tokens -> -1, 2 tokens -> 0
    traj = _group([1.0, 1.0], [[5, 6, 7, 8], [9, 10]])
    task = msgspec.structs.replace(
        traj.rollout.task, sampling=msgspec.structs.replace(traj.rollout.task.sampling,
                                                            max_new_tokens=4))  # fmt: skip
    traj = msgspec.structs.replace(traj, rollout=msgspec.structs.replace(traj.rollout, task=task))
    batch = build_batch([traj], length_penalty_tokens=2)
    assert batch.rewards.tolist() == [0.0, 1.0]
    h = 0.5 / math.sqrt(0.5)  # centred +-0.5 over the sample std sqrt(0.5)
    assert batch.advantages[0].max().item() == 0.0
    assert batch.advantages[0].min().item() == pytest.approx(-h, rel=1e-5)
    assert batch.advantages[1].max().item() == pytest.approx(h, rel=1e-5)
    # no penalty without the switch: equal rewards, no signal
    assert build_batch([traj]).advantages.abs().sum() == 0


def test_advantages_without_std_in_the_batch() -> None:
    batch = build_batch([_group([1.0, 0.0], [[5], [6]])], std_normalize=False)
    assert batch.advantages.sum(-1).tolist() == [0.5, -0.5]


def _groups() -> list[Trajectory]:
    completions = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14]]
    lps = [[-5.0] * len(c) for c in completions]
    return [make_trajectory([1, 2, 3], completions, lps, [1.0, 0.0, 0.0, 1.0], temperature=0.7)]


def test_step_logs_mismatch_lr_and_applies_warmup(tiny_dir: Path) -> None:
    # Given the trainer's own logprobs before the step, against behaviour logprobs of -5
    groups = _groups()
    model = load_model(tiny_dir)
    batch = build_batch(groups)
    with torch.no_grad():
        trainer_lp = token_logprobs(model, batch)
    keep = batch.loss_mask.bool()
    ratio = torch.exp(trainer_lp[keep].double() + 5.0)
    # When one step is taken with a 4-step warmup
    stats = Trainer(model, TrainConfig(lr=1e-3, warmup_steps=4)).step(groups)
    # Then the step ran at lr / 4 and logged the train-vs-rollout mismatch of its tokens
    assert stats.lr == pytest.approx(2.5e-4)
    assert stats.mismatch_ratio_min == pytest.approx(float(ratio.min()), rel=1e-4)
    assert stats.mismatch_ratio_max == pytest.approx(float(ratio.max()), rel=1e-4)
    assert stats.mismatch_ratio_mean == pytest.approx(float(ratio.mean()), rel=1e-4)
    k3 = ratio - 1 - ratio.log()
    assert stats.mismatch_kl == pytest.approx(float(k3.mean()), rel=1e-4)
    assert stats.entropy > 0 and 0 <= stats.clip_frac <= 1


def test_kl_in_reward_equals_training_on_the_shaped_rewards(tiny_dir: Path) -> None:
    # Given behaviour logprobs of -5 and the reference = the model before the step
    groups = _groups()
    batch = build_batch(groups)
    ref = load_model(tiny_dir)
    with torch.no_grad():
        ref_lp = token_logprobs(ref, batch)
    kl = sequence_kl(batch.old_logprobs, ref_lp, batch.loss_mask)  # k3 summed per sample
    shaped = (batch.rewards - 0.5 * kl).tolist()
    # When a trainer subtracts 0.5 * KL from the rewards, and another trains on those rewards
    cfg = TrainConfig(kl_coef=0.5, kl_in_reward=True, max_grad_norm=1e9)
    a = Trainer(load_model(tiny_dir), cfg, ref_model=ref).step(groups)
    shaped_groups = [msgspec.structs.replace(groups[0], rewards=shaped)]
    b = Trainer(load_model(tiny_dir), TrainConfig(max_grad_norm=1e9)).step(shaped_groups)
    # Then they take the same step, and the KL taken out of the rewards is logged
    assert group_advantages(torch.tensor(shaped)).abs().sum() > 0
    assert a.loss == pytest.approx(b.loss, rel=1e-5)
    assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-4)
    assert a.kl_ref == pytest.approx(float(kl.sum() / batch.loss_mask.sum()), rel=1e-5)


@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_sequence_objectives_are_the_same_packed_or_padded(tiny_dir: Path, objective: str) -> None:
    # GSPO's sequence ratio and the per-sequence mean must find each sample in a packed row
    groups = _groups()
    stats = []
    for budget in (0, 64):
        cfg = TrainConfig(objective=objective, aggregation="seq-mean-token-mean",  # type: ignore[arg-type]
                          micro_batch_size=2, max_tokens_per_micro_batch=budget,
                          max_grad_norm=1e9, clip_eps=0.5)  # fmt: skip
        stats.append(Trainer(load_model(tiny_dir), cfg).step(groups))
    padded, packed = stats
    assert packed.loss == pytest.approx(padded.loss, rel=1e-5, abs=1e-6)
    assert packed.grad_norm == pytest.approx(padded.grad_norm, rel=1e-4)
    assert packed.grad_norm > 0


def test_every_switch_reaches_the_trainer_from_toml(tmp_path: Path) -> None:
    from streamrl.actors.learner import train_config
    from streamrl.config.schema import load_config

    # Given a TOML that sets every switch of the loss menu away from its default
    path = tmp_path / "run.toml"
    path.write_text(
        "[learner]\nclip_eps = 0.1\nclip_eps_high = 0.28\nobjective = 'gspo'\n"
        "aggregation = 'seq-mean-token-sum-norm'\naggregation_tokens = 512\n"
        "advantage_std = false\nis_mode = 'mask'\nis_level = 'sequence'\nis_low = 0.5\n"
        "tis_cap = 3.0\nkl_coef = 0.01\nkl_estimator = 'k2'\nkl_in_reward = true\n"
        "entropy_coef = 0.001\noverlong_filter = true\nlength_penalty_tokens = 64\n"
        "warmup_steps = 5\nlr_decay = 'cosine'\nmax_steps = 100\nmin_lr_ratio = 0.1\n"
        "max_grad_norm = 0.5\nmax_tokens_per_micro_batch = 4096\nlogprob_chunk_tokens = 256\n"
        "updates_per_step = 2\n"
    )
    # When the learner builds its TrainConfig
    cfg = train_config(load_config(path))
    # Then each reaches it (lr_decay_steps defaults to max_steps' updates)
    assert (cfg.clip_eps, cfg.clip_eps_high, cfg.objective) == (0.1, 0.28, "gspo")
    assert (cfg.aggregation, cfg.aggregation_tokens) == ("seq-mean-token-sum-norm", 512)
    assert (cfg.advantage_std, cfg.is_mode, cfg.is_level, cfg.is_low) == (
        False, "mask", "sequence", 0.5)  # fmt: skip
    assert (cfg.tis_cap, cfg.kl_coef, cfg.kl_estimator, cfg.kl_in_reward) == (3.0, 0.01, "k2", True)
    assert (cfg.entropy_coef, cfg.overlong_filter, cfg.length_penalty_tokens) == (0.001, True, 64)
    assert (cfg.warmup_steps, cfg.lr_decay, cfg.lr_decay_steps, cfg.min_lr_ratio) == (
        5, "cosine", 200, 0.1)  # fmt: skip
    assert (cfg.max_grad_norm, cfg.updates_per_step) == (0.5, 2)
    assert (cfg.max_tokens_per_micro_batch, cfg.logprob_chunk_tokens) == (4096, 256)
    # and the defaults are today's trainer
    default = train_config(load_config(None))
    assert default.clip_eps_high is None and default.objective == "ppo"
    assert TrainConfig(seed=default.seed, num_threads=1) == default


def test_a_cosine_schedule_needs_a_length() -> None:
    from streamrl.config.schema import LearnerConfig

    with pytest.raises(ValueError, match="lr_decay_steps"):
        LearnerConfig(lr_decay="cosine", warmup_steps=10)
    with pytest.raises(ValueError, match="cosine"):
        TrainConfig(lr_decay="cosine", warmup_steps=10, lr_decay_steps=10)


def test_entropy_bonus_through_a_step(tiny_dir: Path) -> None:
    # Given a group with equal rewards kept in the step: every advantage is 0
    completions = [[5, 6, 7], [9, 10]]
    flat = [make_trajectory([1, 2, 3], completions, [[-5.0] * len(c) for c in completions],
                            [1.0, 1.0], temperature=0.7)]  # fmt: skip
    base = {"drop_zero_advantage": False, "max_grad_norm": 1e9}
    # When the step has an entropy bonus, and when it has none
    bonus = Trainer(load_model(tiny_dir), TrainConfig(entropy_coef=0.1, **base)).step(flat)  # type: ignore[arg-type]
    plain = Trainer(load_model(tiny_dir), TrainConfig(**base)).step(flat)  # type: ignore[arg-type]
    # Then the loss is -coef * mean entropy, with a gradient; without it, no loss, no gradient
    assert bonus.loss == pytest.approx(-0.1 * bonus.entropy, rel=1e-5)
    assert bonus.grad_norm > 0
    assert plain.loss == 0.0 and plain.grad_norm == 0.0 and plain.entropy == bonus.entropy


def test_the_entropy_carries_a_graph_only_for_the_bonus(tiny_model: object) -> None:
    from streamrl.learner.train import token_logprobs_and_entropy

    # A graph through the entropy that the loss does not use is never consumed by the
    # backward pass: every recomputed chunk's [n, V] softmax would stay alive until its end.
    batch = build_batch(_groups())
    lp, ent = token_logprobs_and_entropy(tiny_model, batch, chunk_tokens=4)
    assert lp.requires_grad and not ent.requires_grad
    lp, ent = token_logprobs_and_entropy(tiny_model, batch, chunk_tokens=4, entropy_grad=True)
    assert ent.requires_grad


def test_the_entropy_gradient_of_the_bonus_is_the_unchunked_one() -> None:
    from streamrl.learner.train import token_logprobs_and_entropy
    from tests.learner.test_logprobs import batch, reference, tiny

    # Given a soft-capped model and a batch of two temperatures
    model, b = tiny("gemma2"), batch()
    grads = []
    for chunked in (False, True):
        model.zero_grad(set_to_none=True)
        if chunked:  # 3 tokens at a time, the entropy with its graph
            ent = token_logprobs_and_entropy(model, b, chunk_tokens=3, entropy_grad=True)[1]
        else:
            ent = reference(model, b)[1]
        ent.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    # Then every parameter's entropy gradient is the full-logits one within 1e-5
    assert len(grads[0]) == len(grads[1]) > 0
    for got, want in zip(grads[1], grads[0], strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
