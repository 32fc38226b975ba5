"""The GRPO objective: group-relative advantages and a PPO-clipped, token-level surrogate.

Guarantees:
- :func:`group_advantages` returns exactly zero for a group whose rewards are all equal
  (no signal, no gradient), and never NaN;
- :func:`policy_loss` only ever reads positions where ``mask`` is 1: padding, prompt tokens
  and anything else masked out contribute neither to the loss nor to the statistics;
- the loss is normalised per token over the whole batch (DAPO), so a long completion weighs
  more than a short one, and splitting a batch into micro-batches that share one
  ``normalizer`` gives the same gradient as one big batch.

Notation, per completion token t of sample i (all tensors share one shape, e.g. ``[B, T]``)::

    ratio_t = exp(new_logprob_t - old_logprob_t)          # pi_theta / pi_old
    A_i     = (r_i - mean(r_group)) / (std(r_group) + eps)
    L_t     = -min(ratio_t * A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_i)
    k3_t    = exp(ref_t - new_t) - (ref_t - new_t) - 1      # KL(pi_theta || pi_ref), k3
    loss    = sum_t mask_t * (w_t * L_t + beta * k3_t) / normalizer   # normalizer = sum_t mask_t

``w_t`` is the truncated importance-sampling weight (1 unless ``behaviour_logprobs`` is given);
the KL term is there only when ``ref_logprobs`` is given (``beta`` = ``kl_coef``).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]


def kl_penalty(new_logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of KL(pi_theta || pi_ref) on tokens sampled from pi_theta, with
    ``log_r = ref - new``: k1 ``-log_r`` (unbiased, may be negative), k2 ``log_r**2 / 2``
    (biased, low variance), k3 ``exp(log_r) - log_r - 1`` (unbiased, non-negative)."""
    log_r = ref_logprobs - new_logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return torch.exp(log_r) - log_r - 1.0


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: Aggregation = "token-mean",
    normalizer: float | Tensor | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss over masked tokens.

    - ``token-mean``: ``sum(mask * L) / normalizer`` (default ``mask.sum()``; DAPO);
    - ``seq-mean-token-mean``: each sequence's token mean, summed and divided by
      ``normalizer`` (default ``B``, the sequences; the GRPO paper);
    - ``seq-mean-token-sum-norm``: each sequence's token sum divided by the constant
      ``max_tokens`` (default ``T``), summed over sequences / ``normalizer`` (default ``B``;
      Dr. GRPO: no length bias).

    Pass the step's token (token-mean) or sequence count as ``normalizer`` when this call
    sees one micro-batch of it.
    """
    masked = per_token * mask
    if mode == "token-mean":
        denom = mask.sum() if normalizer is None else normalizer
        return masked.sum() / torch.clamp(torch.as_tensor(denom), min=1.0)
    seqs = float(mask.shape[0]) if normalizer is None else normalizer
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / torch.clamp(mask.sum(-1), min=1.0)
    else:
        per_seq = masked.sum(-1) / float(mask.shape[-1] if max_tokens is None else max_tokens)
    return per_seq.sum() / torch.clamp(torch.as_tensor(seqs), min=1.0)


def group_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """Advantages of one GRPO group: ``(r - mean(r)) / (std(r) + eps)``.

    ``std`` is the sample standard deviation (Bessel-corrected, as in the GRPO paper and
    TRL). A group whose rewards are all equal, including a group of one, has no baseline to
    compare against: its advantages are zeros.
    """
    r = rewards.to(torch.float32)
    if r.numel() < 2 or bool((r == r[0]).all()):
        return torch.zeros_like(r)
    return (r - r.mean()) / (r.std() + eps)


def policy_loss(
    new_logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    tis_cap: float | None = None,
    behaviour_logprobs: Tensor | None = None,
    normalizer: float | Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    aggregation: Aggregation = "token-mean",
    max_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO-clipped surrogate loss (to minimise) and detached statistics.

    Args:
        new_logprobs: log pi_theta(token) under the policy being trained (carries the graph).
        old_logprobs: log pi_old(token), the anchor of the ratio. Today this is the
            behaviour logprob the generator recorded while sampling.
        advantages: the sample's advantage, broadcast to its tokens.
        mask: 1 where a token is trained on, 0 elsewhere (prompt, padding, and the
            observation tokens of a multi-turn episode: only model-produced tokens train).
        clip_eps_low, clip_eps_high: the ratio is clipped to
            ``[1 - clip_eps_low, 1 + clip_eps_high]``; a larger ``clip_eps_high`` is
            DAPO's "clip-higher".
        tis_cap, behaviour_logprobs: hook for truncated importance sampling when the
            ratio's anchor is *not* the sampling policy (e.g. ``old_logprobs`` recomputed
            by the learner while ``behaviour_logprobs`` come from the inference engine).
            Each token is then weighted by ``min(exp(old - behaviour), tis_cap)``,
            detached. Without ``behaviour_logprobs`` the weight is 1 and ``tis_cap`` is
            unused.
        normalizer: the token count to divide by; default ``mask.sum()``. Pass the token
            count of the whole step when this call sees one micro-batch of it.
        ref_logprobs, kl_coef: log pi_ref(token) under a frozen reference model; adds
            ``kl_coef * k3`` per token, the unbiased, always non-negative k3 estimator of
            KL(pi_theta || pi_ref) on tokens sampled from (approximately) pi_theta. Its
            gradient pulls each token's logprob towards the reference's. ``kl_estimator``
            picks k1/k2/k3 (:func:`kl_penalty`).
        aggregation, max_tokens: how per-token losses reduce (:func:`aggregate`);
            ``normalizer`` is then the step's token count (token-mean) or sequence count.

    Returns:
        ``(loss, stats)``; stats are means over the masked tokens of this call:
        ``clip_frac`` (tokens whose clipped term was the active one), ``ratio_mean``,
        ``approx_kl`` (k3 estimator of KL(pi_old || pi_theta):
        ``mean(ratio - 1 - log ratio)``), ``tis_weight_mean``, ``kl_ref`` (mean k3 to the
        reference, 0 without one) and ``tokens``.
    """
    keep = mask.bool()
    mask = mask.to(new_logprobs.dtype)
    # Masked positions may hold anything (padding); zero them before exp() so that they can
    # never turn into inf * 0 = NaN, in the loss or in the gradient.
    log_ratio = torch.where(keep, new_logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)

    if behaviour_logprobs is None:
        weight = torch.ones_like(per_token)
    else:
        weight = torch.exp(torch.where(keep, old_logprobs - behaviour_logprobs, 0.0)).detach()
        if tis_cap is not None:
            weight = torch.clamp(weight, max=tis_cap)
    per_token = per_token * weight
    if ref_logprobs is not None:
        k3 = kl_penalty(
            torch.where(keep, new_logprobs, 0.0), torch.where(keep, ref_logprobs, 0.0), kl_estimator
        )
        per_token = per_token + kl_coef * k3
    else:
        k3 = torch.zeros_like(per_token)

    tokens = mask.sum()
    loss = aggregate(per_token, mask, aggregation, normalizer, max_tokens)

    with torch.no_grad():
        n = torch.clamp(tokens, min=1.0)
        was_clipped = ((ratio > 1.0 + clip_eps_high) & (advantages > 0)) | (
            (ratio < 1.0 - clip_eps_low) & (advantages < 0)
        )
        stats = {
            "clip_frac": float((was_clipped * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "approx_kl": float(((ratio - 1.0 - log_ratio) * mask).sum() / n),
            "tis_weight_mean": float((weight * mask).sum() / n),
            "kl_ref": float((k3 * mask).sum() / n),
            "tokens": float(tokens),
        }
    return loss, stats
