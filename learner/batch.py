"""From verified groups (``Trajectory`` messages) to the padded tensors one training step reads.

Guarantees:
- a group is kept or dropped whole (staleness: :mod:`protocol.staleness`), never partially;
- every per-token tensor of a :class:`Batch` is aligned to next-token *predictions*: column
  ``t`` describes the token ``input_ids[:, t + 1]``, predicted by the logits at position
  ``t``. So ``logits[:, :-1]`` lines up with ``loss_mask``, ``old_logprobs`` and
  ``advantages`` without further shifting;
- ``loss_mask`` is 1 exactly on the completion tokens the policy sampled: never on prompt
  tokens, never on padding (padding is found by length, not by token id, because the pad
  token is usually EOS, which a completion may legitimately end with), and never on the
  observation tokens of a multi-turn episode (``Sample.mask`` 0: what the sandbox answered,
  wrapped in the chat template, is context, not action).

Layout of sample ``i`` with a prompt of P tokens and a completion of C tokens::

    input_ids[i]    p0 p1 .. p{P-1} c0 c1 .. c{C-1} pad ..
    loss_mask[i]     0  0 ..  1      1  1 ..  0      0  ..    (1 at columns P-1 .. P+C-2)
    old_logprobs[i]  0  0 .. lp0    lp1 lp2 .. 0     0  ..

In a multi-turn sample the completion is the whole episode after the prompt (turns and
observations); column ``P - 1 + j`` of ``loss_mask`` is ``Sample.mask[j]``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from streamrl.learner.loss import group_advantages
from streamrl.learner.shaping import soft_length_penalty

if TYPE_CHECKING:
    from streamrl.protocol.messages import Trajectory

# The wire types are imported where they are used, so that ``Batch`` and the training step
# on a ready batch need only torch (benchmarks/gpu/check.py runs without msgspec).


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors for B samples; per-token tensors have L - 1 columns (see module)."""

    input_ids: Tensor  # [B, L] int64
    attention_mask: Tensor  # [B, L] int64, 1 on prompt and completion tokens
    loss_mask: Tensor  # [B, L-1] float32
    old_logprobs: Tensor  # [B, L-1] float32, behaviour logprobs
    advantages: Tensor  # [B, L-1] float32, the sample's advantage on its loss tokens
    temperature: Tensor  # [B] float32, the sampling temperature of each sample
    rewards: Tensor  # [B] float32
    lengths: Tensor  # [B] int64, prompt + completion tokens

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def target_ids(self) -> Tensor:
        """The token each column of the per-token tensors is about: ``input_ids[:, 1:]``."""
        return self.input_ids[:, 1:]

    def to(self, device: torch.device | str) -> Batch:
        return Batch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def rows(self, rows: slice) -> Batch:
        """Samples ``rows`` (e.g. one rank's shard), trimmed to their own longest sample."""
        width = int(self.lengths[rows].max())
        return Batch(
            input_ids=self.input_ids[rows, :width],
            attention_mask=self.attention_mask[rows, :width],
            loss_mask=self.loss_mask[rows, : width - 1],
            old_logprobs=self.old_logprobs[rows, : width - 1],
            advantages=self.advantages[rows, : width - 1],
            temperature=self.temperature[rows],
            rewards=self.rewards[rows],
            lengths=self.lengths[rows],
        )

    def micro_batches(self, size: int) -> Iterator[Batch]:
        """Consecutive slices of ``size`` samples, each trimmed to its own longest sample."""
        for start in range(0, self.size, size):
            yield self.rows(slice(start, start + size))


def has_signal(trajectory: Trajectory) -> bool:
    """False for a group whose rewards are all equal: every advantage is zero."""
    return len(set(trajectory.rewards)) > 1


