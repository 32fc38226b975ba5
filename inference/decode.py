"""One static batch of autoregressive decoding with a KV cache (plain torch, no trio).

Guarantees:
- position ids count real tokens only and padding is masked out, so a row's logits do not
  depend on how much padding its batch needed or where it sits (up to float noise);
- the logprob reported for a token is computed from the very logits it was sampled from:
  ``log_softmax(logits / T)[token]`` (``T = 1`` for greedy rows), never renormalised over the
  top-p nucleus; a teacher-forced forward over prompt + completion reproduces it;
- a row stops at its first stop token (kept) or at its ``max_new_tokens``; finished rows are
  dropped from the batch and the KV cache, so they cost nothing afterwards;
- each sampled row draws from its own ``torch.Generator`` (one uniform number a token,
  inverted through the row's cumulative distribution): a row's randomness does not depend on
  which other rows share its batch;
- weights may change between two decoding steps (``weights`` hook): the running rows go on
  under the new weights from a fresh prefill of prompt + tokens so far (the old KV cache was
  computed by the old weights), so every logprob is exactly the new weights' teacher-forced
  one; each token records the version of the weights whose logits it was sampled from;
- a row whose ``aborted`` flag is set ends before the next step with what it has so far
  (``finish_reason == "abort"``), the others go on.

- prefill costs the batch's distinct prompt tokens, not rows x longest prompt: identical
  prompts (a group's samples) are prefilled once and their cache rows copied; distinct
  prompts that begin with the same tokens (a domain's chat template and instructions: 30 of
  the demo's 43-66) prefill that prefix once; the rest are prefilled in buckets of similar
  length (padding within a bucket at most a quarter of its tokens), then laid into one cache
  (a row's shared prefix on the left, its own tokens on the right, padding between); the
  logits are those of the plain left-padded prefill up to float noise
  (``tests/inference/test_decode_prefill.py``). Models whose cache is not plain per-layer
  key/value tensors (sliding-window or recurrent layers) take the plain padded prefill;
- a decoding step appends its token to the cache in place (:class:`GrowingLayer`), not by
  concatenation.

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

from streamrl.models import route_transformers_logging

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


def cache_kwarg(model: Any) -> str:
    """``cache`` in transformers >= 5.x, ``past_key_values`` before."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def sample_inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs`` [B, V] (non-negative, each row's sum > 0, not necessarily
    normalised), drawn by inverting the row's cumulative distribution at ``uniform`` [B] in
    [0, 1): index ``i`` is drawn with probability ``probs[i] / sum``. A zero-probability index
    is never drawn (the first index whose cumulative sum exceeds the target has mass). One
    float64 cumulative sum and a binary search per row: ``torch.multinomial`` costs a
    full-vocabulary exponential draw per call (14% of a 48-row training batch's time on one
    CPU thread, profiled; ``benchmarks/decode.py``)."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniform.double()[:, None] * total, total.nextafter(total.new_zeros(())))
    return torch.searchsorted(cdf, target, right=True)[:, 0].clamp(max=probs.shape[-1] - 1)


