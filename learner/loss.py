"""The GRPO objective: group-relative advantages and the loss menu, one small function each.

Guarantees:
- :func:`group_advantages` returns exactly zero for a group whose rewards are all equal
  (no signal, no gradient), and never NaN;
- :func:`policy_loss` only ever reads positions where ``mask`` is 1: padding, prompt tokens
  and anything else masked out contribute neither to the loss nor to the statistics;
- with its defaults (PPO clip, token-level truncated IS, k3, token-mean) the loss is the one
  before the menu existed, bit for bit (``tests/learner/test_loss.py``);
- the loss is normalised by the ``normalizer`` the caller passes (the step's token or
  sequence count), so splitting a batch into micro-batches that share it gives the same
  gradient as one big batch. Sequence-level terms need whole sequences in one call: a
  micro-batch never splits a sample.

Notation, per completion token t of sample i (all tensors share one shape, e.g. ``[B, T]``)::

    ratio_t = exp(new_logprob_t - old_logprob_t)          # pi_theta / pi_old
    A_i     = (r_i - mean(r_group)) / (std(r_group) + eps)   # Dr. GRPO: no std
    L_t     = -min(ratio_t * A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_i)   # ppo
    L_t     = the same with s_i = exp(mean_{t in i} log ratio_t) for every t of i      # gspo
    L_t     = -sg(clip(ratio_t, 1 - eps_low, 1 + eps_high)) * A_i * new_logprob_t     # cispo
    kl_t    = k1/k2/k3 of KL(pi_theta || pi_ref)
    loss    = aggregate(w_t * L_t + beta * kl_t - entropy_coef * H_t)

``w_t`` is the off-policy correction (:func:`importance_weights`; 1 unless
``behaviour_logprobs`` is given); the KL term is there only when ``ref_logprobs`` is given.

Supervised fine-tuning (:func:`sft_loss`) is the other objective of the same step: the
token cross-entropy ``-log pi_theta(token)`` on the trained tokens (the assistant's), reduced
by the same :func:`aggregate` with the step's normaliser; no ratio, advantage or reference.

Sequences: by default each row is one sequence. A packed row holds several; ``seq_ids``
(``[B, T]`` integers, the sequence of each column, any value where ``mask`` is 0) then says
which columns belong together.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
KLEstimator = Literal["k1", "k2", "k3"]
Objective = Literal["ppo", "gspo", "cispo"]
ISLevel = Literal["token", "sequence"]
ISMode = Literal["truncate", "mask"]

_MAX_LOG_WEIGHT = 20.0
"""A sequence's log importance weight is clamped to +-20 before ``exp`` (no inf)."""


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


def _sequences(mask: Tensor, seq_ids: Tensor | None) -> tuple[Tensor, int]:
    """``(index, n)``: each column's sequence in ``[0, n)`` (rows by default)."""
    if seq_ids is None:
        rows = torch.arange(mask.shape[0], device=mask.device)[:, None]
        return rows.expand(mask.shape), int(mask.shape[0])
    index = torch.where(mask.bool(), seq_ids.long(), 0)
    return index, int(index.max()) + 1 if index.numel() else 0


def sequence_sum(x: Tensor, mask: Tensor, seq_ids: Tensor | None = None) -> Tensor:
    """``[n]``: the masked sum of ``x`` over each sequence (differentiable)."""
    index, n = _sequences(mask, seq_ids)
    masked = (x * mask).reshape(-1)
    return masked.new_zeros(n).index_add(0, index.reshape(-1), masked)


def sequence_mean(x: Tensor, mask: Tensor, seq_ids: Tensor | None = None) -> Tensor:
    """``x``'s masked mean over each column's sequence, broadcast back to the columns."""
    index, _ = _sequences(mask, seq_ids)
    sums = sequence_sum(x, mask, seq_ids)
    counts = torch.clamp(sequence_sum(torch.ones_like(x), mask, seq_ids), min=1.0)
    return (sums / counts)[index]