def build_batch(
    trajectories: Sequence[Trajectory],
    pad_id: int = 0,
    eps: float = 1e-6,
    *,
    std_normalize: bool = True,
    overlong_filter: bool = False,
    length_penalty_tokens: int = 0,
) -> Batch:
    """Pad every sample of every group into one :class:`Batch` (groups in order, samples in
    order). Advantages are computed per group with :func:`group_advantages`
    (``std_normalize`` off: Dr. GRPO's ``r - mean(r)``).

    ``overlong_filter``: a sample that stopped at its token limit (``finish_reason ==
    "length"``) trains on no token (DAPO's overlong filtering; its reward still counts in its
    group's baseline). ``length_penalty_tokens`` > 0: the reward of a single-turn sample gets
    :func:`learner.shaping.soft_length_penalty` over that many tokens before its task's
    ``max_new_tokens`` (multi-turn episodes, whose budget is per turn, are left alone);
    ``Batch.rewards`` holds the shaped reward.

    Raises ``ValueError`` for an empty list and for malformed groups: no samples, a reward
    count that differs from the sample count, logprobs that do not match the tokens one for
    one, an empty prompt, or a sampling temperature <= 0 (greedy decoding has no logprobs to
    train on).
    """
    from streamrl.protocol.messages import bytes_to_floats, bytes_to_ids

    rows: list[tuple[Tensor, Tensor, Tensor, Tensor, float, float, float]] = []
    for traj in trajectories:
        rollout = traj.rollout
        if not rollout.samples or len(traj.rewards) != len(rollout.samples):
            raise ValueError(
                f"trajectory {traj.id}: {len(rollout.samples)} samples, {len(traj.rewards)} rewards"
            )
        temperature = rollout.task.sampling.temperature
        if temperature <= 0:
            raise ValueError(f"trajectory {traj.id}: sampling temperature {temperature} <= 0")
        prompt = torch.from_numpy(bytes_to_ids(rollout.prompt_ids).astype("int64"))
        if prompt.numel() == 0:
            raise ValueError(f"trajectory {traj.id}: empty prompt")
        rewards = torch.tensor(traj.rewards)
        if length_penalty_tokens and rollout.task.episode is None:
            lengths = torch.tensor([len(s.tokens) // 4 for s in rollout.samples])
            budget = torch.tensor(rollout.task.sampling.max_new_tokens)
            rewards = rewards + soft_length_penalty(lengths, budget, length_penalty_tokens)
        advantages = group_advantages(rewards, eps, std_normalize)
        for sample, adv, reward in zip(
            rollout.samples, advantages.tolist(), rewards.tolist(), strict=True
        ):
            tokens = torch.from_numpy(bytes_to_ids(sample.tokens).astype("int64"))
            logprobs = torch.from_numpy(bytes_to_floats(sample.logprobs).copy())
            if tokens.numel() != logprobs.numel():
                raise ValueError(
                    f"trajectory {traj.id}: {tokens.numel()} tokens, {logprobs.numel()} logprobs"
                )
            if sample.mask:
                trained = torch.frombuffer(bytearray(sample.mask), dtype=torch.uint8).float()
                if trained.numel() != tokens.numel():
                    raise ValueError(f"trajectory {traj.id}: {tokens.numel()} tokens, "
                                     f"{trained.numel()} mask entries")
            else:
                trained = torch.ones(tokens.numel(), dtype=torch.float32)
            if overlong_filter and sample.finish_reason == "length":
                trained = torch.zeros_like(trained)
            rows.append((prompt, tokens, logprobs, trained, adv, temperature, float(reward)))

    if not rows:
        raise ValueError("no trajectories to build a batch from")
    width = max(len(p) + len(c) for p, c, *_ in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((n, width), dtype=torch.int64)
    loss_mask = torch.zeros((n, width - 1), dtype=torch.float32)
    old_logprobs = torch.zeros((n, width - 1), dtype=torch.float32)
    advantages = torch.zeros((n, width - 1), dtype=torch.float32)
    for i, (prompt, tokens, logprobs, trained, adv, _, _) in enumerate(rows):
        p, c = len(prompt), len(tokens)
        input_ids[i, :p] = prompt
        input_ids[i, p : p + c] = tokens
        attention_mask[i, : p + c] = 1
        # completion token j sits at column p + j and is predicted from column p + j - 1
        loss_mask[i, p - 1 : p - 1 + c] = trained
        old_logprobs[i, p - 1 : p - 1 + c] = logprobs * trained
        advantages[i, p - 1 : p - 1 + c] = adv * trained
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        old_logprobs=old_logprobs,
        advantages=advantages,
        temperature=torch.tensor([r[5] for r in rows], dtype=torch.float32),
        rewards=torch.tensor([r[6] for r in rows], dtype=torch.float32),
        lengths=attention_mask.sum(dim=1),
    )
