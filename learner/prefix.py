"""The training forward with a micro-batch's shared prefix computed once.

A GRPO group is one prompt and several completions, so a micro-batch of one group's samples
has rows that begin with the same tokens (the chat template, the instructions, the task).
The plain forward runs every row's copy of that prefix through every layer, forward and
backward. :func:`hidden_states` runs the prefix once as a one-row batch keeping its keys and
values, then every row's own tokens after it, attending to the prefix's keys and values
expanded to all rows (a view; the attention concatenates it with each row's own). The
gradient flows back through the expansion, which sums the rows' contributions to the
prefix: the result equals the plain forward's up to float noise, value and gradient
(tests/learner/test_prefix.py). With ``P`` shared tokens, ``B`` rows and ``C`` tokens after
them per row, the layers process ``P + B * C`` positions instead of ``B * (P + C)``
(``benchmarks/learner_step.py``).

It applies to right-padded micro-batches (every row's first token at position 0) whose rows
share at least ``min_tokens`` leading tokens, all attended; packed micro-batches
(:mod:`learner.packing`) and models whose cache is not plain per-layer keys and values take
the plain forward.

The prefix forward calls the model twice, the plain one once, and under FSDP each call is a
sequence of collectives (every layer's all-gather, and in the backward its reduce-scatter):
the ranks of a sharded model must agree on the path of each micro-batch, or they wait in
different collectives for ever. :func:`takes_prefix` is the decision; the trainer takes it
for every rank's micro-batch (all ranks hold the whole batch) and passes ``min_tokens = 0``
to all of them unless all of them take the prefix (:meth:`learner.train.Trainer._passes`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from streamrl.inference.decode import cache_kwarg, expand_rows, plain_layers

MIN_SHARED_TOKENS = 16
"""The default least shared prefix worth a separate forward (``TrainConfig.shared_prefix``)."""


def shared_prefix_length(input_ids: Tensor, attention_mask: Tensor) -> int:
    """How many leading tokens every row has alike and attended, at most one less than the
    width (at least one position per row is computed after the prefix). 0 for one row."""
    rows, width = input_ids.shape
    if rows < 2 or width < 2:
        return 0
    same = ((input_ids == input_ids[:1]) & attention_mask.bool()).all(0)
    differs = (~same).nonzero()
    length = int(differs[0, 0]) if len(differs) else width
    return min(length, width - 1)


def takes_prefix(input_ids: Tensor, attention_mask: Tensor, min_tokens: int) -> bool:
    """Whether :func:`hidden_states` computes this right-padded micro-batch's shared prefix
    once (two model calls: at least ``min_tokens`` > 0 shared tokens) rather than the plain
    forward (one call). The same answer for the same tensors on any rank."""
    return min_tokens > 0 and shared_prefix_length(input_ids, attention_mask) >= min_tokens


def hidden_states(base: Any, input_ids: Tensor, attention_mask: Tensor, min_tokens: int
                  ) -> Tensor:
    """The last hidden states ``[B, L, H]`` of ``base`` (a decoder's base model, e.g.
    ``model.base_model``) on a right-padded micro-batch: the shared prefix computed once when
    it has at least ``min_tokens`` tokens (0: never), else the plain forward."""

    def plain() -> Tensor:
        return base(input_ids=input_ids, attention_mask=attention_mask,
                    use_cache=False).last_hidden_state  # fmt: skip

    if not takes_prefix(input_ids, attention_mask, min_tokens):
        return plain()
    prefix = shared_prefix_length(input_ids, attention_mask)
    head = base(input_ids=input_ids[:1, :prefix], use_cache=True)
    if head.past_key_values is None or not plain_layers(head.past_key_values):
        return plain()  # no cache (activation checkpointing), or sliding-window layers
    rows, width = input_ids.shape
    positions = torch.arange(prefix, width, device=input_ids.device).expand(rows, -1)
    tail = base(
        input_ids=input_ids[:, prefix:], attention_mask=attention_mask, position_ids=positions,
        use_cache=True, **{cache_kwarg(base): expand_rows(head.past_key_values, rows, base.config)},
    )  # fmt: skip
    shared = head.last_hidden_state.expand(rows, -1, -1)
    return torch.cat([shared, tail.last_hidden_state], dim=1)
