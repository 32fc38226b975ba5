"""One optimiser step of GRPO on a list of verified groups, or of supervised fine-tuning on a
list of examples (``mode="sft"``: the same batches, passes, collectives and normaliser; only
the loss differs, :func:`learner.loss.sft_loss`).

Guarantees:
- the new logprobs are the same function the generator used for the behaviour logprobs,
  ``log_softmax(logits / T)[token]`` with each trajectory's own sampling temperature ``T``,
  so on-policy data gives ``ratio == 1`` up to float error;
- gradient accumulation over micro-batches is exact: every micro-batch divides by the token
  count of the whole step, so the update does not depend on ``micro_batch_size``;
- a step either updates the weights with a finite gradient, or raises and leaves the weights
  untouched (non-finite gradient norm), or is skipped and says so (no group with signal).

- with ``torch.distributed`` initialised (``torchrun``, see :mod:`learner.distributed`),
  the policy is wrapped in ``DistributedDataParallel``; every rank builds the same batch,
  trains on its own contiguous slice of the samples (padding micro-batches with a zero
  loss even out the backward passes) and scales its loss by the world size, so DDP's
  averaged gradient is the whole batch's: N ranks take the same step as one process
  (up to float summation order);
- every rank makes the same model calls in the same order, so under FSDP every rank takes
  the same collectives: the same number of passes, and in each pass the shared-prefix
  forward (two calls) on every rank or on none (one call), decided from every rank's
  micro-batch of that pass (:meth:`Trainer._passes`);
- the trainer's RNG states (torch, CUDA, python ``random``, numpy) travel with the
  optimiser state (:meth:`Trainer.state_dict`), so a resumed run draws the same random
  numbers (dropout) as one that never stopped.

- with ``parallelism="fsdp"`` under a process group (of any size: one rank gets FSDP2's bf16
  parameters over fp32 master weights), the policy (and the KL reference) are
  sharded with FSDP2 instead (:mod:`learner.fsdp`): the same batch split, padding passes and
  world-size scaling (FSDP's reduce-scatter averages too), the gradient norm taken over
  every rank's shards; each backward pass reduce-scatters, so no rank holds a whole gradient.

Simplifications: data parallel only (no tensor or pipeline parallelism: with FSDP a layer
must fit on one device); zero-advantage groups are dropped rather than re-sampled. The loss
menu (objective, aggregation, off-policy correction, KL, entropy bonus, reward shaping, LR
schedule) is one function each in :mod:`learner.loss` and :mod:`learner.shaping`, composed by
:meth:`Trainer.step`.
The Redis actor loop (staleness policy, publishing weights, metrics) lives in the learner
actor; this module only does the math.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from streamrl.learner import distributed as dist_util
from streamrl.learner import fsdp
from streamrl.learner.batch import Batch, build_batch, has_signal
from streamrl.learner.logprobs import chunked_logprobs, logit_transform
from streamrl.learner.lora import LoraSettings, apply_lora, load_adapter
from streamrl.learner.loss import (
    Aggregation,
    ISLevel,
    ISMode,
    KLEstimator,
    Objective,
    group_advantages,
    mismatch,
    policy_loss,
    sft_loss,
)
from streamrl.learner.packing import is_packed, model_inputs, pack
from streamrl.learner.prefix import MIN_SHARED_TOKENS, hidden_states, takes_prefix
from streamrl.learner.shaping import LRDecay, lr_factor, sequence_kl
from streamrl.models import load_model

if TYPE_CHECKING:
    from streamrl.protocol.messages import Trajectory

Mode = Literal["rl", "sft"]
"""What a step trains: ``rl``, the policy loss on verified groups; ``sft``, the token
cross-entropy on supervised examples (:func:`learner.loss.sft_loss`)."""


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
    updates_per_step: int = 1
    """Optimiser updates per :meth:`Trainer.step` (>= 1; PPO's mini-batches): the step's groups
    with signal are split in order into this many parts of near-equal size (fewer when there
    are fewer groups), and each part is one AdamW update, its loss normalised over its own
    tokens. Every sample is still trained on once; the later parts see the weights the
    earlier ones updated, their PPO ratio still anchored to the behaviour logprobs (with
    ``recompute_old_logprobs``: to the policy's logprobs before the first update, PPO's
    pi_old). The learning-rate schedule counts updates."""
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
    tis_cap: float | None = 2.0
    """Truncated importance sampling cap (> 0; None: no cap). Used when
    ``recompute_old_logprobs`` is on: each token is weighted by
    ``min(pi_old / pi_behaviour, tis_cap)``."""
    recompute_old_logprobs: bool = False
    """Anchor the PPO ratio to logprobs recomputed by the learner (no-grad pass with the
    weights before the step) instead of the generator's behaviour logprobs, and correct for
    the behaviour policy with truncated importance sampling. Off: the ratio's anchor *is*
    the behaviour policy and the clip bounds the importance ratio itself."""
    kl_coef: float = 0.0
    """Weight of the k3 KL penalty to a frozen reference model (>= 0; 0: no reference model
    is loaded)."""
    kl_estimator: KLEstimator = "k3"
    """KL(pi_theta || pi_ref) estimator per token (:func:`learner.loss.kl_penalty`)."""
    kl_in_reward: bool = False
    """Subtract ``kl_coef`` times each sample's summed KL (behaviour logprobs against the
    reference, before the step) from its reward before advantages, instead of adding the KL
    to the loss."""
    objective: Objective = "ppo"
    """``ppo``: token ratio clipped; ``gspo``: the sequence ratio ``exp(mean log ratio)``
    clipped per sequence; ``cispo``: ``-sg(clip(ratio)) * A * logprob`` (:mod:`learner.loss`)."""
    aggregation: Aggregation = "token-mean"
    """How per-token losses reduce over the step (:func:`learner.loss.aggregate`)."""
    aggregation_tokens: int = 0
    """The constant divisor of ``seq-mean-token-sum-norm`` (e.g. the generation budget;
    >= 0); 0: the most loss tokens of any sample in the step."""
    advantage_std: bool = True
    """Divide each group's centred rewards by their std (GRPO); off: Dr. GRPO."""
    is_mode: ISMode = "truncate"
    """Off-policy correction with ``recompute_old_logprobs``: ``truncate`` caps the weight at
    ``tis_cap``; ``mask`` zeroes it outside ``[is_low, tis_cap]``."""
    is_level: ISLevel = "token"
    """Importance weight per token or per sequence (the product of its tokens' weights)."""
    is_low: float = 0.0
    """Lower threshold of ``is_mode = "mask"`` (>= 0)."""
    entropy_coef: float = 0.0
    """Entropy bonus: subtract this times the per-token entropy from the loss (>= 0; the
    entropy is logged either way)."""
    overlong_filter: bool = False
    """Train on no token of a sample that stopped at its token limit (DAPO)."""
    length_penalty_tokens: int = 0
    """DAPO's soft length penalty over this many tokens before ``max_new_tokens`` (>= 0;
    0: off; :func:`learner.shaping.soft_length_penalty`)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over this many optimiser steps (>= 0)."""
    lr_decay: LRDecay = "constant"
    """After warmup: ``constant``, or ``cosine`` down to ``min_lr_ratio * lr`` at step
    ``lr_decay_steps`` (:func:`learner.shaping.lr_factor`)."""
    lr_decay_steps: int = 0
    """Length of the whole schedule in steps, warmup included (> warmup_steps for cosine)."""
    min_lr_ratio: float = 0.0
    """Where the cosine ends, as a fraction of ``lr`` (in [0, 1])."""
    bf16: bool = True
    """Autocast the forward passes to bfloat16 on CUDA (weights and optimiser stay fp32);
    ignored on CPU."""
    adv_eps: float = 1e-6
    """Added to the group's reward std before dividing (> 0)."""
    seed: int = 0
    """Seeds torch at construction (dropout, if the model has any)."""
    num_threads: int | None = None
    """``torch.set_num_threads`` when set; None leaves torch's default alone."""
    device: str = "cpu"
    """Where the model and the batches live."""
    logprob_chunk_tokens: int = 1024
    """Tokens per chunk of the vocabulary projection and log-softmax (>= 1): bounds the fp32
    logits held at once to ``[chunk, vocab]`` (:mod:`learner.logprobs`)."""
    shared_prefix: int = MIN_SHARED_TOKENS
    """A right-padded micro-batch whose rows begin with at least this many identical tokens
    (a group's prompt) computes them once for all rows (:mod:`learner.prefix`; the same loss
    and gradient); 0: never. Off under ``grad_checkpointing`` (no cache to continue) and for
    packed micro-batches (``max_tokens_per_micro_batch``)."""
    max_tokens_per_micro_batch: int = 0
    """Pack samples into micro-batches of at most this many tokens, several samples per row
    without attending across them (:mod:`learner.packing`); 0: ``micro_batch_size``
    samples per micro-batch, right-padded. The gradient is the same either way."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """Under a process group of more than one rank: ``ddp`` replicates the model, its
    gradients and AdamW state on every rank; ``fsdp`` shards all three (FSDP2,
    :mod:`learner.fsdp`; bf16 compute with fp32 reduction on CUDA when ``bf16``). The step
    is the same either way. Without a process group both are ignored; in a group of one
    rank ``fsdp`` still wraps the model (its mixed precision on one device)."""
    lora: LoraSettings | None = None
    """Train LoRA adapters only, the base frozen (:mod:`learner.lora`); the KL reference is
    then the base with the adapters disabled. None: full fine-tuning."""

    def __post_init__(self) -> None:
        checks = {
            "lr > 0": self.lr > 0,
            "0 <= betas < 1": all(0 <= b < 1 for b in self.betas),
            "weight_decay >= 0": self.weight_decay >= 0,
            "0 < clip_eps < 1": 0 < self.clip_eps < 1,
            "clip_eps_high > 0": self.clip_eps_high is None or self.clip_eps_high > 0,
            "max_grad_norm > 0": self.max_grad_norm > 0,
            "micro_batch_size >= 1": self.micro_batch_size >= 1,
            "updates_per_step >= 1": self.updates_per_step >= 1,
            "temperature > 0": self.temperature is None or self.temperature > 0,
            "adv_eps > 0": self.adv_eps > 0,
            "tis_cap > 0": self.tis_cap is None or self.tis_cap > 0,
            "kl_coef >= 0": self.kl_coef >= 0,
            "aggregation_tokens >= 0": self.aggregation_tokens >= 0,
            "is_low >= 0": self.is_low >= 0,
            "entropy_coef >= 0": self.entropy_coef >= 0,
            "length_penalty_tokens >= 0": self.length_penalty_tokens >= 0,
            "warmup_steps >= 0": self.warmup_steps >= 0,
            "lr_decay_steps > warmup_steps for cosine": self.lr_decay != "cosine"
            or self.lr_decay_steps > self.warmup_steps,
            "0 <= min_lr_ratio <= 1": 0 <= self.min_lr_ratio <= 1,
            "num_threads >= 1": self.num_threads is None or self.num_threads >= 1,
            "logprob_chunk_tokens >= 1": self.logprob_chunk_tokens >= 1,
            "max_tokens_per_micro_batch >= 0": self.max_tokens_per_micro_batch >= 0,
            "shared_prefix >= 0": self.shared_prefix >= 0,
            "parallelism in (ddp, fsdp)": self.parallelism in ("ddp", "fsdp"),
            "lora with parallelism ddp (FSDP publishes whole models only)": self.lora is None
            or self.parallelism == "ddp",
            "lora with parallelism ddp": self.lora is None or self.parallelism == "ddp",
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
    kl_ref: float  # mean k3 KL to the reference model (0 without one)
    reward_mean: float  # over every sample received, including dropped groups
    groups: int  # groups trained on
    samples: int  # samples trained on
    tokens: int  # completion tokens trained on
    dropped_groups: int  # zero-advantage groups dropped
    seconds: float
    entropy: float = 0.0  # mean entropy of the policy's next-token distributions (at T)
    lr: float = 0.0  # the learning rate of this step (warmup and decay applied)
    is_clip_frac: float = 0.0  # tokens whose importance weight was truncated or masked
    # train-vs-rollout mismatch: pi_trainer / pi_behaviour per token, before the update
    mismatch_kl: float = 0.0  # mean k3: ratio - 1 - log ratio
    mismatch_ratio_min: float = 1.0
    mismatch_ratio_mean: float = 1.0
    mismatch_ratio_max: float = 1.0


def token_logprobs(
    model: Any, batch: Batch, temperature: float | None = None, chunk_tokens: int = 1024,
    shared_prefix: int = 0,
) -> Tensor:  # fmt: skip
    """``log_softmax(logits / T)`` of each next token where ``batch.loss_mask`` is 1, shape
    ``[B, L-1]`` (aligned like ``loss_mask``; 0 elsewhere). ``T`` is each sample's own
    temperature unless overridden. See :func:`token_logprobs_and_entropy`."""
    return token_logprobs_and_entropy(model, batch, temperature, chunk_tokens,
                                      shared_prefix=shared_prefix)[0]  # fmt: skip


def token_logprobs_and_entropy(
    model: Any,
    batch: Batch,
    temperature: float | None = None,
    chunk_tokens: int = 1024,
    entropy_grad: bool = False,
    shared_prefix: int = 0,
) -> tuple[Tensor, Tensor]:
    """:func:`token_logprobs` and the entropy of each predicted distribution (same layout;
    with a gradient only if ``entropy_grad``: an entropy bonus).

    ``shared_prefix`` > 0: when the rows begin with at least that many identical tokens (one
    group's prompt), the prefix is computed once for all rows (:mod:`learner.prefix`; the
    same values and gradients).

    The logits are the model's own (``model(...).logits``: soft-capping and logit scaling
    respected, :func:`learner.logprobs.logit_transform`), computed only on the loss
    positions and ``chunk_tokens`` tokens at a time (:func:`learner.logprobs.
    chunked_logprobs`): the ``[tokens, vocab]`` fp32 logits of the micro-batch never exist
    at once.
    """
    if is_packed(batch):  # several samples per row (learner/packing.py)
        inputs = model_inputs(batch, next(model.parameters()).dtype)
        hidden = model.base_model(**inputs, use_cache=False).last_hidden_state
    else:
        hidden = hidden_states(model.base_model, batch.input_ids, batch.attention_mask,
                               shared_prefix)  # fmt: skip
    keep = batch.loss_mask.bool()
    if temperature is None:
        per_token = batch.temperature.to(hidden.device)[:, None].expand_as(keep)[keep]
    else:
        per_token = torch.full((int(keep.sum()),), temperature, device=hidden.device)
    picked, entropy = chunked_logprobs(
        model.get_output_embeddings(), hidden[:, :-1][keep], batch.target_ids[keep],
        per_token, logit_transform(model.config), chunk_tokens, entropy_grad,
    )  # fmt: skip
    zeros = torch.zeros(keep.shape, dtype=torch.float32, device=hidden.device)
    return zeros.masked_scatter(keep, picked), zeros.masked_scatter(keep, entropy)


def _enable_checkpointing(model: Any) -> None:
    """Non-reentrant activation checkpointing per decoder layer (transformers 4.x and 5.x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _autocast(config: TrainConfig) -> Any:
    if config.bf16 and torch.device(config.device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def rng_state() -> dict[str, Any]:
    """Every RNG a step may draw from, as tensors and plain values (``weights_only`` safe)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _PolicyLogprobs(torch.nn.Module):
    """:func:`token_logprobs` of ``policy`` as a module's ``forward``: DDP hooks its
    wrapped module's forward (it arms the gradient all-reduce there), and the policy is
    called through ``base_model`` and the output embeddings, not its own forward."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        self.policy = policy

    def forward(
        self, batch: Batch, temperature: float | None, chunk_tokens: int,
        entropy_grad: bool = False, shared_prefix: int = 0,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        return token_logprobs_and_entropy(
            self.policy, batch, temperature, chunk_tokens, entropy_grad, shared_prefix
        )


class Trainer:
    """The policy in train mode, its AdamW optimiser, and :meth:`step`.

    ``ref_model`` is the frozen reference of the KL penalty; with ``kl_coef > 0`` and none
    given, a frozen copy of ``model`` as passed in is taken. Under LoRA (``config.lora``)
    there is no reference model: the reference is ``model`` with its adapters disabled, and
    ``peft`` is the ``PeftModel`` around ``model`` (None without LoRA).

    ``model`` is always the unwrapped Hugging Face model (state dicts keep its parameter
    names); under a process group with more than one rank, ``ddp`` is the
    ``DistributedDataParallel`` the gradients go through (None in one process), or, with
    ``parallelism="fsdp"`` under any process group, ``fsdp`` is the FSDP2 root that shards
    it (:mod:`learner.fsdp`; ``model``'s parameters are then DTensor shards).
    """

    def __init__(
        self, model: Any, config: TrainConfig | None = None, ref_model: Any = None
    ) -> None:
        self.config = config = config or TrainConfig()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.model = model.to(config.device)
        self.model.train()
        self.model.config.use_cache = False
        self.ref_model: Any = None
        self.peft: Any = None
        if config.lora is not None:
            if ref_model is not None:
                raise ValueError("under LoRA the KL reference is the base with the adapters "
                                 "disabled: pass no ref_model")
            self.peft = apply_lora(self.model, config.lora)  # base frozen, adapters trainable
        elif config.kl_coef > 0:
            ref = copy.deepcopy(self.model) if ref_model is None else ref_model
            self.ref_model = ref.to(config.device).eval().requires_grad_(False)
        if config.grad_checkpointing:
            _enable_checkpointing(self.model)
        # DDP's constructor broadcasts rank 0's weights: every replica starts identical.
        # FSDP shards what each rank loaded (every rank loads the same directory).
        self.ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self.fsdp: torch.nn.Module | None = None  # the sharded root around ``model``
        self.ref_fsdp: torch.nn.Module | None = None
        if dist_util.in_process_group() and config.parallelism == "fsdp":
            policy = fsdp.mixed_precision(torch.device(config.device), config.bf16)
            self.fsdp = fsdp.shard(_PolicyLogprobs(self.model), self.model, policy)
            if self.ref_model is not None:
                self.ref_fsdp = fsdp.shard(_PolicyLogprobs(self.ref_model), self.ref_model, policy)
        elif dist_util.is_distributed():
            self.ddp = dist_util.wrap_ddp(_PolicyLogprobs(self.model), torch.device(config.device))
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=config.lr,
            betas=config.betas,
            weight_decay=config.weight_decay,
        )
        self.pad_id = self.model.config.pad_token_id or 0
        self.steps = 0
        # activation checkpointing recomputes the layers without a cache to continue from
        self.shared_prefix = 0 if config.grad_checkpointing else config.shared_prefix

    @classmethod
    def from_dir(
        cls, model_dir: Path | str, config: TrainConfig | None = None,
        ref_dir: Path | str | None = None,
    ) -> Trainer:  # fmt: skip
        config = config or TrainConfig()
        wants_ref = config.kl_coef > 0 and config.lora is None  # LoRA: the adapters disabled
        ref = load_model(ref_dir) if ref_dir is not None and wants_ref else None
        return cls(load_model(model_dir), config, ref)

    @property
    def policy(self) -> Any:
        """What a checkpoint saves: the ``PeftModel`` under LoRA, else :attr:`model`."""
        return self.model if self.peft is None else self.peft

    def base_logprobs(self, batch: Batch, shared_prefix: int | None = None) -> Tensor:
        """Under LoRA, the KL reference: :func:`token_logprobs` of :attr:`model` with its
        adapters disabled (the base as loaded; no second copy of the model), no gradient.
        ``shared_prefix``: None is the trainer's."""
        if self.peft is None:
            raise ValueError("base_logprobs needs TrainConfig.lora")
        cfg = self.config
        prefix = self.shared_prefix if shared_prefix is None else shared_prefix
        with torch.no_grad(), _autocast(cfg), self.peft.disable_adapter():
            return token_logprobs(self.model, batch, cfg.temperature, cfg.logprob_chunk_tokens,
                                  prefix)  # fmt: skip

    def load_adapter(self, directory: Path | str) -> None:
        """Resume the adapters of a LoRA version directory (:func:`learner.lora.
        load_adapter`); the base stays as loaded."""
        if self.peft is None:
            raise ValueError("load_adapter needs TrainConfig.lora")
        load_adapter(self.peft, directory)

    def state_dict(self) -> dict[str, Any]:
        """Optimiser state, step count and RNG states: what resuming needs besides the weights."""
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps, "rng": rng_state()}

    def save_sharded(self, directory: Path) -> None:
        """Model, optimiser, step count and RNG states as a sharded checkpoint in
        ``directory`` (:func:`learner.fsdp.save_sharded`; a collective under FSDP)."""
        fsdp.save_sharded(self.model, self.optimizer, directory, self.steps, rng_state())

    def load_sharded(self, directory: Path) -> None:
        """Resume from :meth:`save_sharded`'s checkpoint, written by any number of ranks,
        into this trainer, sharded or not; the current config's optimiser settings win."""
        extra = fsdp.load_sharded(self.model, self.optimizer, directory)
        self.load_optimizer_state({"optimizer": self.optimizer.state_dict(), **extra})

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (as saved by :func:`learner.checkpoint.
        save_trainer_state`). The learning rate and betas of the current config win over the
        saved ones; RNG states are restored when present."""
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr
            group["betas"] = self.config.betas
            group["weight_decay"] = self.config.weight_decay
        self.steps = int(state.get("steps", 0))
        if "rng" in state:
            set_rng_state(state["rng"])

    def step(
        self, trajectories: Sequence[Trajectory], *, apply: bool = True, mode: Mode = "rl"
    ) -> StepStats:
        """One step on ``trajectories`` (already filtered for staleness): one optimiser update,
        or ``updates_per_step`` on its parts. In a distributed run every rank must call it with
        the same trajectories. ``apply=False``: every forward and backward pass and the
        gradient check of the step, but the weights and the optimiser are left as they were
        (a probe: does this group alone fail?).

        ``mode="sft"``: each trajectory is a supervised example (:mod:`learner.sft_data`: one
        sample, its assistant tokens masked in) and the loss is :func:`learner.loss.sft_loss`
        at temperature 1; no group is dropped for lack of signal, and the RL terms (KL
        reference, recomputed anchors, entropy bonus) are not computed."""
        cfg = self.config
        sft = mode == "sft"
        started = time.perf_counter()
        all_rewards = [r for t in trajectories for r in t.rewards]
        reward_mean = sum(all_rewards) / max(len(all_rewards), 1)
        keep_all = sft or not cfg.drop_zero_advantage
        groups = [t for t in trajectories if keep_all or has_signal(t)]
        dropped = len(trajectories) - len(groups)
        if not groups:
            return StepStats(
                step=self.steps, skipped=True, loss=0.0, grad_norm=0.0, clip_frac=0.0,
                ratio_mean=1.0, approx_kl=0.0, kl_ref=0.0, reward_mean=reward_mean, groups=0,
                samples=0, tokens=0, dropped_groups=dropped,
                seconds=time.perf_counter() - started,
            )  # fmt: skip

        parts = []
        for part in _split(groups, cfg.updates_per_step):
            full = build_batch(
                part, pad_id=self.pad_id, eps=cfg.adv_eps, std_normalize=cfg.advantage_std,
                overlong_filter=cfg.overlong_filter,
                length_penalty_tokens=cfg.length_penalty_tokens,
            )  # fmt: skip
            kl_sum = 0.0
            if cfg.kl_in_reward and cfg.kl_coef > 0 and not sft:
                full, kl_sum = self._kl_in_reward(full, [len(t.rewards) for t in part])
            parts.append((full, len(part), kl_sum))
        # With recomputed logprobs every part's anchor is taken before the first update (PPO's
        # pi_old), not at the weights the earlier parts left.
        anchors = ([self._anchor_logprobs(full) for full, _, _ in parts]
                   if cfg.recompute_old_logprobs and not sft else [None] * len(parts))
        updates = [
            self.step_batch(full, reward_mean=reward_mean, groups=n, dropped_groups=dropped,
                            apply=apply, kl_ref_sum=kl_sum, anchors=anchor, mode=mode)
            for (full, n, kl_sum), anchor in zip(parts, anchors, strict=True)
        ]  # fmt: skip
        return _merge(updates, time.perf_counter() - started)

    def _passes(self, full: Batch) -> _Passes:
        """This rank's passes of ``full``: its micro-batches, then as many padding ones (row 0,
        loss weight 0) as make every rank's count the same (DDP needs the same backward passes
        on every rank, FSDP the same forwards), and each pass's shared prefix, the same
        decision on every rank (FSDP: the same model calls). All ranks hold the whole batch,
        so no communication is needed."""
        ranks = [self._micro_batches(full, dist_util.shard_rows(full.size, r))
                 for r in range(dist_util.world_size())]  # fmt: skip
        passes = max(len(batches) for batches in ranks)
        padded = [batches + [full.rows(slice(0, 1))] * (passes - len(batches))
                  for batches in ranks]  # fmt: skip
        prefix = [self._agreed_prefix([batches[i] for batches in padded]) for i in range(passes)]
        me = dist_util.rank()
        return _Passes(padded[me], len(ranks[me]), prefix)

    def _agreed_prefix(self, batches: list[Batch]) -> int:
        """The ``shared_prefix`` of one pass whose micro-batch on rank ``r`` is ``batches[r]``:
        the trainer's where every one of them takes the shared prefix, else 0 (the plain
        forward on every rank)."""
        n = self.shared_prefix
        agreed = all(not is_packed(mb) and takes_prefix(mb.input_ids, mb.attention_mask, n)
                     for mb in batches)  # fmt: skip
        return n if agreed else 0

    def _anchor_logprobs(self, full: Batch) -> list[Tensor]:
        """The current policy's logprobs of each of :meth:`_passes`' micro-batches, no
        gradient: the PPO anchor when ``recompute_old_logprobs`` (a collective under FSDP)."""
        cfg = self.config
        chunk = cfg.logprob_chunk_tokens
        out = []
        plan = self._passes(full)
        with torch.no_grad(), _autocast(cfg):
            for mb, prefix in zip(plan.batches, plan.prefix, strict=True):
                mb = mb.to(cfg.device)
                if self.fsdp is not None:
                    out.append(self.fsdp(mb, cfg.temperature, chunk, False, prefix)[0])
                else:
                    out.append(token_logprobs(self.model, mb, cfg.temperature, chunk, prefix))
        return out

    def _reference_logprobs(self, mb: Batch, shared_prefix: int) -> Tensor:
        """The KL reference's logprobs of ``mb`` (a frozen model, or the base under LoRA)."""
        cfg = self.config
        with torch.no_grad(), _autocast(cfg):
            if self.ref_fsdp is not None:
                return self.ref_fsdp(mb, cfg.temperature, cfg.logprob_chunk_tokens, False,
                                     shared_prefix)[0]  # fmt: skip
            if self.ref_model is not None:
                return token_logprobs(self.ref_model, mb, cfg.temperature,
                                      cfg.logprob_chunk_tokens, shared_prefix)  # fmt: skip
        return self.base_logprobs(mb, shared_prefix)

    def _kl_in_reward(self, full: Batch, group_sizes: list[int]) -> tuple[Batch, float]:
        """KL-in-reward: each sample's reward minus ``kl_coef`` times its summed KL
        (behaviour logprobs against the reference), advantages again per group. Returns the
        batch and the summed KL (for the statistics)."""
        cfg = self.config
        # every rank runs the reference on the same (whole) batch: the same model calls
        kl = torch.cat([
            sequence_kl(mb.old_logprobs,
                        self._reference_logprobs(mb.to(cfg.device), self.shared_prefix).cpu(),
                        mb.loss_mask, cfg.kl_estimator)
            for mb in full.micro_batches(cfg.micro_batch_size)
        ])  # fmt: skip
        rewards = full.rewards - cfg.kl_coef * kl
        advantages = torch.cat([
            group_advantages(r, cfg.adv_eps, cfg.advantage_std)
            for r in rewards.split(group_sizes)
        ])  # fmt: skip
        shaped = dataclasses.replace(
            full, rewards=rewards, advantages=advantages[:, None] * full.loss_mask
        )
        return shaped, float(kl.sum())

    def step_batch(
        self,
        full: Batch,
        *,
        reward_mean: float = 0.0,
        groups: int = 0,
        dropped_groups: int = 0,
        started: float | None = None,
        apply: bool = True,
        kl_ref_sum: float = 0.0,
        anchors: list[Tensor] | None = None,
        mode: Mode = "rl",
    ) -> StepStats:
        """One optimiser step on an already built batch (the whole batch on every rank);
        ``apply=False``: the gradient only (see :meth:`step`). ``kl_ref_sum``: the KL
        KL-in-reward took out of the rewards (reported as ``kl_ref``). ``anchors``: with
        ``recompute_old_logprobs``, the PPO anchor of each of :meth:`_passes`' micro-batches
        taken earlier (:meth:`_anchor_logprobs`); None: taken now, before the update.
        ``mode``: the objective (:meth:`step`); the normaliser, passes and collectives are
        the same for both."""
        cfg = self.config
        started = time.perf_counter() if started is None else started
        total_tokens = full.loss_mask.sum().to(cfg.device)  # of the whole batch, every rank
        per_sample = full.loss_mask.sum(-1)
        if cfg.aggregation == "token-mean":
            normalizer = total_tokens
        else:  # the step's sequences with a token to train on
            normalizer = (per_sample > 0).sum().to(cfg.device)
        norm_tokens = cfg.aggregation_tokens or max(int(per_sample.max()), 1)
        clip_high = cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high
        plan = self._passes(full)
        if cfg.recompute_old_logprobs and anchors is None and mode == "rl":
            anchors = self._anchor_logprobs(full)

        # Forward/backward per micro-batch of this rank's shard; each divides by the whole
        # step's token count, so the summed gradient is the full batch's gradient. Under
        # DDP only the last backward all-reduces (the others accumulate under no_sync).
        self.optimizer.zero_grad(set_to_none=True)
        # loss, clip, ratio, kl, kl_ref, entropy, is_clip, mismatch: tokens, k3, ratio
        sums = torch.zeros(_SUMS, dtype=torch.float64)
        extremes = torch.full((2,), -math.inf, dtype=torch.float64)  # -min ratio, max ratio
        ddp = self.ddp
        for i, mb in enumerate(plan.batches):
            last = i == len(plan.batches) - 1
            with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
                weight = 1.0 if i < plan.real else 0.0
                mb_sums, mb_extremes = self._micro_step(
                    mb.to(cfg.device), normalizer, clip_high, weight, norm_tokens,
                    None if anchors is None else anchors[i], plan.prefix[i], mode,
                )
                sums += mb_sums
                extremes = torch.maximum(extremes, mb_extremes)
        sums = dist_util.all_reduce_sum(sums)
        extremes = _all_reduce_max(extremes)

        # Clip, then step only with a finite gradient (the same decision on every rank).
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.fsdp is not None:  # the norm of the shards of every rank
            grad_norm = fsdp.clip_grad_norm_(params, cfg.max_grad_norm)
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm {grad_norm}; weights unchanged")
        lr = cfg.lr * lr_factor(self.steps, cfg.warmup_steps, cfg.lr_decay,
                                cfg.lr_decay_steps, cfg.min_lr_ratio)  # fmt: skip
        if apply:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
            self.steps += 1
        self.optimizer.zero_grad(set_to_none=True)

        tokens = max(float(total_tokens), 1.0)
        loss_sum, clip, ratio, kl, kl_ref, entropy, is_clip, mis_n, mis_k3, mis_r = sums.tolist()
        mis_n = max(mis_n, 1.0)
        seen = bool(sums[7] > 0)
        return StepStats(
            step=self.steps,
            skipped=False,
            loss=loss_sum,
            grad_norm=grad_norm,
            clip_frac=clip / tokens,
            ratio_mean=ratio / tokens,
            approx_kl=kl / tokens,
            kl_ref=(kl_ref + kl_ref_sum) / tokens,
            entropy=entropy / tokens,
            lr=lr,
            is_clip_frac=is_clip / tokens,
            mismatch_kl=mis_k3 / mis_n,
            mismatch_ratio_min=-float(extremes[0]) if seen else 1.0,
            mismatch_ratio_mean=mis_r / mis_n if seen else 1.0,
            mismatch_ratio_max=float(extremes[1]) if seen else 1.0,
            reward_mean=reward_mean,
            groups=groups,
            samples=full.size,
            tokens=int(total_tokens),
            dropped_groups=dropped_groups,
            seconds=time.perf_counter() - started,
        )

    def _micro_batches(self, full: Batch, shard: slice) -> list[Batch]:
        """The micro-batches of ``shard``'s samples: packed by token budget, or by count."""
        if shard.stop == shard.start:
            return []
        rows = full.rows(shard)
        budget = self.config.max_tokens_per_micro_batch
        if budget:
            return list(pack(rows, budget))
        return list(rows.micro_batches(self.config.micro_batch_size))

    def _micro_step(
        self, mb: Batch, normalizer: Tensor, clip_high: float, weight: float = 1.0,
        norm_tokens: int | None = None, anchor: Tensor | None = None, prefix: int = 0,
        mode: Mode = "rl",
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """Forward + backward of one micro-batch; returns its token-weighted statistic sums
        and ``[-min, max]`` of its train-vs-rollout ratio. ``normalizer``: the step's token
        (token-mean) or sequence count. ``weight`` 0 is a padding micro-batch: it takes part
        in DDP's backward passes with a zero gradient and adds nothing to the statistics.
        ``prefix``: the pass's ``shared_prefix`` (:meth:`_passes`). ``mode="sft"``: the
        token cross-entropy at temperature 1 (no ratio: no train-vs-rollout mismatch)."""
        cfg = self.config
        sft = mode == "sft"
        seq_ids = _sequence_ids(mb)
        if sft:
            new_logprobs, entropy = self._forward(mb, 1.0, False, prefix)
            loss, stats = sft_loss(new_logprobs, mb.loss_mask, normalizer, cfg.aggregation,
                                   norm_tokens, seq_ids)  # fmt: skip
        else:
            loss, stats, new_logprobs, entropy = self._policy_loss(
                mb, normalizer, clip_high, norm_tokens, anchor, prefix, seq_ids
            )
        # DDP and FSDP average the gradients over ranks; the loss is already normalised by the
        # whole batch's tokens, so scaling by the world size makes the average the batch's sum.
        (loss * (weight * dist_util.world_size())).backward()
        if weight == 0:
            return torch.zeros(_SUMS, dtype=torch.float64), torch.full((2,), -math.inf)
        n = stats["tokens"]
        # the trainer's logprobs before the update against the generator's (behaviour)
        rollout_mask = torch.zeros_like(mb.loss_mask) if sft else mb.loss_mask
        mis = mismatch(new_logprobs, mb.old_logprobs, rollout_mask).cpu()
        sums = torch.tensor(
            [loss.item(), stats["clip_frac"] * n, stats["ratio_mean"] * n,
             stats["approx_kl"] * n, stats["kl_ref"] * n,
             float((entropy.detach() * mb.loss_mask).sum()), stats["is_clip_frac"] * n,
             float(mis[0]), float(mis[1]), float(mis[2])],
            dtype=torch.float64,
        )  # fmt: skip
        return sums, torch.stack([-mis[3], mis[4]]).to(torch.float64)

    def _forward(
        self, mb: Batch, temperature: float | None, entropy_grad: bool, prefix: int
    ) -> tuple[Tensor, Tensor]:
        """The policy's logprobs and entropies of ``mb`` with the graph, through the wrapper
        that owns the gradient's collectives (FSDP's root gathers the weights, DDP's forward
        arms the all-reduce), else the plain model."""
        cfg = self.config
        chunk = cfg.logprob_chunk_tokens
        with _autocast(cfg):
            if self.fsdp is not None:
                return self.fsdp(mb, temperature, chunk, entropy_grad, prefix)
            if self.ddp is not None:
                return self.ddp(mb, temperature, chunk, entropy_grad, prefix)
            return token_logprobs_and_entropy(self.model, mb, temperature, chunk, entropy_grad,
                                              prefix)  # fmt: skip

    def _policy_loss(
        self, mb: Batch, normalizer: Tensor, clip_high: float, norm_tokens: int | None,
        anchor: Tensor | None, prefix: int, seq_ids: Tensor | None,
    ) -> tuple[Tensor, dict[str, float], Tensor, Tensor]:  # fmt: skip
        """The RL loss of one micro-batch (:func:`learner.loss.policy_loss` with the config's
        menu), its statistics, and the policy's logprobs and entropies it was taken on."""
        cfg = self.config
        old, behaviour = mb.old_logprobs, None
        ref = None
        with torch.no_grad(), _autocast(cfg):
            if anchor is not None:  # recompute_old_logprobs: taken before the update
                old, behaviour = anchor, old
            if cfg.kl_coef > 0 and not cfg.kl_in_reward:  # (KL-in-reward took it before)
                ref = self._reference_logprobs(mb, prefix)
        # the entropy needs a gradient only for the bonus
        new_logprobs, entropy = self._forward(mb, cfg.temperature, cfg.entropy_coef > 0, prefix)
        loss, stats = policy_loss(
            new_logprobs,
            old,
            mb.advantages,
            mb.loss_mask,
            clip_eps_low=cfg.clip_eps,
            clip_eps_high=clip_high,
            tis_cap=cfg.tis_cap,
            behaviour_logprobs=behaviour,
            normalizer=normalizer,
            ref_logprobs=ref,
            kl_coef=cfg.kl_coef,
            kl_estimator=cfg.kl_estimator,
            aggregation=cfg.aggregation,
            max_tokens=norm_tokens,
            objective=cfg.objective,
            is_mode=cfg.is_mode,
            is_level=cfg.is_level,
            is_low=cfg.is_low,
            entropy=entropy,
            entropy_coef=cfg.entropy_coef,
            seq_ids=seq_ids,
        )
        return loss, stats, new_logprobs, entropy


_SUMS = 10
"""Statistics summed over micro-batches and ranks (see :meth:`Trainer.step_batch`)."""


@dataclass(frozen=True)
class _Passes:
    """A rank's forward/backward passes of one step (:meth:`Trainer._passes`)."""

    batches: list[Batch]
    """Its own micro-batches, then padding ones: the same count on every rank."""
    real: int
    """How many of ``batches`` are its own (the rest have loss weight 0)."""
    prefix: list[int]
    """Per pass, the ``shared_prefix`` its forwards take: the same on every rank."""


def _split(groups: list[Trajectory], parts: int) -> list[list[Trajectory]]:
    """``groups`` in order, in ``min(parts, len(groups))`` runs whose sizes differ by <= 1."""
    parts = min(parts, len(groups))
    size, extra = divmod(len(groups), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (i < extra)
        out.append(groups[at : at + n])
        at += n
    return out


def _merge(updates: list[StepStats], seconds: float) -> StepStats:
    """One :class:`StepStats` for a step of several updates: counts summed, the per-token
    means weighted by each update's tokens, the loss and the gradient norm (before
    clipping) averaged over the updates, the mismatch extremes over all of them, the
    learning rate of the first."""
    if len(updates) == 1:
        return dataclasses.replace(updates[0], seconds=seconds)
    tokens = sum(u.tokens for u in updates)
    weights = [u.tokens / max(tokens, 1) for u in updates]

    def mean(field: str) -> float:
        return sum(w * getattr(u, field) for w, u in zip(weights, updates, strict=True))

    first = updates[0]
    return dataclasses.replace(
        first,
        clip_frac=mean("clip_frac"),
        ratio_mean=mean("ratio_mean"),
        approx_kl=mean("approx_kl"),
        kl_ref=mean("kl_ref"),
        entropy=mean("entropy"),
        is_clip_frac=mean("is_clip_frac"),
        mismatch_kl=mean("mismatch_kl"),
        mismatch_ratio_mean=mean("mismatch_ratio_mean"),
        step=updates[-1].step,
        loss=sum(u.loss for u in updates) / len(updates),
        grad_norm=sum(u.grad_norm for u in updates) / len(updates),
        groups=sum(u.groups for u in updates),
        samples=sum(u.samples for u in updates),
        tokens=tokens,
        seconds=seconds,
        mismatch_ratio_min=min(u.mismatch_ratio_min for u in updates),
        mismatch_ratio_max=max(u.mismatch_ratio_max for u in updates),
    )


def _sequence_ids(mb: Batch) -> Tensor | None:
    """The sample of each per-token column of a packed micro-batch (None: one per row)."""
    if not is_packed(mb):
        return None
    seg = mb.attention_mask[:, :-1]
    return torch.arange(seg.shape[0], device=seg.device)[:, None] * (int(seg.max()) + 1) + seg


def _all_reduce_max(values: Tensor) -> Tensor:
    """Element-wise max over the ranks of a small statistics tensor."""
    if not dist_util.is_distributed():
        return values
    import torch.distributed as dist

    out = values.to("cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return out.cpu()