def _choose(logp: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Next token per row from tempered log-probabilities ``logp`` [B, V]: argmax for greedy
    rows, a draw from the row's own generator for the others (over the top-p nucleus, sorted
    by probability, when ``top_p < 1``)."""
    chosen = logp.argmax(dim=-1)
    sampled = [j for j, row in enumerate(rows) if row.temperature > 0]
    if not sampled:
        return chosen
    uniform = torch.cat([torch.rand(1, generator=rows[j].generator, dtype=torch.float64)
                         for j in sampled])
    full = [n for n, j in enumerate(sampled) if rows[j].top_p >= 1.0]
    if full:
        index = torch.tensor([sampled[n] for n in full], dtype=torch.long)
        chosen[index] = sample_inverse_cdf(logp[index].exp(), uniform[full])
    for n, j in enumerate(sampled):
        if rows[j].top_p < 1.0:
            sorted_p, order = logp[j].exp().sort(descending=True)
            nucleus = (sorted_p.cumsum(0) - sorted_p) < rows[j].top_p  # always keeps the top
            pick = sample_inverse_cdf((sorted_p * nucleus)[None], uniform[n : n + 1])
            chosen[j] = order[pick[0]]
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


class GrowingLayer(DynamicLayer):
    """A plain key/value cache layer whose ``keys`` and ``values`` are views of buffers with
    ``reserve`` spare positions: appending a decoding step's token writes it in place.
    ``DynamicLayer`` concatenates, copying the whole cache of every layer at every step (the
    profiler put 13% of a 48-row batch's time on one CPU thread in concatenations, these and
    the rotary embedding's; ``benchmarks/decode.py``). A step past the reserve reallocates,
    with ``reserve`` or the length so far spare, whichever is more."""

    def __init__(self, reserve: int) -> None:
        super().__init__()
        self.reserve = reserve
        self._length = 0
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self._length, self._length + key_states.shape[-2]
        if self._buffers is None or end > self._buffers[0].shape[-2]:
            spare = max(self.reserve, start)
            grown = []
            for old, new in ((self.keys, key_states), (self.values, value_states)):
                rows, heads, _, dim = new.shape
                buffer = new.new_empty((rows, heads, end + spare, dim))
                if start and old is not None:
                    buffer[:, :, :start] = old
                grown.append(buffer)
            self._buffers = (grown[0], grown[1])
        keys, values = self._buffers
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self._length = end
        self.keys, self.values = keys[:, :, :end], values[:, :, :end]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._buffers is not None:
            self._buffers = (self._buffers[0][indices], self._buffers[1][indices])
            self.keys = self._buffers[0][:, :, : self._length]
            self.values = self._buffers[1][:, :, : self._length]

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("decode never crops its cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("decode never repeats its cache rows")

    def reset(self) -> None:
        self._length, self._buffers = 0, None
        super().reset()


def _new_cache(model: Any, reserve: int) -> DynamicCache:
    """An empty cache for ``model``: :class:`GrowingLayer` layers when the model's are plain
    key/value layers (``reserve`` positions ahead), its own layer types otherwise."""
    kv = DynamicCache(config=model.config)
    if plain_layers(kv):
        kv.layers = [GrowingLayer(reserve) for _ in kv.layers]
    return kv


def _forward(model: Any, seqs: Sequence[Sequence[int]], pad_id: int, reserve: int = 0
             ) -> tuple[torch.Tensor, DynamicCache]:
    """One left-padded forward over ``seqs``: ``(last logits [B, V], cache)``, the cache with
    room for ``reserve`` more positions."""
    ids, mask, positions = _padded(seqs, pad_id)
    kv = _new_cache(model, reserve)
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=positions,
        use_cache=True, logits_to_keep=1, **{cache_kwarg(model): kv},
    )
    return out.logits[:, -1, :], kv


def plain_layers(kv: DynamicCache) -> bool:
    return bool(kv.layers) and all(type(layer) in (DynamicLayer, GrowingLayer)
                                   for layer in kv.layers)


def expand_rows(prefix: DynamicCache, rows: int, config: Any) -> DynamicCache:
    """A cache of ``rows`` rows that each hold the one-row cache ``prefix`` (plain layers):
    views of its keys and values (``expand``), copied only when a forward appends to them,
    and differentiable, so a backward pass sums the rows' gradients into the prefix's."""
    kv = DynamicCache(config=config)
    for n, layer in enumerate(prefix.layers):
        keys, values = _tensors(layer)
        kv.update(keys.expand(rows, -1, -1, -1), values.expand(rows, -1, -1, -1), n)
    return kv


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


MIN_SHARED_PREFIX = 16
"""Distinct prompts that begin with at least this many identical tokens prefill them once."""


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def prefix_groups(seqs: Sequence[Sequence[int]], min_prefix: int = MIN_SHARED_PREFIX
                  ) -> list[tuple[int, list[int]]]:
    """``(shared prefix length, indices)`` of ``seqs`` (distinct sequences) grouped for
    prefill: the members of a group begin with the same ``prefix length`` tokens (at least
    ``min_prefix``, and each keeps one token of its own); a sequence that shares no such
    prefix is a group of its own with prefix 0. Neighbours in sorted order are grouped, and a
    sequence joins the group before it only if the tokens the group saves do not fall
    (``members x prefix``, the prefix computed once instead of ``members + 1`` times)."""
    groups: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(seqs)), key=lambda i: list(seqs[i])):
        if groups:
            shared, members = groups[-1]
            first = seqs[members[0]]
            cap = shared if len(members) > 1 else len(first) - 1
            joint = min(_common(first, seqs[i]), len(seqs[i]) - 1, cap)
            if joint >= min_prefix and len(members) * joint >= (len(members) - 1) * shared:
                groups[-1] = (joint, [*members, i])
                continue
        groups.append((0, [i]))
    return groups


def _forward_after(model: Any, prefix: DynamicCache, seqs: Sequence[Sequence[int]],
                   pad_id: int) -> tuple[torch.Tensor, DynamicCache]:
    """A left-padded forward over ``seqs``, each continuing the one-row cache ``prefix``:
    ``(last logits [B, V], cache)``, the cache's width the prefix's plus the longest of
    ``seqs`` (the padding between the prefix and a shorter sequence masked out)."""
    ids, mask, positions = _padded(seqs, pad_id)
    kv = expand_rows(prefix, len(seqs), model.config)
    shared = kv.get_seq_length()
    out = model(
        input_ids=ids, attention_mask=torch.cat([mask.new_ones((len(seqs), shared)), mask], 1),
        position_ids=positions + shared, use_cache=True, logits_to_keep=1,
        **{cache_kwarg(model): kv},
    )
    return out.logits[:, -1, :], kv


def _prefill(model: Any, seqs: list[list[int]], pad_id: int, reserve: int = 0
             ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
    """Prefill ``seqs``: ``(last logits [B, V], cache, attention mask, last position)``, the
    cache and mask as wide as the longest sequence, the cache with room for ``reserve`` more
    positions. Identical sequences are computed once. Distinct ones that begin alike (a
    domain's chat template and instructions) compute their shared prefix once
    (:func:`prefix_groups`) and their own tokens after it; the rest, and the parts after a
    prefix, in buckets of similar length (:func:`prefill_buckets`). A row's layout in the
    cache is its shared prefix (if any) on the left, its other tokens on the right, padding
    (mask 0) between: the logits are those of the plain left-padded prefill up to float
    noise. Models whose cache is not plain per-layer key/value tensors (sliding-window or
    recurrent layers) take the plain left-padded prefill."""
    distinct: dict[tuple[int, ...], int] = {}
    rows = [distinct.setdefault(tuple(s), len(distinct)) for s in seqs]
    unique = list(distinct)
    width = max(len(s) for s in unique)
    last = torch.tensor([[len(s) - 1] for s in seqs], dtype=torch.long)
    plain = plain_layers(DynamicCache(config=model.config))
    groups = prefix_groups(unique) if plain else [(0, list(range(len(unique))))]
    alone = [i for shared, members in groups if not shared for i in members]
    buckets = prefill_buckets([len(unique[i]) for i in alone])
    if not plain or (len(alone) == len(seqs) and len(buckets) == 1):
        logits, kv = _forward(model, seqs, pad_id, reserve)  # nothing to save: plain forward
        return logits, kv, _padded(seqs, pad_id)[1], last
    # (rows of unique, their shared prefix length, last logits, cache)
    parts = [([alone[j] for j in bucket], 0,
              *_forward(model, [unique[alone[j]] for j in bucket], pad_id))
             for bucket in buckets]
    for shared, members in groups:
        if not shared:
            continue
        _, prefix = _forward(model, [unique[members[0]][:shared]], pad_id)
        rest = [unique[i][shared:] for i in members]
        for bucket in prefill_buckets([len(r) for r in rest]):
            parts.append(([members[j] for j in bucket], shared,
                          *_forward_after(model, prefix, [rest[j] for j in bucket], pad_id)))
    logits = torch.empty((len(unique), parts[0][2].shape[-1]), dtype=parts[0][2].dtype)
    mask = torch.zeros((len(unique), width), dtype=torch.long)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for members, shared, part_logits, kv in parts:
        index = torch.tensor(members, dtype=torch.long)
        logits[index] = part_logits
        for i in members:
            mask[i, :shared] = 1
            mask[i, width - (len(unique[i]) - shared):] = 1
        for n, layer in enumerate(kv.layers):
            keys, values = _tensors(layer)  # the part's own width: prefix, then its tokens
            if n == len(layers):
                layers.append((keys.new_zeros((len(unique), keys.shape[1], width, keys.shape[3])),
                               values.new_zeros((len(unique), values.shape[1], width,
                                                 values.shape[3]))))
            own = keys.shape[2] - shared
            # the part's tokens are left-padded to its own width: right-aligned in the full
            # width, their padding falls where the full mask is 0 as well
            for full, part in zip(layers[n], (keys, values), strict=True):
                full[index, :, :shared] = part[:, :, :shared]
                full[index, :, width - own:] = part[:, :, shared:]
    cache = _new_cache(model, reserve)
    for n, (keys, values) in enumerate(layers):
        cache.update(keys, values, n)
    if len(unique) < len(seqs):  # copy the shared rows out
        expand = torch.tensor(rows, dtype=torch.long)
        cache.batch_select_indices(expand)
        logits, mask = logits[expand], mask[expand]
    return logits, cache, mask, last


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
                                          pad_id, max(rows[a].max_new_tokens for a in active))
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
            left = max(rows[a].max_new_tokens - len(results[a].tokens) for a in active)
            logits, kv, mask, last_pos = _prefill(model, seqs, pad_id, left)
            forwards += 1
            continue
        mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
        last_pos = last_pos + 1
        logits = model(
            input_ids=tokens[:, None], attention_mask=mask, position_ids=last_pos,
            use_cache=True, **{cache_kwarg(model): kv},
        ).logits[:, -1, :]
        forwards += 1


def _aborted(row: Row, result: RowResult) -> bool:
    if row.aborted is not None and row.aborted():
        result.finish_reason = "abort"
        return True
    return False
