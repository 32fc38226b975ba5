"""Packing: samples share rows by token budget and get the logprobs and loss they have alone."""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.batch import Batch, build_batch
from streamrl.learner.loss import policy_loss
from streamrl.learner.packing import pack
from streamrl.learner.train import TrainConfig, Trainer, token_logprobs
from streamrl.testing.messages import make_trajectory
from tests.learner.test_logprobs import tiny


def batch() -> Batch:
    groups = [
        # behaviour logprobs near the tiny model's (about -4.5): ratios near 1, none clipped
        make_trajectory([5, 6, 7], [list(range(10, 22)), [30, 31, 32], [33, 34]],
                        [[-4.5] * 12, [-4.4] * 3, [-4.6] * 2], [1.0, 0.0, 0.2],
                        temperature=0.7),
        make_trajectory([8, 9], [[40, 41, 42, 43, 44], [45]], [[-4.5] * 5, [-4.3]],
                        [0.5, 0.0], temperature=0.7),
        make_trajectory([3], [[50, 51, 52]], [[-4.5] * 3], [0.2], temperature=1.3),
    ]  # fmt: skip
    return build_batch(groups, pad_id=0)


def loss_terms(logprobs: torch.Tensor, b: Batch) -> torch.Tensor:
    return policy_loss(logprobs, b.old_logprobs, b.advantages, b.loss_mask,
                       normalizer=float(total(batch())))[0]  # fmt: skip


def total(b: Batch) -> torch.Tensor:
    return b.loss_mask.sum()


def test_packed_rows_respect_the_budget_and_keep_every_token() -> None:
    # Given samples of 15, 6, 5, 7, 3 and 4 tokens (the last at another temperature)
    b = batch()
    # When packed at 16 tokens per micro-batch
    rows = list(pack(b, 16))
    # Then no row is over budget, no trained token is lost, no temperature is mixed
    assert [int(r.lengths[0]) for r in rows] == [15, 11, 10, 4]
    assert sum(float(total(r)) for r in rows) == float(total(b))
    assert [int(r.attention_mask.max()) for r in rows] == [1, 2, 2, 1]
    assert [float(r.temperature[0]) for r in rows] == pytest.approx([0.7, 0.7, 0.7, 1.3])


def test_packed_logprobs_and_loss_equal_the_unpacked() -> None:
    # Given a tiny model and a batch, once right-padded and once packed 16 tokens a row
    model, b = tiny("llama"), batch()
    with torch.no_grad():
        unpacked = token_logprobs(model, b)
        packed = [token_logprobs(model, r) for r in pack(b, 16)]
    # Then every trained token has the same logprob, in the same order
    want = unpacked[b.loss_mask.bool()]
    got = torch.cat([lp[r.loss_mask.bool()] for lp, r in zip(packed, pack(b, 16), strict=True)])
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    # (sanity: attending across samples would change them)
    row = next(r for r in pack(b, 16) if int(r.attention_mask.max()) > 1)
    crossed = Batch(**{**row.__dict__, "attention_mask": (row.attention_mask > 0).long()})
    with torch.no_grad():
        leak = token_logprobs(model, crossed)[row.loss_mask.bool()]
        own = token_logprobs(model, row)[row.loss_mask.bool()]
    assert not torch.allclose(leak, own, atol=1e-3)


def test_a_packed_step_equals_an_unpacked_step() -> None:
    # Given two identical models and one batch
    stats = []
    for cfg in (TrainConfig(micro_batch_size=2), TrainConfig(max_tokens_per_micro_batch=16)):
        trainer = Trainer(tiny("llama"), cfg)
        # When each takes a step without applying it, one unpacked, one packed
        stats.append(trainer.step_batch(batch(), apply=False))
    # Then loss and gradient norm agree within 1e-5 (relative)
    assert stats[1].loss == pytest.approx(stats[0].loss, rel=1e-5)
    assert stats[1].grad_norm == pytest.approx(stats[0].grad_norm, rel=1e-5)
    assert stats[1].tokens == stats[0].tokens
    assert stats[1].entropy == pytest.approx(stats[0].entropy, abs=1e-5)


def test_packed_gradient_equals_the_unpacked() -> None:
    # Given a tiny model, and the loss of a batch normalised by its token count
    model, b = tiny("llama"), batch()
    model.train()

    def grads(micro_batches: list[Batch]) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        for mb in micro_batches:
            loss_terms(token_logprobs(model, mb, chunk_tokens=5), mb).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    # When it is computed right-padded, and packed 16 tokens a row (4 micro-batches)
    want, got = grads([b]), grads(list(pack(b, 16)))
    # Then every parameter's gradient agrees within 1e-5 (relative to its norm)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert float((g - w).norm()) <= 1e-5 * float(w.norm()), (g - w).norm() / w.norm()
