"""Per-token logprobs and entropies from final hidden states, a chunk of tokens at a time.

Guarantees:
- the full-vocabulary logits of a micro-batch never exist at once: the vocabulary projection,
  the log-softmax and the entropy run on ``chunk_tokens`` tokens at a time, and each chunk is
  checkpointed (only its hidden states are kept for the backward pass, its ``[chunk, V]``
  logits are recomputed there), so peak logits memory is one chunk's, forward and backward;
- the result is the unchunked one (same values and gradients, up to float summation order)
  for every ``chunk_tokens``;
- the logits are the model's own (``model(...).logits``), not bare ``lm_head(hidden)``:
  :func:`logit_transform` applies what the Hugging Face causal-LM heads do after the
  projection, read from the config: ``logit_scale`` (Cohere: multiply),
  ``logits_scaling`` (Granite: divide) and ``final_logit_softcapping`` (Gemma 2/3:
  ``cap * tanh(logits / cap)``). A model whose forward does anything else after
  ``lm_head`` is not covered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

Transform = Callable[[Tensor], Tensor]


def logit_transform(config: Any) -> Transform:
    """What ``model.forward`` does to ``lm_head(hidden)`` before returning the logits."""
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    divide = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2/3

    def transform(logits: Tensor) -> Tensor:
        if isinstance(scale, (int, float)):
            logits = logits * scale
        if isinstance(divide, (int, float)):
            logits = logits / divide
        if isinstance(cap, (int, float)):
            logits = torch.tanh(logits / cap) * cap
        return logits

    return transform


def _chunk(
    head: torch.nn.Module,
    transform: Transform,
    hidden: Tensor,
    targets: Tensor,
    inv_t: Tensor,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    logits = transform(head(hidden).float()) * inv_t[:, None]  # [n, V] fp32
    log_z = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets[:, None]).squeeze(-1) - log_z
    # Without a gradient the entropy saves nothing for backward: a recomputed chunk's saved
    # tensors that no backward consumes would stay alive until the end of the backward pass,
    # every chunk's ``[n, V]`` softmax at once.
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return picked, entropy


def chunked_logprobs(
    head: torch.nn.Module,
    hidden: Tensor,
    targets: Tensor,
    temperature: Tensor,
    transform: Transform = lambda x: x,
    chunk_tokens: int = 1024,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """``log_softmax(transform(head(hidden)) / T)[target]`` and the entropy of that
    distribution, per token. ``hidden`` is ``[N, H]``, ``targets`` and ``temperature``
    ``[N]``; returns two fp32 ``[N]`` tensors; the logprobs carry the graph when grad is
    enabled, the entropies only with ``entropy_grad`` (an entropy bonus)."""
    inv_t = 1.0 / temperature.to(device=hidden.device, dtype=torch.float32)
    lps, ents = [], []
    # at least one chunk, empty for no token: the (empty) result still depends on ``head``
    # and ``hidden``, so a backward pass gives every parameter a zero gradient instead of
    # failing, and a sharded model's ranks reduce the same gradients (learner.fsdp)
    for start in range(0, max(hidden.shape[0], 1), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        args = (head, transform, hidden[part], targets[part], inv_t[part], entropy_grad)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _chunk(*args)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), torch.cat(ents)
