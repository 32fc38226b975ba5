"""The prefill computes each distinct prompt once, the shared prefix of prompts that begin alike
once, the rest in length buckets, and gets the logits, the cache and the decoded logprobs of
the plain left-padded prefill (tiny random model). The decoding cache appends in place and
holds what concatenation holds; sampling by inverse CDF draws from the distribution."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from streamrl.inference import decode
from streamrl.inference.decode import (
    GrowingLayer,
    Row,
    decode_batch,
    prefill_buckets,
    prefix_groups,
    sample_inverse_cdf,
)
from streamrl.models import load_model


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
    seqs = _prompts([50, 4, 90, 9, 24, 3, 11], vocab, seed=1)
    shared = [seqs[4] + seqs[5], seqs[4] + seqs[6], seqs[4] + seqs[1]]  # a 24-token prefix
    seqs = [seqs[0]] * 4 + seqs[1:4] + shared
    rows = [Row(prompt=s, max_new_tokens=12, temperature=0.0) for s in seqs]
    got, _ = decode_batch(model, rows, frozenset(), 0)

    def plain(model: Any, seqs: list[list[int]], pad_id: int, reserve: int) -> Any:
        logits, kv = decode._forward(model, seqs, pad_id)
        _, mask, positions = decode._padded(seqs, pad_id)
        return logits, kv, mask, positions[:, -1:]

    # the plain prefill, and transformers' own cache (concatenating at every step)
    monkeypatch.setattr(decode, "_prefill", plain)
    monkeypatch.setattr(decode, "_new_cache", lambda model, reserve: DynamicCache(
        config=model.config))
    want, _ = decode_batch(model, rows, frozenset(), 0)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert got[0].tokens == got[1].tokens == got[3].tokens  # a group's greedy rows agree


def test_prompts_that_begin_alike_share_their_prefix() -> None:
    head = list(range(100, 140))  # 40 tokens
    seqs = [
        [*head, 1], [*head, 2, 2], [*head[:18], 3, 3, 3],  # 18 tokens in common with the others
        [5] * 40,                                           # shares nothing
        head[:10] + [1] * 20,                               # 10 in common: under the minimum
    ]
    groups = {tuple(m): n for n, m in ((n, sorted(m)) for n, m in prefix_groups(seqs))}
    assert groups == {(0, 1, 2): 18, (3,): 0, (4,): 0}
    # each member keeps a token of its own: the prefix stops short of the shortest
    assert prefix_groups([head, [*head, 7]]) == [(39, [0, 1])]
    # a newcomer that would shrink the group's prefix more than it saves starts its own
    seqs = [[*head, 1], [*head, 2], [*head, 3], head[:16] + [1000] * 30]
    assert sorted((n, sorted(m)) for n, m in prefix_groups(seqs)) == [(0, [3]), (40, [0, 1, 2])]


@pytest.mark.parametrize("layout", ["one prefix", "two prefixes and a loner"])
def test_prefill_of_shared_prefixes_equals_the_plain_padded_prefill(
        model: Any, layout: str) -> None:
    vocab = model.config.vocab_size
    rng = random.Random(3)
    heads = _prompts([30, 20], vocab, seed=2)
    seqs = [heads[0] + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 25))]
            for _ in range(6)]
    if layout != "one prefix":
        seqs += [heads[1] + [rng.randrange(3, vocab) for _ in range(n)] for n in (2, 40, 5)]
        seqs += [*_prompts([7], vocab, seed=4), seqs[0], seqs[7]]  # a loner, two duplicates
    lengths = [len(s) for s in seqs]
    want_logits, want_kv = _plain(model, seqs)
    with torch.inference_mode():
        logits, kv, mask, last = decode._prefill(model, seqs, 0, reserve=4)
    assert torch.allclose(logits, want_logits, atol=1e-5)
    assert mask.shape == (len(seqs), max(lengths))
    assert mask.sum(1).tolist() == lengths
    assert last[:, 0].tolist() == [n - 1 for n in lengths]
    want_mask = decode._padded(seqs, 0)[1].bool()
    for got, want in zip(kv.layers, want_kv.layers, strict=True):
        # the real positions of each row, in order, hold the plain prefill's keys and values
        for ours, theirs in ((got.keys, want.keys), (got.values, want.values)):
            assert torch.allclose(ours.transpose(1, 2)[mask.bool()],
                                  theirs.transpose(1, 2)[want_mask], atol=1e-5)


def test_growing_layer_appends_in_place_and_holds_what_concatenation_holds() -> None:
    torch.manual_seed(0)
    ours, theirs = GrowingLayer(reserve=3), DynamicLayer()
    pointers = []
    for n, width in enumerate((5, 1, 1, 1, 1, 2)):
        keys = torch.randn(4 if n <= 2 else 2, 2, width, 8)
        got = ours.update(keys, keys * 2)
        want = theirs.update(keys, keys * 2)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert ours.get_seq_length() == theirs.get_seq_length()
        pointers.append(got[0].data_ptr())
        if n == 2:
            index = torch.tensor([3, 1])
            ours.batch_select_indices(index)
            theirs.batch_select_indices(index)
            assert torch.equal(ours.keys, theirs.keys)
            pointers.append(ours.keys.data_ptr())
    # 5 tokens + 3 spare: the 6th and 7th write in place; the batch selection copies the
    # buffer (8 positions), the 8th fits it, the 9th reallocates with 8 spare (the length so
    # far, more than the reserve), where the last two go
    a, a1, a2, b, b1, c, c1 = pointers
    assert a == a1 == a2 != b == b1 != c == c1


def test_inverse_cdf_sampling_draws_from_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    draws = 200_000
    uniform = torch.rand(draws, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    picks = sample_inverse_cdf(probs.expand(draws, -1), uniform)
    freq = torch.bincount(picks, minlength=5).double() / draws
    assert freq[1] == freq[4] == 0  # never a token without mass
    assert torch.allclose(freq, probs.double(), atol=0.005)  # 5 sigma at p = 0.5: 0.0056
    # the ends of [0, 1), an unnormalised row, and a row whose tail has no mass
    rows = torch.tensor([[0.0, 2.0, 2.0, 0.0], [0.0, 2.0, 2.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    ends = torch.tensor([0.0, 1 - 2 ** -53, 1 - 2 ** -53], dtype=torch.float64)
    assert sample_inverse_cdf(rows, ends).tolist() == [1, 2, 1]
