"""The SFT objective: the token cross-entropy on hand-computed tensors (its value and its
gradient ``(softmax - onehot) / tokens`` in the logits, masks included), and the trainer's SFT
step on the tiny model: its loss is the model's mean NLL on the trained tokens, the same for
every micro-batching and packing, and under LoRA only the adapters move."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from streamrl.learner.lora import LoraSettings
from streamrl.learner.loss import sft_loss
from streamrl.learner.sft_data import Example, as_trajectory
from streamrl.learner.train import TrainConfig, Trainer
from streamrl.models import load_model
from streamrl.protocol.messages import Trajectory, bytes_to_ids

LN2, LN3 = math.log(2.0), math.log(3.0)


def _hand_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of 3 positions over a vocabulary of 3, their targets and the mask:
    position 0: exp(z) = [1, 2, 1], softmax [1/4, 1/2, 1/4], target 1: NLL ln 2;
    position 1: masked (a tool result's token), target 0;
    position 2: exp(z) = [3, 1, 1], softmax [3/5, 1/5, 1/5], target 2: NLL ln 5."""
    logits = torch.tensor([[[0.0, LN2, 0.0], [5.0, -5.0, 0.0], [LN3, 0.0, 0.0]]],
                          dtype=torch.float64, requires_grad=True)  # fmt: skip
    targets = torch.tensor([[1, 0, 2]])
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=torch.float64)
    return logits, targets, mask


def _logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]


def test_sft_loss_and_its_gradient_on_hand_computed_tensors() -> None:
    # Given two trained positions and a masked one between them
    logits, targets, mask = _hand_case()
    # When the SFT loss is taken (token-mean over the 2 trained tokens) and differentiated
    loss, stats = sft_loss(_logprobs(logits, targets), mask)
    loss.backward()
    # Then it is the mean NLL of the trained tokens: (ln 2 + ln 5) / 2
    assert loss.item() == pytest.approx((LN2 + math.log(5.0)) / 2, abs=1e-12)
    assert stats["tokens"] == 2.0 and stats["ratio_mean"] == 1.0 and stats["clip_frac"] == 0.0
    # and its gradient in the logits is (softmax - onehot) / 2 on trained positions, 0 masked
    want = torch.tensor([[[1 / 8, -1 / 4, 1 / 8], [0.0, 0.0, 0.0], [3 / 10, 1 / 10, -2 / 5]]],
                        dtype=torch.float64)  # fmt: skip
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad, want, rtol=0, atol=1e-12)


def test_sft_loss_split_over_micro_batches_with_the_steps_normaliser_is_the_whole() -> None:
    # Given the hand case as one batch, and its two halves as micro-batches of one step
    logits, targets, mask = _hand_case()
    whole, _ = sft_loss(_logprobs(logits, targets), mask)
    whole.backward()
    assert logits.grad is not None
    grad = logits.grad.clone()
    logits.grad = None
    # When each half divides by the step's trained-token count (2) and their gradients add up
    total = torch.tensor(2.0, dtype=torch.float64)
    parts = [sft_loss(_logprobs(logits[:, cols], targets[:, cols]), mask[:, cols], total)[0]
             for cols in (slice(0, 1), slice(1, 3))]  # fmt: skip
    sum(parts).backward()  # type: ignore[union-attr]
    # Then the loss and the gradient are the whole batch's
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), abs=1e-12)
    torch.testing.assert_close(logits.grad, grad, rtol=0, atol=1e-12)


