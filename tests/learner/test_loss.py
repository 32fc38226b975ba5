"""The GRPO math on tensors small enough to compute by hand."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner.loss import group_advantages, policy_loss


def test_advantages_are_standardised_with_sample_std() -> None:
    # mean 0.5; sample std sqrt(4 * 0.25 / 3) = sqrt(1/3); 0.5 / sqrt(1/3) = sqrt(3)/2
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    h = math.sqrt(3) / 2
    assert torch.allclose(adv, torch.tensor([h, -h, -h, h]))


def test_advantages_of_a_zero_variance_group_are_exactly_zero() -> None:
    for rewards in ([0.3, 0.3, 0.3], [1.0, 1.0], [0.7]):
        adv = group_advantages(torch.tensor(rewards))
        assert adv.tolist() == [0.0] * len(rewards)


def _case() -> tuple[torch.Tensor, ...]:
    # token:          0 (clipped)  1 (low ratio, A>0)  2 (A<0)  3 (masked, absurd values)
    new = torch.tensor([[math.log(1.5), math.log(0.5), 0.0, 100.0]], requires_grad=True)
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    return new, old, adv, mask


def test_policy_loss_by_hand() -> None:
    new, old, adv, mask = _case()
    loss, stats = policy_loss(new, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)

    # L_t = -min(r A, clip(r, 0.8, 1.2) A):
    #   t0: r=1.5, A=+1 -> -min(1.5, 1.2) = -1.2  (clipped)
    #   t1: r=0.5, A=+1 -> -min(0.5, 0.8) = -0.5
    #   t2: r=1.0, A=-1 -> -min(-1.0, -1.0) = +1.0
    #   t3: masked out
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.0) / 3)
    assert stats["clip_frac"] == pytest.approx(1 / 3)
    assert stats["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.0) / 3)
    k3 = (0.5 - math.log(1.5)) + (-0.5 - math.log(0.5)) + 0.0  # r - 1 - log r
    assert stats["approx_kl"] == pytest.approx(k3 / 3)
    assert stats["tokens"] == 3

    # dL/dnew_t = -A r / 3 where unclipped; 0 where clipped or masked, and never NaN
    loss.backward()
    assert new.grad is not None
    expected = torch.tensor([[0.0, -0.5 / 3, 1.0 / 3, 0.0]])
    assert torch.allclose(new.grad, expected)


def test_clip_higher_and_negative_advantage_clipping() -> None:
    new, old, adv, mask = _case()
    loss, _ = policy_loss(new, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.6)
    # t0 is inside [0.8, 1.6] now: -1.5 instead of -1.2
    assert loss.item() == pytest.approx((-1.5 - 0.5 + 1.0) / 3)

    # r = 0.5 with A = -1: -min(-0.5, -0.8) = 0.8, the clipped branch, no gradient
    new = torch.tensor([[math.log(0.5)]], requires_grad=True)
    loss, stats = policy_loss(new, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1))
    assert loss.item() == pytest.approx(0.8)
    assert stats["clip_frac"] == 1.0
    loss.backward()
    assert new.grad is not None and new.grad.item() == 0.0


def test_token_level_normalisation_splits_into_micro_batches() -> None:
    # Given two samples of 3 and 1 tokens
    new = torch.tensor([[0.1, -0.1, 0.05], [0.02, 0.0, 0.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0] * 3, [-2.0] * 3])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    # When the loss is taken whole, and per sample with the whole batch's token count
    full, _ = policy_loss(new, old, adv, mask)
    parts = [policy_loss(new[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1],
                         normalizer=mask.sum())[0] for i in range(2)]  # fmt: skip
    # Then the parts add up to the whole, and every token weighs the same (not every sample)
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item())
    r = torch.exp(new)
    by_hand = (-(r[0] * 1.0).sum() + 2.0 * torch.clamp(r[1, 0], 0.8, 1.2)) / 4
    assert full.item() == pytest.approx(by_hand.item())


def test_truncated_importance_weight_hook() -> None:
    # old (anchor) = 0, behaviour = log 0.25 -> weight exp(0 - log 0.25) = 4, capped at 2
    new = torch.zeros(1, 2)
    old = torch.zeros(1, 2)
    behaviour = torch.full((1, 2), math.log(0.25))
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    loss, stats = policy_loss(new, old, adv, mask, tis_cap=2.0, behaviour_logprobs=behaviour)
    assert loss.item() == pytest.approx(-2.0)
    assert stats["tis_weight_mean"] == pytest.approx(2.0)
    # without behaviour logprobs the cap is inert
    loss, stats = policy_loss(new, old, adv, mask, tis_cap=2.0)
    assert loss.item() == pytest.approx(-1.0)
    assert stats["tis_weight_mean"] == 1.0


def test_k3_kl_to_the_reference_by_hand() -> None:
    # new = [0, log 0.5], ref = [log 0.5, 0]; zero advantages: only the KL term is left.
    new = torch.tensor([[0.0, math.log(0.5), 7.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.5), 0.0, -9.0]])
    zeros = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, stats = policy_loss(new, zeros, zeros, mask, ref_logprobs=ref, kl_coef=0.1)
    # k3 = exp(ref - new) - (ref - new) - 1:
    #   t0: 0.5 - log 0.5 - 1 = log 2 - 0.5;  t1: 2 - log 2 - 1 = 1 - log 2;  sum = 0.5
    assert stats["kl_ref"] == pytest.approx(0.25)
    assert loss.item() == pytest.approx(0.1 * 0.5 / 2)
    # d k3 / d new = 1 - exp(ref - new): t0 -> 0.5, t1 -> -1; times 0.1 / 2 tokens
    loss.backward()
    assert new.grad is not None
    assert torch.allclose(new.grad, torch.tensor([[0.025, -0.05, 0.0]]))
    # and no reference, no KL
    loss, stats = policy_loss(new, zeros, zeros, mask)
    assert loss.item() == 0.0 and stats["kl_ref"] == 0.0


def _two_seqs() -> tuple[torch.Tensor, torch.Tensor]:
    # sequence 0 has 3 tokens (losses 1, 2, 3), sequence 1 has 1 token (loss 4); T = 4
    x = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    return x, mask


@pytest.mark.parametrize(
    ("mode", "value", "grad"),
    [
        # (1+2+3+4)/4 tokens; each token 1/4
        ("token-mean", 10 / 4, [[0.25, 0.25, 0.25, 0], [0.25, 0, 0, 0]]),
        # (6/3 + 4/1) / 2 seqs; seq 0 tokens 1/6, seq 1 token 1/2
        ("seq-mean-token-mean", 3.0, [[1 / 6, 1 / 6, 1 / 6, 0], [0.5, 0, 0, 0]]),
        # (6/4 + 4/4) / 2 (Dr. GRPO: a constant T = 4); every token 1/8
        ("seq-mean-token-sum-norm", 10 / 8, [[1 / 8, 1 / 8, 1 / 8, 0], [1 / 8, 0, 0, 0]]),
    ],
)
def test_aggregation_by_hand(mode: str, value: float, grad: list[list[float]]) -> None:
    from streamrl.learner.loss import aggregate

    x, mask = _two_seqs()
    out = aggregate(x, mask, mode)  # type: ignore[arg-type]
    out.backward()
    assert out.item() == pytest.approx(value)
    assert x.grad is not None and torch.allclose(x.grad, torch.tensor(grad))


@pytest.mark.parametrize(
    ("estimator", "value", "grad"),
    [
        # log_r = ref - new = -1; k1 = new - ref = 1, d/dnew = 1
        ("k1", 1.0, 1.0),
        # k2 = log_r^2 / 2 = 0.5, d/dnew = -log_r = 1
        ("k2", 0.5, 1.0),
        # k3 = e^-1 + 1 - 1 = e^-1, d/dnew = 1 - e^log_r = 1 - e^-1
        ("k3", math.exp(-1), 1 - math.exp(-1)),
    ],
)
def test_kl_estimators_by_hand(estimator: str, value: float, grad: float) -> None:
    from streamrl.learner.loss import kl_penalty

    new = torch.tensor([0.0], requires_grad=True)
    out = kl_penalty(new, torch.tensor([-1.0]), estimator)  # type: ignore[arg-type]
    out.sum().backward()
    assert out.item() == pytest.approx(value)
    assert new.grad is not None and new.grad.item() == pytest.approx(grad)


def test_default_loss_is_bit_for_bit_the_old_formula() -> None:
    # Given random logprobs with padding, a reference and TIS
    g = torch.Generator().manual_seed(0)
    new = torch.randn(3, 5, generator=g, requires_grad=True)
    old, beh, ref = (torch.randn(3, 5, generator=g) for _ in range(3))
    adv = torch.randn(3, 1, generator=g).expand(3, 5)
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    # When the loss takes its defaults
    loss, _ = policy_loss(new, old, adv, mask, tis_cap=2.0, behaviour_logprobs=beh,
                          normalizer=7.0, ref_logprobs=ref, kl_coef=0.1)  # fmt: skip
    # Then it equals the formula before the loss menu, bit for bit
    keep = mask.bool()
    ratio = torch.exp(torch.where(keep, new - old, 0.0))
    pt = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    pt = pt * torch.clamp(torch.exp(torch.where(keep, old - beh, 0.0)), max=2.0)
    d = torch.where(keep, ref - new, 0.0)
    pt = pt + 0.1 * (torch.exp(d) - d - 1.0)
    expected = (pt * mask).sum() / torch.clamp(torch.as_tensor(7.0), min=1.0)
    assert torch.equal(loss, expected)


def test_advantages_without_std_normalisation_are_centred_rewards() -> None:
    # Dr. GRPO: r - mean(r), no division by the std
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), std_normalize=False)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages(torch.tensor([0.3, 0.3]), std_normalize=False).tolist() == [0.0, 0.0]


def _gspo_case() -> tuple[torch.Tensor, ...]:
    # seq 0: log ratios (log 2, 0), A = +1 -> s = exp(log 2 / 2) = sqrt 2, clipped to 1.2
    # seq 1: log ratios (log 0.9, log 1.1), A = -1 -> s = sqrt(0.99), inside [0.8, 1.2]
    # column 2 of seq 0 is masked and absurd
    new = torch.tensor([[math.log(2), 0.0, 50.0], [math.log(0.9), math.log(1.1), 0.0]],
                       requires_grad=True)  # fmt: skip
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    return new, torch.zeros(2, 3), adv, mask


def test_gspo_clips_the_sequence_ratio_by_hand() -> None:
    new, old, adv, mask = _gspo_case()
    loss, stats = policy_loss(new, old, adv, mask, objective="gspo",
                              aggregation="seq-mean-token-mean")  # fmt: skip
    s1 = math.sqrt(0.99)
    # seq 0: -min(sqrt 2, 1.2) = -1.2 (clipped); seq 1: -min(-s1, -s1) = s1; mean over 2
    assert loss.item() == pytest.approx((-1.2 + s1) / 2)
    assert stats["clip_frac"] == pytest.approx(0.5)  # both tokens of seq 0
    loss.backward()
    # seq 0 is clipped: no gradient; seq 1: d s1 / d new_t = s1 / 2 tokens, times 1/2 seqs
    assert new.grad is not None
    expected = torch.tensor([[0.0, 0.0, 0.0], [s1 / 4, s1 / 4, 0.0]])
    assert torch.allclose(new.grad, expected)


def test_gspo_on_a_packed_row_equals_the_rows() -> None:
    # Given the two sequences of _gspo_case packed into one row, told apart by seq_ids
    new = _gspo_case()[0]
    packed = torch.cat([new[0, :2], new[1, :2]])[None].detach().requires_grad_(True)
    seq_ids = torch.tensor([[0, 0, 1, 1]])
    loss, _ = policy_loss(packed, torch.zeros(1, 4), torch.tensor([[1.0, 1.0, -1.0, -1.0]]),
                          torch.ones(1, 4), objective="gspo",
                          aggregation="seq-mean-token-mean", seq_ids=seq_ids)  # fmt: skip
    # Then value and gradient are the unpacked ones
    assert loss.item() == pytest.approx((-1.2 + math.sqrt(0.99)) / 2)
    loss.backward()
    assert packed.grad is not None
    s1 = math.sqrt(0.99)
    assert torch.allclose(packed.grad, torch.tensor([[0.0, 0.0, s1 / 4, s1 / 4]]))


def test_cispo_by_hand() -> None:
    new, old, adv, mask = _case()  # r = 1.5, 0.5, 1.0 with A = +1, +1, -1; col 3 masked
    loss, stats = policy_loss(new, old, adv, mask, objective="cispo")
    # w = sg(clip(r, 0.8, 1.2)) = 1.2, 0.8, 1.0; L = -w A logp
    by_hand = (-1.2 * math.log(1.5) - 0.8 * math.log(0.5) + 1.0 * 0.0) / 3
    assert loss.item() == pytest.approx(by_hand)
    assert stats["clip_frac"] == pytest.approx(2 / 3)  # tokens 0 and 1 outside the range
    loss.backward()
    # dL/dlogp = -w A / 3: every token keeps a gradient, the clipped ones too
    assert new.grad is not None
    assert torch.allclose(new.grad, torch.tensor([[-0.4, -0.8 / 3, 1 / 3, 0.0]]))


@pytest.mark.parametrize(
    ("mode", "level", "weight", "clipped"),
    [
        # token weights exp(old - behaviour) = 4, 1, 0.25 (column 3 masked)
        ("truncate", "token", [4.0, 1.0, 0.25, 1.0], None),
        ("truncate", "token", [2.0, 1.0, 0.25, 0.0], [True, False, False, False]),
        # mask [0.5, 2]: 4 and 0.25 are dropped
        ("mask", "token", [0.0, 1.0, 0.0, 1.0], [True, False, True, False]),
        # sequence = the row: 4 * 1 * 0.25 = 1, inside every bound
        ("mask", "sequence", [1.0, 1.0, 1.0, 1.0], [False] * 4),
    ],
)
def test_importance_weights_by_hand(
    mode: str, level: str, weight: list[float], clipped: list[bool] | None
) -> None:
    from streamrl.learner.loss import importance_weights

    old = torch.zeros(1, 4)
    behaviour = torch.tensor([[math.log(0.25), 0.0, math.log(4.0), 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    cap = None if clipped is None else 2.0
    w, was = importance_weights(old, behaviour, mask, mode, level, cap, low=0.5)  # type: ignore[arg-type]
    assert torch.allclose(w * mask, torch.tensor([weight]) * mask)
    assert was.tolist() == [clipped or [False] * 4]


def test_sequence_level_importance_weights_per_sequence() -> None:
    from streamrl.learner.loss import importance_weights

    # seq 0: log w = (log 2, log 2) -> 4 on both tokens; seq 1: log 0.5 -> 0.5
    old = torch.tensor([[math.log(2), math.log(2)], [math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    w, was = importance_weights(old, torch.zeros(2, 2), mask, "truncate", "sequence", cap=2.0)
    assert torch.allclose(w * mask, torch.tensor([[2.0, 2.0], [0.5, 0.0]]))
    assert was.tolist() == [[True, True], [False, False]]
    w, was = importance_weights(old, torch.zeros(2, 2), mask, "mask", "sequence", 5.0, low=0.6)
    assert torch.allclose(w * mask, torch.tensor([[4.0, 4.0], [0.0, 0.0]]))
    assert was.tolist() == [[False, False], [True, False]]


def test_masked_importance_sampling_in_the_loss_value_and_gradient() -> None:
    # ratio 1 (new = old = 0), A = 1: L_t = -w_t; w = 0 (dropped), 1, 0 (dropped)
    new = torch.zeros(1, 3, requires_grad=True)
    behaviour = torch.tensor([[math.log(0.25), 0.0, math.log(4.0)]])
    loss, stats = policy_loss(new, torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 3),
                              tis_cap=2.0, behaviour_logprobs=behaviour, is_mode="mask",
                              is_low=0.5)  # fmt: skip
    assert loss.item() == pytest.approx(-1 / 3)  # the dropped tokens still count in the mean
    assert stats["is_clip_frac"] == pytest.approx(2 / 3)
    loss.backward()
    assert new.grad is not None
    assert torch.allclose(new.grad, torch.tensor([[0.0, -1 / 3, 0.0]]))


def test_entropy_bonus_value_and_gradient() -> None:
    # zero advantages: the loss is -coef * mean entropy over the masked tokens
    entropy = torch.tensor([[1.0, 3.0, 100.0]], requires_grad=True)
    zeros = torch.zeros(1, 3)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, _ = policy_loss(zeros, zeros, zeros, mask, entropy=entropy, entropy_coef=0.1)
    assert loss.item() == pytest.approx(-0.1 * 4 / 2)
    loss.backward()
    assert entropy.grad is not None
    assert torch.allclose(entropy.grad, torch.tensor([[-0.05, -0.05, 0.0]]))
    # coefficient 0: the entropy is only logged, never in the loss
    loss, _ = policy_loss(zeros, zeros, zeros, mask, entropy=entropy, entropy_coef=0.0)
    assert loss.item() == 0.0


def test_mismatch_by_hand() -> None:
    from streamrl.learner.loss import mismatch

    # trainer/behaviour ratios 2, 1, 0.5 (column 3 masked)
    trainer = torch.tensor([[math.log(2), 0.0, math.log(0.5), 9.0]])
    out = mismatch(trainer, torch.zeros(1, 4), torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    # k3 = r - 1 - log r: (1 - log 2) + 0 + (-0.5 + log 2) = 0.5
    assert out.tolist() == pytest.approx([3.0, 0.5, 3.5, 0.5, 2.0])


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_sequence_aggregation_of_a_packed_row_equals_the_rows(mode: str) -> None:
    from streamrl.learner.loss import aggregate

    x, mask = _two_seqs()
    rows = aggregate(x, mask, mode, max_tokens=4)  # type: ignore[arg-type]
    packed = torch.tensor([[1.0, 2.0, 3.0, 0.0, 4.0]], requires_grad=True)
    out = aggregate(packed, torch.tensor([[1.0, 1.0, 1.0, 0.0, 1.0]]), mode,  # type: ignore[arg-type]
                    max_tokens=4, seq_ids=torch.tensor([[1, 1, 1, 0, 2]]))  # fmt: skip
    rows.backward()
    out.backward()
    assert out.item() == pytest.approx(rows.item())
    assert x.grad is not None and packed.grad is not None
    assert torch.allclose(packed.grad, torch.cat([x.grad[0, :3], torch.zeros(1), x.grad[1, :1]]))
