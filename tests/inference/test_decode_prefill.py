"""The prefill computes each distinct prompt once, in length buckets, and gets the logits, the
cache and the decoded logprobs of the plain left-padded prefill (tiny random model)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from streamrl.inference import decode
from streamrl.inference.decode import Row, decode_batch, prefill_buckets
from streamrl.learner.model import load_model


@pytest.fixture(scope="module")
def model(tiny_dir: Path) -> Any:
    torch.manual_seed(0)
    return load_model(tiny_dir).eval()


def _prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _plain(model: Any, seqs: list[list[int]]) -> tuple[torch.Tensor, Any]:
    with torch.inference_mode():
        return decode._forward(model, seqs, 0)


def test_buckets_bound_padding_and_cover_every_prompt() -> None:
    lengths = [5, 300, 12, 2000, 290, 7, 310, 1500, 6]
    buckets = prefill_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for bucket in buckets:
        widest = max(lengths[i] for i in bucket)
        real = sum(lengths[i] for i in bucket)
        assert len(bucket) * widest <= decode.PREFILL_SLACK * real + widest
    # the short ones never share a forward pass with the long ones
    assert not any({0, 3} <= set(b) for b in buckets)
    assert prefill_buckets([40] * 10, budget=100) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


@pytest.mark.parametrize("lengths", [
    [3, 40, 41, 5, 120, 39, 6],            # several buckets, no duplicates
    [30, 30, 30, 30, 7, 7, 7, 7],          # two groups of four identical prompts
    [64, 64, 64],                          # one group: one row computed, copied twice
])
def test_prefill_equals_the_plain_padded_prefill(model: Any, lengths: list[int]) -> None:
    seqs = _prompts(lengths, model.config.vocab_size)
    if len(set(lengths)) < len(lengths):  # same lengths -> the same prompt (a group)
        first = {n: s for n, s in zip(lengths, seqs, strict=True)}
        seqs = [list(first[n]) for n in lengths]
    want_logits, want_kv = _plain(model, seqs)
    with torch.inference_mode():
        logits, kv, mask, last = decode._prefill(model, seqs, 0)
    assert torch.allclose(logits, want_logits, atol=1e-5)
    assert mask.sum(1).tolist() == lengths
    assert last[:, 0].tolist() == [n - 1 for n in lengths]
    for got, want in zip(kv.layers, want_kv.layers, strict=True):
        real = mask.bool()[:, None, :, None]  # padded slots may differ: they are masked out
        assert torch.allclose(got.keys * real, want.keys * real, atol=1e-5)
        assert torch.allclose(got.values * real, want.values * real, atol=1e-5)


def test_decoding_after_the_prefill_matches_the_plain_prefill(
        model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy decoding of a mixed batch (a group of 4, long and short prompts) gives the same
    tokens and logprobs whether or not the prefill shares and buckets."""
    vocab = model.config.vocab_size
    seqs = _prompts([50, 4, 90, 9], vocab, seed=1)
    seqs = [seqs[0]] * 4 + seqs[1:]
    rows = [Row(prompt=s, max_new_tokens=12, temperature=0.0) for s in seqs]
    got, _ = decode_batch(model, rows, frozenset(), 0)

    def plain(model: Any, seqs: list[list[int]], pad_id: int) -> Any:
        logits, kv = decode._forward(model, seqs, pad_id)
        _, mask, positions = decode._padded(seqs, pad_id)
        return logits, kv, mask, positions[:, -1:]

    monkeypatch.setattr(decode, "_prefill", plain)
    want, _ = decode_batch(model, rows, frozenset(), 0)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert got[0].tokens == got[1].tokens == got[3].tokens  # a group's greedy rows agree