def test_sft_loss_ignores_what_masked_positions_hold() -> None:
    # Given padding whose logprob is -inf (or NaN) at a masked position
    logprobs = torch.tensor([[-LN2, -math.inf, math.nan]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    # When the loss is taken and differentiated
    loss, _ = sft_loss(logprobs, mask)
    loss.backward()
    # Then only the trained token counts, and the gradient is finite: -1 there, 0 elsewhere
    assert loss.item() == pytest.approx(LN2)
    assert logprobs.grad is not None
    assert logprobs.grad.tolist() == [[-1.0, 0.0, 0.0]]


def test_sft_loss_sequence_mean_weighs_each_sequence_alike() -> None:
    # Given a sequence of one token (NLL 1) and one of three (NLL 2, 3, 4)
    logprobs = torch.tensor([[-1.0, 0.0, 0.0], [-2.0, -3.0, -4.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    # Then seq-mean-token-mean is (1 + 3) / 2, token-mean (1 + 9) / 4
    assert float(sft_loss(logprobs, mask, aggregation="seq-mean-token-mean")[0]) == 2.0
    assert float(sft_loss(logprobs, mask)[0]) == 2.5


def _examples() -> list[Trajectory]:
    """Four examples of 2-7 completion tokens, masks with holes (tool results)."""
    rows = [([1, 2, 3], [5, 6, 7, 8], [1, 1, 0, 1]), ([4, 5], [9, 10], [1, 1]),
            ([1, 2, 3], [11, 12, 13, 14, 15, 16, 17], [1, 1, 0, 0, 0, 1, 1]),
            ([6], [18, 19, 20], [0, 1, 1])]  # fmt: skip
    return [as_trajectory(Example(f"ex{i}", p, t, m), f"sft-test-{i}", 0)
            for i, (p, t, m) in enumerate(rows)]


def _nll(model: Any, examples: list[Trajectory]) -> float:
    """The model's mean NLL per trained token, straight from its logits."""
    total, count = 0.0, 0
    with torch.no_grad():
        for t in examples:
            prompt = bytes_to_ids(t.rollout.prompt_ids).tolist()
            sample = t.rollout.samples[0]
            ids = torch.tensor([prompt + bytes_to_ids(sample.tokens).tolist()])
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            for j, keep in enumerate(sample.mask):
                if keep:
                    pos = len(prompt) - 1 + j
                    total -= float(logp[pos, ids[0, pos + 1]])
                    count += 1
    return total / count


@pytest.mark.usefixtures("restore_threads")
def test_sft_step_loss_is_the_models_mean_nll_on_the_trained_tokens(tiny_dir: Any) -> None:
    # Given the tiny model and four examples
    model = load_model(tiny_dir)
    want = _nll(model, _examples())
    # When the trainer takes an SFT step on them
    trainer = Trainer(model, TrainConfig(lr=1e-3, num_threads=1))
    stats = trainer.step(_examples(), mode="sft")
    # Then its loss is the model's mean NLL over the 11 trained tokens (before the update)
    assert stats.tokens == 11 and not stats.skipped
    assert stats.loss == pytest.approx(want, rel=1e-5)
    assert stats.ratio_mean == 1.0 and stats.mismatch_kl == 0.0 and stats.grad_norm > 0
    # and the update lowered it
    assert _nll(trainer.model, _examples()) < want


@pytest.mark.usefixtures("restore_threads")
def test_sft_step_is_the_same_for_every_micro_batching(tiny_dir: Any) -> None:
    # Given the same step with micro-batches of 1 sample, of 8, and packed
    steps = []
    for fields in ({"micro_batch_size": 1}, {"micro_batch_size": 8},
                   {"max_tokens_per_micro_batch": 12}):
        trainer = Trainer(load_model(tiny_dir), TrainConfig(lr=1e-3, num_threads=1, **fields))
        steps.append(trainer.step(_examples(), mode="sft"))
    # Then the loss and the gradient norm agree (the float summation order differs, so the
    # weights after AdamW's first step, about lr * sign(grad), are not compared here: the
    # two-rank test compares them where the order is the same)
    first, *rest = steps
    for stats in rest:
        assert stats.tokens == first.tokens == 11
        assert stats.loss == pytest.approx(first.loss, rel=1e-6)
        assert stats.grad_norm == pytest.approx(first.grad_norm, rel=1e-5)


@pytest.mark.usefixtures("restore_threads")
def test_sft_step_under_lora_moves_the_adapters_only(tiny_dir: Any) -> None:
    # Given a LoRA trainer
    trainer = Trainer(load_model(tiny_dir), TrainConfig(lr=1e-2, num_threads=1,
                                                        lora=LoraSettings(rank=4)))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    # When it takes two SFT steps
    first = trainer.step(_examples(), mode="sft")
    second = trainer.step(_examples(), mode="sft")
    # Then the loss fell and only adapter weights changed
    assert second.loss < first.loss
    changed = {k for k, v in trainer.model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all("lora_" in k for k in changed)