def aggregate(
    per_token: Tensor,
    mask: Tensor,
    mode: Aggregation = "token-mean",
    normalizer: float | Tensor | None = None,
    max_tokens: int | None = None,
    seq_ids: Tensor | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss over masked tokens.

    - ``token-mean``: ``sum(mask * L) / normalizer`` (default ``mask.sum()``; DAPO);
    - ``seq-mean-token-mean``: each sequence's token mean, summed and divided by
      ``normalizer`` (default: the sequences; the GRPO paper);
    - ``seq-mean-token-sum-norm``: each sequence's token sum divided by the constant
      ``max_tokens`` (default ``T``), summed over sequences / ``normalizer`` (default: the
      sequences; Dr. GRPO: no length bias).

    Pass the step's token (token-mean) or sequence count as ``normalizer`` when this call
    sees one micro-batch of it.
    """
    masked = per_token * mask
    if mode == "token-mean":
        denom = mask.sum() if normalizer is None else normalizer
        return masked.sum() / torch.clamp(torch.as_tensor(denom), min=1.0)
    if seq_ids is None:
        seqs = float(mask.shape[0]) if normalizer is None else normalizer
        sums, counts = masked.sum(-1), mask.sum(-1)
    else:
        sums = sequence_sum(per_token, mask, seq_ids)
        counts = sequence_sum(torch.ones_like(per_token), mask, seq_ids)
        seqs = float((counts > 0).sum()) if normalizer is None else normalizer
    if mode == "seq-mean-token-mean":
        per_seq = sums / torch.clamp(counts, min=1.0)
    else:
        per_seq = sums / float(mask.shape[-1] if max_tokens is None else max_tokens)
    return per_seq.sum() / torch.clamp(torch.as_tensor(seqs), min=1.0)


def group_advantages(rewards: Tensor, eps: float = 1e-6, std_normalize: bool = True) -> Tensor:
    """Advantages of one GRPO group: ``(r - mean(r)) / (std(r) + eps)``, or ``r - mean(r)``
    without ``std_normalize`` (Dr. GRPO: the std favours groups that are almost all right
    or all wrong).

    ``std`` is the sample standard deviation (Bessel-corrected, as in the GRPO paper and
    TRL). A group whose rewards are all equal, including a group of one, has no baseline to
    compare against: its advantages are zeros.
    """
    r = rewards.to(torch.float32)
    if r.numel() < 2 or bool((r == r[0]).all()):
        return torch.zeros_like(r)
    if not std_normalize:
        return r - r.mean()
    return (r - r.mean()) / (r.std() + eps)


def ppo_clip(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` per token (PPO; DAPO's
    clip-higher when ``eps_high > eps_low``)."""
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    return -torch.minimum(ratio * advantages, clipped * advantages)


def ppo_clipped(ratio: Tensor, advantages: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """Where :func:`ppo_clip`'s clipped branch is the active one (it carries no gradient)."""
    return ((ratio > 1.0 + eps_high) & (advantages > 0)) | (
        (ratio < 1.0 - eps_low) & (advantages < 0)
    )


def gspo(
    log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GSPO (Zheng et al. 2025): the PPO clip on the sequence ratio
    ``s_i = exp(mean_{t in i} log ratio_t)``, every token of sequence i carrying sequence
    i's loss. Returns ``(per_token, seq_ratio)`` (``seq_ratio`` per column, with graph).
    Aggregate with ``seq-mean-token-mean`` for the paper's ``1/G sum_i``."""
    seq_ratio = torch.exp(sequence_mean(log_ratio, mask, seq_ids))
    return ppo_clip(seq_ratio, advantages, eps_low, eps_high), seq_ratio


def cispo(
    ratio: Tensor, new_logprobs: Tensor, advantages: Tensor, eps_low: float, eps_high: float
) -> Tensor:
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logp``. The
    weight is clipped and detached, so every token keeps a gradient (``-w A`` per logprob),
    unlike PPO which drops the clipped ones."""
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high).detach()
    return -weight * advantages * new_logprobs


def importance_weights(
    old_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    mask: Tensor,
    mode: ISMode = "truncate",
    level: ISLevel = "token",
    cap: float | None = None,
    low: float = 0.0,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Off-policy correction for a ratio anchored to ``old`` while the tokens were sampled
    from ``behaviour``: detached weights ``w`` and where the weight was truncated or masked.

    The raw weight is ``pi_old / pi_behaviour`` per token (``level="token"``) or the
    sequence's product ``exp(sum_t (old_t - behaviour_t))`` on each of its tokens
    (``"sequence"``; the log clamped to +-20). ``mode="truncate"``: ``min(w, cap)``
    (TIS; no cap: ``w``). ``mode="mask"``: ``w`` where ``low <= w <= cap``, else 0 (the token
    or the whole sequence is dropped from the gradient; it still counts in the normaliser).
    """
    keep = mask.bool()
    log_w = torch.where(keep, old_logprobs - behaviour_logprobs, 0.0)
    if level == "sequence":
        index, _ = _sequences(mask, seq_ids)
        log_w = sequence_sum(log_w, mask.to(log_w.dtype), seq_ids)[index]
        log_w = torch.where(keep, log_w.clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT), 0.0)
    weight = torch.exp(log_w).detach()
    high = math.inf if cap is None else cap
    if mode == "mask":
        outside = (weight < low) | (weight > high)
        return torch.where(outside, 0.0, weight), outside & keep
    if cap is not None:
        return torch.clamp(weight, max=cap), (weight > cap) & keep
    return weight, torch.zeros_like(keep)


def mismatch(trainer_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Train-vs-rollout mismatch of one micro-batch, detached: ``[tokens, sum k3, sum ratio,
    min ratio, max ratio]`` with ``ratio = pi_trainer / pi_behaviour`` per masked token and
    ``k3 = ratio - 1 - log ratio`` (KL(behaviour || trainer) on the behaviour's samples).
    Min and max are +inf / -inf without tokens."""
    keep = mask.bool()
    log_r = (trainer_logprobs.detach() - behaviour_logprobs)[keep].double()
    ratio = torch.exp(log_r)
    if ratio.numel() == 0:
        return torch.tensor([0.0, 0.0, 0.0, math.inf, -math.inf], dtype=torch.float64)
    return torch.stack([
        torch.tensor(float(ratio.numel()), dtype=torch.float64),
        (ratio - 1.0 - log_r).sum(), ratio.sum(), ratio.min(), ratio.max(),
    ])  # fmt: skip


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
    *,
    objective: Objective = "ppo",
    is_mode: ISMode = "truncate",
    is_level: ISLevel = "token",
    is_low: float = 0.0,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The step's loss (to minimise) and detached statistics.

    Args:
        new_logprobs: log pi_theta(token) under the policy being trained (carries the graph).
        old_logprobs: log pi_old(token), the anchor of the ratio. Today this is the
            behaviour logprob the generator recorded while sampling.
        advantages: the sample's advantage, broadcast to its tokens.
        mask: 1 where a token is trained on, 0 elsewhere (prompt, padding, and the
            observation tokens of a multi-turn episode: only model-produced tokens train).
        clip_eps_low, clip_eps_high: the ratio is clipped to
            ``[1 - clip_eps_low, 1 + clip_eps_high]``; a larger ``clip_eps_high`` is
            DAPO's "clip-higher". ``objective`` picks what is clipped: the token ratio
            (``ppo``), the sequence ratio (``gspo``, :func:`gspo`) or the detached IS
            weight of a REINFORCE term (``cispo``, :func:`cispo`).
        tis_cap, behaviour_logprobs, is_mode, is_level, is_low: off-policy correction
            when the ratio's anchor is *not* the sampling policy (``old_logprobs``
            recomputed by the learner while ``behaviour_logprobs`` come from the inference
            engine): each token's loss is weighted by :func:`importance_weights` (cap
            ``tis_cap``). Without ``behaviour_logprobs`` the weight is 1.
        normalizer: the token count to divide by; default ``mask.sum()``. Pass the token
            count of the whole step when this call sees one micro-batch of it.
        ref_logprobs, kl_coef, kl_estimator: log pi_ref(token) under a frozen reference
            model; adds ``kl_coef * kl_t`` per token (:func:`kl_penalty`, k3 by default:
            unbiased and non-negative). Its gradient pulls each token's logprob towards the
            reference's.
        aggregation, max_tokens, seq_ids: how per-token losses reduce (:func:`aggregate`);
            ``normalizer`` is then the step's token count (token-mean) or sequence count.
        entropy, entropy_coef: the policy's per-token entropy (with graph); subtracts
            ``entropy_coef * H_t`` per token (an entropy bonus) when ``entropy_coef > 0``.

    Returns:
        ``(loss, stats)``; stats are means over the masked tokens of this call:
        ``clip_frac`` (tokens whose clip was active), ``ratio_mean``,
        ``approx_kl`` (k3 estimator of KL(pi_old || pi_theta):
        ``mean(ratio - 1 - log ratio)``), ``tis_weight_mean``, ``is_clip_frac`` (tokens
        whose IS weight was truncated or masked), ``kl_ref`` (mean KL to the reference, 0
        without one) and ``tokens``.
    """
    keep = mask.bool()
    mask = mask.to(new_logprobs.dtype)
    # Masked positions may hold anything (padding); zero them before exp() so that they can
    # never turn into inf * 0 = NaN, in the loss or in the gradient.
    log_ratio = torch.where(keep, new_logprobs - old_logprobs, 0.0)
    ratio = torch.exp(log_ratio)
    if objective == "gspo":
        per_token, seq_ratio = gspo(log_ratio, advantages, mask, clip_eps_low, clip_eps_high,
                                    seq_ids)  # fmt: skip
        was_clipped = ppo_clipped(seq_ratio.detach(), advantages, clip_eps_low, clip_eps_high)
    elif objective == "cispo":
        per_token = cispo(ratio, torch.where(keep, new_logprobs, 0.0), advantages,
                          clip_eps_low, clip_eps_high)  # fmt: skip
        was_clipped = (ratio > 1.0 + clip_eps_high) | (ratio < 1.0 - clip_eps_low)
    else:
        per_token = ppo_clip(ratio, advantages, clip_eps_low, clip_eps_high)
        was_clipped = ppo_clipped(ratio, advantages, clip_eps_low, clip_eps_high)

    if behaviour_logprobs is None:
        weight = torch.ones_like(per_token)
        is_clipped = torch.zeros_like(keep)
    else:
        weight, is_clipped = importance_weights(
            old_logprobs, behaviour_logprobs, mask, is_mode, is_level, tis_cap, is_low, seq_ids
        )
    per_token = per_token * weight
    if ref_logprobs is not None:
        kl = kl_penalty(
            torch.where(keep, new_logprobs, 0.0), torch.where(keep, ref_logprobs, 0.0), kl_estimator
        )
        per_token = per_token + kl_coef * kl
    else:
        kl = torch.zeros_like(per_token)
    if entropy is not None and entropy_coef > 0:
        per_token = per_token - entropy_coef * torch.where(keep, entropy, 0.0)

    tokens = mask.sum()
    loss = aggregate(per_token, mask, aggregation, normalizer, max_tokens, seq_ids)

    with torch.no_grad():
        n = torch.clamp(tokens, min=1.0)
        stats = {
            "clip_frac": float((was_clipped * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "approx_kl": float(((ratio - 1.0 - log_ratio) * mask).sum() / n),
            "tis_weight_mean": float((weight * mask).sum() / n),
            "is_clip_frac": float((is_clipped * mask).sum() / n),
            "kl_ref": float((kl * mask).sum() / n),
            "tokens": float(tokens),
        }
    return loss, stats


def sft_loss(
    new_logprobs: Tensor,
    mask: Tensor,
    normalizer: float | Tensor | None = None,
    aggregation: Aggregation = "token-mean",
    max_tokens: int | None = None,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Supervised fine-tuning: the token cross-entropy ``-log pi_theta(token)`` on the
    tokens where ``mask`` is 1 (an example's assistant and tool-call tokens; never the
    prompt, tool results or padding), reduced by :func:`aggregate`.

    With ``token-mean`` and the step's trained-token count as ``normalizer`` this is the mean
    negative log-likelihood per trained token of the whole step, whatever its split into
    micro-batches and ranks; its gradient in the logits of token t is
    ``(softmax(z_t) - onehot(y_t)) / normalizer`` (``tests/learner/test_sft_loss.py``).

    Returns ``(loss, stats)`` with the statistics keys of :func:`policy_loss` (no ratio: 1,
    nothing clipped, no KL) so the step reports both objectives alike; ``tokens`` is this
    call's trained-token count.
    """
    keep = mask.bool()
    mask = mask.to(new_logprobs.dtype)
    nll = -torch.where(keep, new_logprobs, 0.0)  # masked columns may hold anything
    loss = aggregate(nll, mask, aggregation, normalizer, max_tokens, seq_ids)
    stats = {"clip_frac": 0.0, "ratio_mean": 1.0, "approx_kl": 0.0, "tis_weight_mean": 1.0,
             "is_clip_frac": 0.0, "kl_ref": 0.0, "tokens": float(mask.sum())}
    return loss, stats
