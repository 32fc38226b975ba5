"""One Trainer step on the real tiny model: consistent logprobs, and it learns."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from streamrl.learner.batch import build_batch
from streamrl.learner.train import TrainConfig, Trainer, token_logprobs
from streamrl.models import load_model, load_tokenizer
from streamrl.protocol.messages import Trajectory
from streamrl.testing.messages import make_trajectory

TEMPERATURE = 0.7


def sample_group(model: Any, prompt_ids: list[int], rewards: list[float]) -> Trajectory:
    """Sample one completion per reward with HF generate, recording behaviour logprobs
    exactly as a generator does: log_softmax(logits / T)[token], no top-k / top-p."""
    completions, logprobs = [], []
    for i in range(len(rewards)):
        torch.manual_seed(100 + i)
        out = model.generate(
            torch.tensor([prompt_ids]),
            do_sample=True,
            temperature=TEMPERATURE,
            top_k=0,
            top_p=1.0,
            max_new_tokens=12,
            min_new_tokens=12,
            output_scores=True,
            return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt_ids) :]
        scores = torch.stack(out.scores, dim=1)[0]  # [C, V] = logits / T
        lps = torch.log_softmax(scores.float(), -1).gather(-1, tokens[:, None]).squeeze(-1)
        completions.append(tokens.tolist())
        logprobs.append(lps.tolist())
    return make_trajectory(prompt_ids, completions, logprobs, rewards, temperature=TEMPERATURE)


@pytest.fixture
def group(tiny_model: Any, tiny_dir: Path) -> Trajectory:
    tok = load_tokenizer(tiny_dir)
    prompt = tok("Write a function that adds two numbers.")["input_ids"]
    tiny_model.eval()
    with torch.no_grad():
        return sample_group(tiny_model, prompt, rewards=[1.0, 0.0, 0.0, 0.0])


def test_new_logprobs_match_the_behaviour_logprobs_on_policy(
    tiny_model: Any, group: Trajectory
) -> None:
    # Given a short group and a long group in one right-padded batch
    short = make_trajectory(
        [1, 2],
        [[3, 4]], [[-1.0, -1.0]], [0.0], temperature=TEMPERATURE,
    )  # fmt: skip
    batch = build_batch([group, short], pad_id=2)
    # When the learner recomputes the logprobs of the sampled tokens
    with torch.no_grad():
        new = token_logprobs(tiny_model, batch)
    # Then they are the generator's, at the generator's temperature, position for position
    mask = batch.loss_mask[:4].bool()
    assert torch.allclose(new[:4][mask], batch.old_logprobs[:4][mask], atol=1e-4)
    assert not torch.allclose(  # sanity: temperature matters
        token_logprobs(tiny_model, batch, temperature=1.0)[:4][mask],
        batch.old_logprobs[:4][mask],
        atol=1e-2,
    )


def test_one_step_raises_the_logprob_of_the_rewarded_sample(
    tiny_model: Any, group: Trajectory
) -> None:
    # Given an on-policy group where only sample 0 was rewarded
    trainer = Trainer(tiny_model, TrainConfig(lr=1e-3, micro_batch_size=2, seed=0))
    batch = build_batch([group], pad_id=trainer.pad_id)
    mask = batch.loss_mask

    def sample_logprobs() -> torch.Tensor:
        with torch.no_grad():
            return (token_logprobs(trainer.model, batch) * mask).sum(1)

    before = sample_logprobs()
    assert torch.allclose(before, (batch.old_logprobs * mask).sum(1), atol=1e-3)

    # When
    stats = trainer.step([group])

    # Then the step saw on-policy data and moved the policy towards sample 0, away from
    # the others, by far more than float noise
    after = sample_logprobs()
    assert stats.step == 1 and not stats.skipped
    assert stats.samples == 4 and stats.tokens == 48 and stats.groups == 1
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-3)
    assert stats.clip_frac == 0.0
    assert stats.grad_norm > 0
    delta = (after - before).tolist()
    assert delta[0] > 0.5, delta
    assert all(d < -0.1 for d in delta[1:]), delta


def test_gradient_does_not_depend_on_micro_batching_or_checkpointing(
    tiny_dir: Path, group: Trajectory
) -> None:
    other = make_trajectory([1, 2, 3], [[7, 8, 9, 10], [11]], [[-5.0] * 4, [-6.0]], [0.0, 1.0],
                            temperature=TEMPERATURE)  # fmt: skip
    configs = [
        TrainConfig(micro_batch_size=6),
        TrainConfig(micro_batch_size=1),
        TrainConfig(micro_batch_size=4, grad_checkpointing=True),
    ]
    stats = [Trainer(load_model(tiny_dir), cfg).step([group, other]) for cfg in configs]
    for s in stats[1:]:
        assert s.loss == pytest.approx(stats[0].loss, rel=1e-4, abs=1e-6)
        assert s.grad_norm == pytest.approx(stats[0].grad_norm, rel=1e-4)
        assert s.tokens == stats[0].tokens == 48 + 5


def test_updates_per_step_are_sequential_updates_on_the_parts_of_the_step(
    tiny_dir: Path, group: Trajectory
) -> None:
    # Given three groups with signal (and one without, dropped before the split)
    other = make_trajectory([1, 2, 3], [[7, 8, 9, 10], [11]], [[-5.0] * 4, [-6.0]], [0.0, 1.0],
                            temperature=TEMPERATURE)  # fmt: skip
    third = make_trajectory([4, 5], [[6, 7], [8, 9, 10]], [[-4.0] * 2, [-3.0] * 3], [1.0, 0.0],
                            temperature=TEMPERATURE)  # fmt: skip
    flat = make_trajectory([1, 2], [[3], [4]], [[-1.0], [-1.0]], [1.0, 1.0])
    cfg = TrainConfig(lr=1e-3, micro_batch_size=3, lr_decay="cosine", lr_decay_steps=4)
    # When one trainer takes one step of 2 updates, and another the same groups as 2 steps
    split = Trainer(load_model(tiny_dir), dataclasses.replace(cfg, updates_per_step=2))
    stats = split.step([group, flat, other, third])
    one = Trainer(load_model(tiny_dir), cfg)
    first = one.step([group, other])  # the first part: the first half, in order
    second = one.step([third])
    # Then the weights, the optimiser's step count and the schedule are the same
    assert stats.step == split.steps == one.steps == 2
    for name, weight in one.model.state_dict().items():
        assert torch.allclose(split.model.state_dict()[name], weight, atol=1e-6), name
    assert stats.lr == first.lr > second.lr  # the schedule counts updates
    # and the step reports both updates: counts summed, means weighted by tokens
    assert (stats.groups, stats.samples, stats.dropped_groups) == (3, 8, 1)
    assert stats.tokens == first.tokens + second.tokens
    assert stats.loss == pytest.approx((first.loss + second.loss) / 2, rel=1e-5)
    assert stats.grad_norm == pytest.approx((first.grad_norm + second.grad_norm) / 2, rel=1e-5)
    w = first.tokens / stats.tokens
    assert stats.ratio_mean == pytest.approx(w * first.ratio_mean + (1 - w) * second.ratio_mean)
    assert stats.mismatch_ratio_max == max(first.mismatch_ratio_max, second.mismatch_ratio_max)
    # and more updates than groups is one update per group
    assert Trainer(load_model(tiny_dir), dataclasses.replace(cfg, updates_per_step=5)).step(
        [group, other]).step == 2  # fmt: skip


def test_recomputed_anchors_of_several_updates_are_taken_before_the_first(
    tiny_dir: Path, group: Trajectory
) -> None:
    other = make_trajectory([1, 2, 3], [[7, 8, 9, 10], [11]], [[-5.0] * 4, [-6.0]], [0.0, 1.0],
                            temperature=TEMPERATURE)  # fmt: skip
    cfg = TrainConfig(lr=1e-3, recompute_old_logprobs=True, tis_cap=None)
    # When a step of one update, and one of two, anchor the ratio to recomputed logprobs
    one = Trainer(load_model(tiny_dir), cfg).step([group, other])
    two = Trainer(load_model(tiny_dir), dataclasses.replace(cfg, updates_per_step=2)).step(
        [group, other])  # fmt: skip
    # Then one update sees a ratio of exactly 1 (pi_old is the policy being trained); with two,
    # the second update's ratio is the moved policy over the one before the step
    assert one.ratio_mean == pytest.approx(1.0, abs=1e-6)
    assert abs(two.ratio_mean - 1.0) > 1e-3


def test_groups_without_signal_are_dropped_and_an_empty_step_is_skipped(
    tiny_model: Any,
) -> None:
    flat = make_trajectory([1, 2], [[3], [4]], [[-1.0], [-1.0]], [1.0, 1.0])
    trainer = Trainer(tiny_model, TrainConfig(lr=1e-2))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    stats = trainer.step([flat, flat])

    assert stats.skipped and stats.step == 0
    assert stats.dropped_groups == 2 and stats.samples == 0
    assert stats.reward_mean == 1.0
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="lr > 0"):
        TrainConfig(lr=0.0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        TrainConfig(micro_batch_size=0)
