"""One static batch of autoregressive decoding with a KV cache (plain torch, no trio).

Guarantees:
- prompts are left-padded; position ids count real tokens only, so a row's logits do not
  depend on how much padding its batch needed (up to float noise);
- the logprob reported for a token is computed from the very logits it was sampled from:
  ``log_softmax(logits / T)[token]`` (``T = 1`` for greedy rows), never renormalised over the
  top-p nucleus; a teacher-forced forward over prompt + completion reproduces it;
- a row stops at its first stop token (kept) or at its ``max_new_tokens``; finished rows are
  dropped from the batch and the KV cache, so they cost nothing afterwards;
- each sampled row draws from its own ``torch.Generator``: a row's randomness does not depend
  on which other rows share its batch.

Not covered: continuous batching (rows never join a running batch), repetition penalties,
top-k, stop strings.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache


@dataclass(frozen=True)
class Row:
    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    generator: torch.Generator | None = None  # required when temperature > 0


@dataclass
class RowResult:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


def _cache_kwarg(model: Any) -> str:
    """``cache`` in transformers >= 5.x, ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _choose(logp: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Next token per row from tempered log-probabilities ``logp`` [B, V]."""
    chosen = logp.argmax(dim=-1)
    for j, row in enumerate(rows):
        if row.temperature <= 0:
            continue
        probs = logp[j].exp()
        if row.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            nucleus = (sorted_p.cumsum(0) - sorted_p) < row.top_p  # always keeps the top token
            pick = torch.multinomial(sorted_p * nucleus, 1, generator=row.generator)
            chosen[j] = order[pick[0]]
        else:
            chosen[j] = torch.multinomial(probs, 1, generator=row.generator)[0]
    return chosen


@torch.inference_mode()
def decode_batch(
    model: Any,  # a transformers causal LM
    rows: list[Row],
    stop_ids: frozenset[int],
    pad_id: int,
    checkpoint: Callable[[], None] | None = None,
) -> tuple[list[RowResult], int]:
    """Decode ``rows`` together; returns one result per row and the number of forward passes.

    ``checkpoint`` is called before every forward pass and may raise to abort the batch
    (the engine passes ``trio.from_thread.check_cancelled``).
    """
    width = max(len(r.prompt) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row.prompt) :] = torch.as_tensor(list(row.prompt), dtype=torch.long)
        mask[i, width - len(row.prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    temps = torch.tensor([[r.temperature if r.temperature > 0 else 1.0] for r in rows])

    if checkpoint:
        checkpoint()
    kv = DynamicCache(config=model.config)
    cache_kw = {_cache_kwarg(model): kv}
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions,
        use_cache=True, logits_to_keep=1, **cache_kw,
    )
    forwards = 1
    results = [RowResult() for _ in rows]
    active = list(range(len(rows)))  # batch position -> row index
    last_pos = positions[:, -1:]
    while True:
        logp = torch.log_softmax(out.logits[:, -1, :].float() / temps, dim=-1)
        tokens = _choose(logp, [rows[a] for a in active])
        chosen_logp = logp.gather(1, tokens[:, None])[:, 0]
        keep = []
        for j, a in enumerate(active):
            tok = int(tokens[j])
            results[a].tokens.append(tok)
            results[a].logprobs.append(float(chosen_logp[j]))
            if tok in stop_ids:
                results[a].finish_reason = "stop"
            elif len(results[a].tokens) < rows[a].max_new_tokens:
                keep.append(j)
        if not keep:
            return results, forwards
        if len(keep) < len(active):
            index = torch.tensor(keep, dtype=torch.long)
            kv.batch_select_indices(index)
            mask, last_pos = mask[index], last_pos[index]
            tokens, temps = tokens[index], temps[index]
            active = [active[j] for j in keep]
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
        last_pos = last_pos + 1
        if checkpoint:
            checkpoint()
        out = model(
            input_ids=tokens[:, None], attention_mask=mask, position_ids=last_pos,
            use_cache=True, **cache_kw,
        )
        forwards += 1
