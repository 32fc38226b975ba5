"""Micro-batches by token budget: several samples packed into one row, none attending another.

Guarantees:
- :func:`pack` keeps every sample of the batch exactly once, in order, and each packed row
  holds at most ``max_tokens`` tokens (a sample longer than that gets a row of its own);
- a packed row is a :class:`~learner.batch.Batch` of one row whose ``attention_mask`` holds
  the index (from 1) of the sample each token belongs to (0 on padding); the per-token
  tensors keep the batch layout (column ``t`` predicts token ``t + 1``), and the column that
  would predict the next sample's first token has ``loss_mask`` 0;
- :func:`model_inputs` turns such a row into per-sample position ids (restarting at 0) and a
  block-diagonal causal mask, so each sample's logprobs are the ones it has alone;
- only samples of one sampling temperature share a row.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from streamrl.learner.batch import Batch

PER_TOKEN = ("loss_mask", "old_logprobs", "advantages")


def pack(batch: Batch, max_tokens: int) -> Iterator[Batch]:
    """Rows of samples whose total length fits ``max_tokens``, first fit in order."""
    row: list[int] = []
    used = 0
    for i in range(batch.size):
        n = int(batch.lengths[i])
        same_t = not row or bool(batch.temperature[i] == batch.temperature[row[0]])
        if row and (used + n > max_tokens or not same_t):
            yield _row(batch, row)
            row, used = [], 0
        row.append(i)
        used += n
    if row:
        yield _row(batch, row)


def _row(batch: Batch, samples: list[int]) -> Batch:
    ids, seg = [], []
    per_token: dict[str, list[Tensor]] = {name: [] for name in PER_TOKEN}
    for k, i in enumerate(samples, start=1):
        n = int(batch.lengths[i])
        ids.append(batch.input_ids[i, :n])
        seg.append(torch.full((n,), k, dtype=torch.int64))
        for name in PER_TOKEN:  # n - 1 own columns, then the boundary column (0)
            col = getattr(batch, name)[i, : n - 1]
            per_token[name] += [col, col.new_zeros(1)]
    total = sum(int(batch.lengths[i]) for i in samples)
    return Batch(
        input_ids=torch.cat(ids)[None],
        attention_mask=torch.cat(seg)[None],
        **{name: torch.cat(parts)[None, : total - 1] for name, parts in per_token.items()},
        temperature=batch.temperature[samples[:1]],
        rewards=batch.rewards[samples].mean()[None],
        lengths=torch.tensor([total], dtype=torch.int64),
    )


def is_packed(batch: Batch) -> bool:
    return bool(batch.attention_mask.max() > 1)


def model_inputs(batch: Batch, dtype: torch.dtype) -> dict[str, Any]:
    """``input_ids``, ``position_ids`` and a 4D additive ``attention_mask`` for a packed
    batch: a token attends to earlier tokens of its own sample only. Padding attends to
    itself alone (no fully masked row, so no NaN in the softmax)."""
    seg = batch.attention_mask
    length = seg.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=seg.device).tril()
    allowed = causal & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] > 0)
    allowed |= torch.eye(length, dtype=torch.bool, device=seg.device)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=seg.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    starts = torch.ones_like(seg)
    starts[:, 1:] = (seg[:, 1:] != seg[:, :-1]).long()
    index = torch.arange(length, device=seg.device).expand_as(seg)
    first = torch.cummax(torch.where(starts.bool(), index, 0), dim=1).values
    return {"input_ids": batch.input_ids, "attention_mask": mask[:, None],
            "position_ids": index - first}  # fmt: skip
