"""From Trajectory messages to aligned, padded tensors (staleness: tests/protocol)."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner.batch import build_batch
from streamrl.protocol.messages import Trajectory
from streamrl.queues.codec import decode, encode
from streamrl.testing.messages import make_trajectory

PAD = 2  # SmolLM2's pad token is its EOS token


def test_batch_layout_masks_and_logprob_positions() -> None:
    # Given a group: prompt of 3 tokens, completions of 2 (ending in EOS == PAD) and 1 tokens
    traj = make_trajectory(
        prompt_ids=[10, 11, 12],
        completions=[[20, PAD], [30]],
        logprobs=[[-0.1, -0.2], [-0.3]],
        rewards=[1.0, 0.0],
        temperature=0.7,
    )
    traj = decode(encode(traj), Trajectory)  # exactly what arrives over the wire

    # When
    batch = build_batch([traj], pad_id=PAD)

    # Then the completion's EOS is trained on even though it equals the pad id
    assert batch.input_ids.tolist() == [[10, 11, 12, 20, PAD], [10, 11, 12, 30, PAD]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert batch.lengths.tolist() == [5, 4]
    # column t predicts input_ids[t + 1]: the completion starts at column P - 1 = 2
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert batch.target_ids[batch.loss_mask.bool()].tolist() == [20, PAD, 30]
    assert torch.allclose(batch.old_logprobs, torch.tensor([[0, 0, -0.1, -0.2], [0, 0, -0.3, 0]]))
    # rewards [1, 0]: mean 0.5, sample std sqrt(0.5) -> advantages +-sqrt(0.5)
    a = math.sqrt(0.5)
    assert torch.allclose(batch.advantages, torch.tensor([[0, 0, a, a], [0, 0, -a, 0]]), atol=1e-5)
    assert batch.temperature.tolist() == pytest.approx([0.7, 0.7])


def test_groups_keep_their_own_advantages_and_temperatures() -> None:
    g1 = make_trajectory([1], [[5], [6]], [[-1.0], [-1.0]], [0.0, 1.0], temperature=1.0)
    g2 = make_trajectory([1, 2, 3], [[7, 8, 9]] * 2, [[-1.0] * 3] * 2, [2.0, 2.0],
                         temperature=0.5)  # fmt: skip
    batch = build_batch([g1, g2])
    assert batch.size == 4
    assert batch.temperature.tolist() == [1.0, 1.0, 0.5, 0.5]
    assert batch.rewards.tolist() == [0.0, 1.0, 2.0, 2.0]
    per_sample = (batch.advantages * batch.loss_mask).sum(1) / batch.loss_mask.sum(1)
    assert per_sample[:2].tolist() == pytest.approx([-math.sqrt(0.5), math.sqrt(0.5)], abs=1e-5)
    assert per_sample[2:].tolist() == [0.0, 0.0]  # zero-variance group


def test_micro_batches_trim_padding() -> None:
    short = make_trajectory([1], [[5], [6]], [[-1.0], [-1.0]], [0.0, 1.0])
    long = make_trajectory([1] * 6, [[5, 6, 7]] * 2, [[-1.0] * 3] * 2, [0.0, 1.0])
    mbs = list(build_batch([short, long]).micro_batches(2))
    assert [mb.input_ids.shape[1] for mb in mbs] == [2, 9]
    assert [mb.loss_mask.shape[1] for mb in mbs] == [1, 8]
    assert [mb.loss_mask.sum().item() for mb in mbs] == [2, 6]


def test_malformed_groups_are_rejected() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        build_batch([make_trajectory([1], [[5, 6]], [[-1.0]], [1.0])])
    with pytest.raises(ValueError, match="rewards"):
        build_batch([make_trajectory([1], [[5]], [[-1.0]], [1.0, 0.0])])
    with pytest.raises(ValueError, match="temperature"):
        build_batch([make_trajectory([1], [[5]], [[-1.0]], [1.0], temperature=0.0)])
    with pytest.raises(ValueError, match="prompt"):
        build_batch([make_trajectory([], [[5]], [[-1.0]], [1.0])])
