"""A micro-batch's shared prefix computed once: the same logprobs, entropy, loss, gradient and
update as the plain forward, and the prefix's forward really taken once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from streamrl.learner.batch import Batch, build_batch
from streamrl.learner.loss import policy_loss
from streamrl.learner.prefix import shared_prefix_length
from streamrl.learner.train import TrainConfig, Trainer, token_logprobs_and_entropy
from streamrl.testing.messages import make_trajectory
from tests.learner.test_logprobs import tiny

PROMPT = [5 + i % 40 for i in range(20)]  # 20 shared tokens: above the default of 16


def group(prompt: list[int], lengths: list[int], rewards: list[float], seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    completions = [torch.randint(1, 97, (n,), generator=g).tolist() for n in lengths]
    logprobs = [[-4.5] * n for n in lengths]  # near the tiny models' own: ratios near 1
    return make_trajectory(prompt, completions, logprobs, rewards, temperature=0.7)


def one_group() -> Batch:
    """One group: 4 completions of 1-7 tokens after a 20-token prompt, right-padded."""
    return build_batch([group(PROMPT, [7, 3, 1, 5], [1.0, 0.0, 0.5, 0.2], seed=1)], pad_id=0)


def counting(model: Any) -> list[int]:
    """Records the sequence length of every forward of ``model.base_model``."""
    widths: list[int] = []
    model.base_model.register_forward_hook(
        lambda _m, _a, kwargs, _out: widths.append(kwargs["input_ids"].shape[1]),
        with_kwargs=True,
    )
    return widths


def test_shared_prefix_length() -> None:
    ids = torch.tensor([[1, 2, 3, 4, 0], [1, 2, 3, 9, 9], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert shared_prefix_length(ids, mask) == 3
    # identical rows: one position is left to compute after the prefix
    assert shared_prefix_length(ids[[2, 2]], mask[[2, 2]]) == 4
    # a masked token ends the prefix even where the ids agree (padding of equal ids)
    assert shared_prefix_length(ids[[0, 0]], mask[[0, 0]]) == 4
    masked = mask.clone()
    masked[1, 1] = 0
    assert shared_prefix_length(ids, masked) == 1
    # one row, or rows that differ at once: nothing shared
    assert shared_prefix_length(ids[:1], mask[:1]) == 0
    assert shared_prefix_length(torch.tensor([[1, 2], [2, 2]]), torch.ones(2, 2)) == 0


@pytest.mark.parametrize("kind", ["llama", "gemma2", "granite", "cohere"])
def test_logprobs_and_entropy_equal_the_plain_forward(kind: str) -> None:
    # Given a tiny model (soft-capped or scaled logits for some kinds) and one group
    model, b = tiny(kind), one_group()
    widths = counting(model)
    with torch.no_grad():
        # When logprobs and entropy are computed plainly, and with the prefix shared
        plain = token_logprobs_and_entropy(model, b, chunk_tokens=4)
        shared = token_logprobs_and_entropy(model, b, chunk_tokens=4, shared_prefix=16)
    # Then they agree on every trained token within 1e-5
    keep = b.loss_mask.bool()
    for got, want in zip(shared, plain, strict=True):
        assert torch.allclose(got[keep], want[keep], atol=1e-5), (got - want).abs().max()
    # and the shared forward ran the prefix once and each row's own tokens after it (gemma2's
    # sliding-window layers keep to the plain forward after the prefix)
    width = b.input_ids.shape[1]
    assert widths[0] == width
    if kind == "gemma2":
        assert widths[1:] in ([20, width], [width])
    else:
        assert widths[1:] == [20, width - 20]


def test_gradient_equals_the_plain_forward() -> None:
    # Given a tiny model and the clipped policy loss of one group, normalised by its tokens
    model, b = tiny("llama"), one_group()
    model.train()
    widths = counting(model)

    def grads(shared: int) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        lp, ent = token_logprobs_and_entropy(model, b, chunk_tokens=5, entropy_grad=True,
                                             shared_prefix=shared)  # fmt: skip
        loss = policy_loss(lp, b.old_logprobs, b.advantages, b.loss_mask,
                           normalizer=float(b.loss_mask.sum()), entropy=ent,
                           entropy_coef=0.01)[0]  # fmt: skip
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        return float(loss.detach()), grads

    # When the gradient is taken plainly and with the prefix shared
    want_loss, want = grads(0)
    got_loss, got = grads(16)
    assert widths[-2:] == [20, b.input_ids.shape[1] - 20]  # (the shared path was taken)
    # Then the loss and every parameter's gradient agree within 1e-5 (relative to its norm)
    assert got_loss == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert float((g - w).norm()) <= 1e-5 * float(w.norm()) + 1e-9, (g - w).norm()


def test_a_step_with_shared_prefixes_equals_the_plain_step() -> None:
    # Given two groups with different 20-token prompts (micro-batches of one group each) and a
    # third whose prompt is too short to share
    groups = [
        group(PROMPT, [7, 3, 1, 5], [1.0, 0.0, 0.5, 0.2], seed=1),
        group([60 + i % 30 for i in range(24)], [4, 6, 2, 2], [0.0, 1.0, 1.0, 0.0], seed=2),
        group([7, 8, 9], [3, 5, 2, 4], [0.3, 0.0, 1.0, 0.1], seed=3),
    ]
    weights, stats = [], []
    for shared in (0, 16):
        model = tiny("llama")
        widths = counting(model)
        trainer = Trainer(model, TrainConfig(lr=1e-3, micro_batch_size=4, shared_prefix=shared))
        # When each takes one applied step
        stats.append(trainer.step(groups))
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
        # (the shared trainer split the first two micro-batches, not the third)
        assert len(widths) == (3 if shared == 0 else 5)
    # Then loss, gradient norm and every updated weight agree
    assert stats[1].loss == pytest.approx(stats[0].loss, rel=1e-5)
    assert stats[1].grad_norm == pytest.approx(stats[0].grad_norm, rel=1e-5)
    assert stats[1].tokens == stats[0].tokens
    for got, want in zip(weights[1], weights[0], strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # (and the step moved them: the comparison is not between unchanged weights)
    assert not torch.allclose(weights[0][0], tiny("llama").model.embed_tokens.weight, atol=1e-5)


def test_grad_checkpointing_keeps_to_the_plain_forward() -> None:
    trainer = Trainer(tiny("llama"), TrainConfig(grad_checkpointing=True))
    assert trainer.shared_prefix == 0
    with pytest.raises(ValueError, match="shared_prefix >= 0"):
        TrainConfig(shared_prefix=-1)
