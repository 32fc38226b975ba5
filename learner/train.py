"""One optimiser step of GRPO on a list of verified groups.

Guarantees:
- the new logprobs are the same function the generator used for the behaviour logprobs,
  ``log_softmax(logits / T)[token]`` with each trajectory's own sampling temperature ``T``,
  so on-policy data gives ``ratio == 1`` up to float error;
- gradient accumulation over micro-batches is exact: every micro-batch divides by the token
  count of the whole step, so the update does not depend on ``micro_batch_size``;
- a step either updates the weights with a finite gradient, or raises and leaves the weights
  untouched (non-finite gradient norm), or is skipped and says so (no group with signal).

Simplifications: one process, one device, no FSDP/tensor parallelism, no reference-model
KL penalty, no entropy bonus; zero-advantage groups are dropped rather than re-sampled.
The Redis actor loop (staleness policy, publishing weights, metrics) lives in the learner
actor; this module only does the math.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from learner.batch import Batch, build_batch, has_signal
from learner.loss import policy_loss
from learner.model import load_model
from queues.messages import Trajectory


@dataclass(frozen=True)
class TrainConfig:
    """How the learner trains. Every field has a safe default for the demo."""

    lr: float = 1e-5
    """AdamW learning rate (> 0)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment decay rates, each in [0, 1)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (>= 0). Off by default: it pulls towards zero, not
    towards the pretrained weights."""
    clip_eps: float = 0.2
    """PPO clip range below 1: the ratio is clipped to ``[1 - clip_eps, 1 + clip_eps_high]``."""
    clip_eps_high: float | None = None
    """Clip range above 1 (DAPO "clip-higher", e.g. 0.28); None means ``clip_eps``."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (> 0)."""
    micro_batch_size: int = 8
    """Samples per forward/backward (>= 1). Bounds activation memory; the gradient is
    accumulated over micro-batches and is the same for every value."""
    grad_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    temperature: float | None = None
    """Temperature the new logprobs are computed at. None (the default and the only
    consistent choice): each trajectory's own ``task.sampling.temperature``. A number
    overrides it for every sample, for experiments only."""
    drop_zero_advantage: bool = True
    """Drop groups whose rewards are all equal before the forward pass: their advantages
    are zero, so they cost compute and only dilute the token normaliser."""
    adv_eps: float = 1e-6
    """Added to the group's reward std before dividing (> 0)."""
    seed: int = 0
    """Seeds torch at construction (dropout, if the model has any)."""
    num_threads: int | None = None
    """``torch.set_num_threads`` when set; None leaves torch's default alone."""
    device: str = "cpu"
    """Where the model and the batches live."""

    def __post_init__(self) -> None:
        checks = {
            "lr > 0": self.lr > 0,
            "0 <= betas < 1": all(0 <= b < 1 for b in self.betas),
            "weight_decay >= 0": self.weight_decay >= 0,
            "0 < clip_eps < 1": 0 < self.clip_eps < 1,
            "clip_eps_high > 0": self.clip_eps_high is None or self.clip_eps_high > 0,
            "max_grad_norm > 0": self.max_grad_norm > 0,
            "micro_batch_size >= 1": self.micro_batch_size >= 1,
            "temperature > 0": self.temperature is None or self.temperature > 0,
            "adv_eps > 0": self.adv_eps > 0,
            "num_threads >= 1": self.num_threads is None or self.num_threads >= 1,
        }
        broken = [rule for rule, ok in checks.items() if not ok]
        if broken:
            raise ValueError(f"invalid TrainConfig: {', '.join(broken)}")


@dataclass(frozen=True)
class StepStats:
    """What one :meth:`Trainer.step` did. Token-weighted means over the trained tokens."""

    step: int  # steps taken so far, including this one
    skipped: bool  # no group with signal: no forward pass, no optimiser step
    loss: float
    grad_norm: float  # before clipping
    clip_frac: float
    ratio_mean: float
    approx_kl: float
    reward_mean: float  # over every sample received, including dropped groups
    groups: int  # groups trained on
    samples: int  # samples trained on
    tokens: int  # completion tokens trained on
    dropped_groups: int  # zero-advantage groups dropped
    seconds: float


