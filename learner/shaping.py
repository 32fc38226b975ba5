"""Reward shaping and schedules the step applies around the loss, one small function each.

Guarantees:
- :func:`soft_length_penalty` is 0 for a completion of at most ``max_tokens - cache``
  tokens, falls linearly to -1 over the last ``cache`` tokens before ``max_tokens``, and is
  -1 beyond (DAPO's overlong reward shaping); ``cache`` 0 turns it off (all zeros);
- :func:`sequence_kl` is each sequence's summed per-token KL estimate, the amount KL-in-reward
  subtracts (times its coefficient) from the sample's reward before advantages;
- :func:`lr_factor` is 1 at every step with no warmup and constant decay, so the default
  schedule leaves the learning rate exactly as configured.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from streamrl.learner.loss import KLEstimator, kl_penalty, sequence_sum

LRDecay = Literal["constant", "cosine"]


def soft_length_penalty(lengths: Tensor, max_tokens: Tensor, cache: int) -> Tensor:
    """DAPO's soft overlong punishment per sample: ``lengths`` completion tokens against
    each sample's ``max_tokens`` budget, over the last ``cache`` tokens of it."""
    if cache <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    start = (max_tokens - cache).to(lengths.dtype)
    ramp = (start - lengths).float() / cache  # 0 at start, -1 at max_tokens
    return ramp.clamp(min=-1.0, max=0.0)


def sequence_kl(
    policy_logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    estimator: KLEstimator = "k3",
    seq_ids: Tensor | None = None,
) -> Tensor:
    """``[sequences]``: the sum over each sequence's masked tokens of :func:`kl_penalty`
    (KL(policy || ref) on the policy's samples; pass the behaviour logprobs as the policy)."""
    keep = mask.bool()
    kl = kl_penalty(policy_logprobs.where(keep, 0.0), ref_logprobs.where(keep, 0.0), estimator)
    return sequence_sum(kl, mask.to(kl.dtype), seq_ids)


def lr_factor(
    step: int,
    warmup_steps: int = 0,
    decay: LRDecay = "constant",
    decay_steps: int = 0,
    min_ratio: float = 0.0,
) -> float:
    """The learning rate multiplier of the optimiser step ``step`` (0 for the first one):
    linear warmup ``(step + 1) / warmup_steps`` over the first ``warmup_steps``, then 1
    (``constant``) or a half cosine from 1 to ``min_ratio`` reached at step ``decay_steps``
    (the whole schedule's length, warmup included) and held after it."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    progress = min((step - warmup_steps) / max(decay_steps - warmup_steps, 1), 1.0)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
