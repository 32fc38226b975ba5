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
  on which other rows share its batch;
- weights may change between two decoding steps (``weights`` hook): the running rows go on
  under the new weights from a fresh prefill of prompt + tokens so far (the old KV cache was
  computed by the old weights), so every logprob is exactly the new weights' teacher-forced
  one; each token records the version of the weights whose logits it was sampled from;
- a row whose ``aborted`` flag is set ends before the next step with what it has so far
  (``finish_reason == "abort"``), the others go on.

- prefill costs the batch's distinct prompt tokens, not rows x longest prompt: identical
  prompts (a group's samples) are prefilled once and their cache rows copied, and the
  distinct ones are prefilled in buckets of similar length (padding within a bucket at most
  a quarter of its tokens), then laid into one left-padded cache; the logits are those of the
  plain padded prefill up to float noise (``tests/inference/test_decode_prefill.py``).
  Models whose cache is not plain per-layer key/value tensors (sliding-window or recurrent
  layers) take the plain padded prefill.

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
from transformers.cache_utils import DynamicLayer

from streamrl.learner.model import route_transformers_logging

route_transformers_logging()  # its records as JSON lines too (runtime/logs.py)


@dataclass(frozen=True)
class Row:
    prompt: Sequence[int]
    max_new_tokens: int
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0
    generator: torch.Generator | None = None  # required when temperature > 0
    aborted: Callable[[], bool] | None = None  # polled before every step (any thread may set)


@dataclass
class RowResult:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # weight version of each token
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


PREFILL_SLACK = 1.25
"""A prefill bucket's padded tokens are at most this times its real tokens (plus one row)."""
PREFILL_TOKENS = 8192
"""Padded tokens per prefill forward pass, at most (one prompt longer than this goes alone)."""


def _padded(seqs: Sequence[Sequence[int]], pad_id: int, width: int | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-padded ``(input ids, attention mask, position ids)`` of ``seqs``."""
    width = width or max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, seq in enumerate(seqs):
        ids[i, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
        mask[i, width - len(seq) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _forward(model: Any, seqs: Sequence[Sequence[int]], pad_id: int
             ) -> tuple[torch.Tensor, DynamicCache]:
    """One left-padded forward over ``seqs``: ``(last logits [B, V], cache)``."""
    ids, mask, positions = _padded(seqs, pad_id)
    kv = DynamicCache(config=model.config)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions,
        use_cache=True, logits_to_keep=1, **{_cache_kwarg(model): kv},
    )
    return out.logits[:, -1, :], kv


def _plain_layers(kv: DynamicCache) -> bool:
    return all(type(layer) is DynamicLayer for layer in kv.layers)


def _tensors(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A filled plain layer's ``(keys, values)``, each ``[rows, heads, width, dim]``."""
    assert isinstance(layer, DynamicLayer) and layer.keys is not None and layer.values is not None
    return layer.keys, layer.values


def prefill_buckets(lengths: Sequence[int], slack: float = PREFILL_SLACK,
                    budget: int = PREFILL_TOKENS) -> list[list[int]]:
    """Indices of ``lengths`` grouped for prefill: by increasing length, each bucket as long
    as its padded size stays within ``slack`` times its real tokens (plus one row's worth)
    and within ``budget`` padded tokens."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    buckets: list[list[int]] = []
    real = 0
    for i in order:
        n = lengths[i]  # the longest so far: sorted ascending
        if buckets:
            rows = len(buckets[-1]) + 1
            if rows * n <= slack * (real + n) + n and rows * n <= budget:
                buckets[-1].append(i)
                real += n
                continue
        buckets.append([i])
        real = n
    return buckets


def _prefill(model: Any, seqs: list[list[int]], pad_id: int
             ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
    """Prefill ``seqs``: ``(last logits [B, V], cache, attention mask, last position)``, the
    cache and mask left-padded to the longest sequence. Identical sequences are computed once;
    the distinct ones in buckets of similar length (:func:`prefill_buckets`)."""
    distinct: dict[tuple[int, ...], int] = {}
    rows = [distinct.setdefault(tuple(s), len(distinct)) for s in seqs]
    unique = list(distinct)
    _, mask, positions = _padded(seqs, pad_id)
    width = mask.shape[1]
    buckets = prefill_buckets([len(s) for s in unique])
    if len(unique) == len(seqs) and len(buckets) == 1:  # nothing to save: one plain forward
        logits, kv = _forward(model, seqs, pad_id)
        return logits, kv, mask, positions[:, -1:]
    parts = [(bucket, *_forward(model, [unique[i] for i in bucket], pad_id))
             for bucket in buckets]
    if not all(_plain_layers(kv) for _, _, kv in parts):
        logits, kv = _forward(model, seqs, pad_id)
        return logits, kv, mask, positions[:, -1:]
    logits = torch.empty((len(unique), parts[0][1].shape[-1]), dtype=parts[0][1].dtype)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for bucket, bucket_logits, kv in parts:
        index = torch.tensor(bucket, dtype=torch.long)
        logits[index] = bucket_logits
        for n, layer in enumerate(kv.layers):
            keys, values = _tensors(layer)  # the bucket's own width
            if n == len(layers):
                shape = (len(unique), keys.shape[1], width, keys.shape[3])
                layers.append((keys.new_zeros(shape), values.new_zeros(
                    (len(unique), values.shape[1], width, values.shape[3]))))
            # the bucket is left-padded to its own width: right-aligned in the full width,
            # its padding falls where the full mask is 0 as well
            layers[n][0][index, :, width - keys.shape[2]:] = keys
            layers[n][1][index, :, width - values.shape[2]:] = values
    cache = DynamicCache(config=model.config)
    for n, (keys, values) in enumerate(layers):
        cache.update(keys, values, n)
    if len(unique) < len(seqs):  # copy the shared rows out
        expand = torch.tensor(rows, dtype=torch.long)
        cache.batch_select_indices(expand)
        logits = logits[expand]
    return logits, cache, mask, positions[:, -1:]


@torch.inference_mode()
def decode_batch(
    model: Any,  # a transformers causal LM
    rows: list[Row],
    stop_ids: frozenset[int],
    pad_id: int,
    checkpoint: Callable[[], None] | None = None,
    weights: Callable[[], int] | None = None,
) -> tuple[list[RowResult], int]:
    """Decode ``rows`` together; returns one result per row and the number of forward passes.

    ``checkpoint`` is called before every forward pass and may raise to abort the batch
    (the engine passes ``trio.from_thread.check_cancelled``). ``weights`` is called before
    every decoding step; it may swap the model's weights and returns the version of the
    weights the next forward pass uses (without it every token is version 0).
    """
    results = [RowResult() for _ in rows]
    active = [a for a in range(len(rows)) if not _aborted(rows[a], results[a])]
    if not active:
        return results, 0
    if checkpoint:
        checkpoint()
    version = weights() if weights else 0
    logits, kv, mask, last_pos = _prefill(model, [list(rows[a].prompt) for a in active],
                                          pad_id)
    temps = torch.tensor([[rows[a].temperature if rows[a].temperature > 0 else 1.0]
                          for a in active])
    forwards = 1
    while True:
        logp = torch.log_softmax(logits.float() / temps, dim=-1)
        tokens = _choose(logp, [rows[a] for a in active])
        chosen_logp = logp.gather(1, tokens[:, None])[:, 0]
        keep = []
        for j, a in enumerate(active):
            tok = int(tokens[j])
            results[a].tokens.append(tok)
            results[a].logprobs.append(float(chosen_logp[j]))
            results[a].versions.append(version)
            if tok in stop_ids:
                results[a].finish_reason = "stop"
            elif len(results[a].tokens) < rows[a].max_new_tokens and \
                    not _aborted(rows[a], results[a]):
                keep.append(j)
        if not keep:
            return results, forwards
        if len(keep) < len(active):
            index = torch.tensor(keep, dtype=torch.long)
            kv.batch_select_indices(index)
            mask, last_pos = mask[index], last_pos[index]
            tokens, temps = tokens[index], temps[index]
            active = [active[j] for j in keep]
        if checkpoint:
            checkpoint()
        current = weights() if weights else version
        if current != version:  # new weights: rebuild the cache under them
            version = current
            seqs = [[*rows[a].prompt, *results[a].tokens] for a in active]
            logits, kv, mask, last_pos = _prefill(model, seqs, pad_id)
            forwards += 1
            continue
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
        last_pos = last_pos + 1
        logits = model(
            input_ids=tokens[:, None], attention_mask=mask, position_ids=last_pos,
            use_cache=True, **{_cache_kwarg(model): kv},
        ).logits[:, -1, :]
        forwards += 1


def _aborted(row: Row, result: RowResult) -> bool:
    if row.aborted is not None and row.aborted():
        result.finish_reason = "abort"
        return True
    return False