def token_logprobs(model: Any, batch: Batch, temperature: float | None = None) -> Tensor:
    """``log_softmax(logits / T)`` of each next token where ``batch.loss_mask`` is 1, shape
    ``[B, L-1]`` (aligned like ``loss_mask``; 0 elsewhere). ``T`` is each sample's own
    temperature unless overridden.

    The vocabulary projection runs only on the loss positions, not on prompt and padding
    positions: at a 49k vocabulary the ``[tokens, vocab]`` logits and their log-softmax are
    a large share of a step. This assumes the usual causal-LM layout, ``lm_head(decoder(x))``
    with nothing in between (true for Llama/SmolLM2; not for models with logit soft-capping).
    """
    hidden = model.base_model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False
    ).last_hidden_state
    keep = batch.loss_mask.bool()
    logits = model.get_output_embeddings()(hidden[:, :-1][keep]).float()  # [N, V]
    if temperature is None:
        per_token = batch.temperature.to(logits)[:, None].expand_as(keep)[keep]
        logits = logits / per_token[:, None]
    else:
        logits = logits / temperature
    # -cross_entropy == log_softmax gathered at the target, fused (one [N, V] gradient)
    picked = -F.cross_entropy(logits, batch.target_ids[keep], reduction="none")
    out = torch.zeros(keep.shape, dtype=logits.dtype, device=logits.device)
    return out.masked_scatter(keep, picked)


def _enable_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing per decoder layer (transformers 4.x and 5.x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class Trainer:
    """The policy in train mode, its AdamW optimiser, and :meth:`step`."""

    def __init__(self, model: Any, config: TrainConfig | None = None) -> None:
        self.config = config = config or TrainConfig()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.model = model.to(config.device)
        self.model.train()
        self.model.config.use_cache = False
        if config.grad_checkpointing:
            _enable_checkpointing(self.model)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )
        self.pad_id = self.model.config.pad_token_id or 0
        self.steps = 0

    @classmethod
    def from_dir(cls, model_dir: Path | str, config: TrainConfig | None = None) -> Trainer:
        return cls(load_model(model_dir), config)

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Resume from :func:`learner.checkpoint.load_trainer_state`'s dict. The learning
        rate and betas of the current config win over the saved ones."""
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr
            group["betas"] = self.config.betas
            group["weight_decay"] = self.config.weight_decay
        self.steps = int(state.get("steps", 0))

    def step(self, trajectories: Sequence[Trajectory]) -> StepStats:
        """One optimiser step on ``trajectories`` (already filtered for staleness)."""
        cfg = self.config
        started = time.perf_counter()
        all_rewards = [r for t in trajectories for r in t.rewards]
        reward_mean = sum(all_rewards) / max(len(all_rewards), 1)
        groups = [t for t in trajectories if has_signal(t) or not cfg.drop_zero_advantage]
        dropped = len(trajectories) - len(groups)
        if not groups:
            return StepStats(
                step=self.steps, skipped=True, loss=0.0, grad_norm=0.0, clip_frac=0.0,
                ratio_mean=1.0, approx_kl=0.0, reward_mean=reward_mean, groups=0, samples=0,
                tokens=0, dropped_groups=dropped, seconds=time.perf_counter() - started,
            )  # fmt: skip

        batch = build_batch(groups, pad_id=self.pad_id, eps=cfg.adv_eps).to(cfg.device)
        total_tokens = batch.loss_mask.sum()
        clip_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high

        # Forward/backward per micro-batch; each divides by the step's token count, so the
        # accumulated gradient is the full batch's gradient.
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        sums = {"clip_frac": 0.0, "ratio_mean": 0.0, "approx_kl": 0.0}
        for mb in batch.micro_batches(cfg.micro_batch_size):
            new_logprobs = token_logprobs(self.model, mb, cfg.temperature)
            loss, stats = policy_loss(
                new_logprobs,
                mb.old_logprobs,
                mb.advantages,
                mb.loss_mask,
                clip_eps_low=cfg.clip_eps,
                clip_eps_high=clip_high,
                normalizer=total_tokens,
            )
            loss.backward()
            loss_sum += loss.item()
            for key in sums:
                sums[key] += stats[key] * stats["tokens"]

        # Clip, then step only with a finite gradient.
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm {grad_norm}; weights unchanged")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1

        tokens = max(float(total_tokens), 1.0)
        return StepStats(
            step=self.steps,
            skipped=False,
            loss=loss_sum,
            grad_norm=grad_norm,
            clip_frac=sums["clip_frac"] / tokens,
            ratio_mean=sums["ratio_mean"] / tokens,
            approx_kl=sums["approx_kl"] / tokens,
            reward_mean=reward_mean,
            groups=len(groups),
            samples=batch.size,
            tokens=int(total_tokens),
            dropped_groups=dropped,
            seconds=time.perf_counter() - started,
        )
