"""Chunked logprobs and entropy: the unchunked model's own numbers, values and gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from streamrl.learner.batch import Batch, build_batch
from streamrl.learner.loss import policy_loss
from streamrl.learner.train import TrainConfig, token_logprobs_and_entropy
from streamrl.testing.messages import make_trajectory

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            pad_token_id=0)  # fmt: skip


def tiny(kind: str) -> Any:
    """A randomly initialised causal LM of ``kind``, built from a config (no download)."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**TINY)
    elif kind == "gemma2":  # logits = 3 * tanh(logits / 3)
        config = transformers.Gemma2Config(**TINY, head_dim=8, final_logit_softcapping=3.0)
    elif kind == "granite":  # logits = logits / 0.25
        config = transformers.GraniteConfig(**TINY, logits_scaling=0.25)
    else:  # cohere: logits = logits * 4
        config = transformers.CohereConfig(**TINY, logit_scale=4.0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval()


def batch() -> Batch:
    torch.manual_seed(1)
    groups = [
        make_trajectory([5, 6, 7], [list(range(10, 22)), [30, 31, 32]],
                        [[-1.0] * 12, [-2.0] * 3], [1.0, 0.0], temperature=0.7),
        make_trajectory([8, 9], [[40, 41, 42, 43, 44]], [[-1.5] * 5], [0.5], temperature=1.3),
    ]  # fmt: skip
    return build_batch(groups, pad_id=0)


def reference(model: Any, b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The unchunked path from the model's own forward: full logits, one log_softmax."""
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits[:, :-1]
    logp = torch.log_softmax(logits.float() / b.temperature[:, None, None], dim=-1)
    picked = logp.gather(-1, b.target_ids[..., None]).squeeze(-1) * b.loss_mask
    entropy = -(logp.exp() * logp).sum(-1) * b.loss_mask
    return picked, entropy


@pytest.mark.parametrize("kind", ["llama", "gemma2", "granite", "cohere"])
def test_chunked_logprobs_are_the_models_own(kind: str) -> None:
    # Given a tiny model whose forward may soft-cap or scale its logits
    model, b = tiny(kind), batch()
    with torch.no_grad():
        want_lp, want_ent = reference(model, b)
        # When the learner computes them 4 tokens at a time
        got_lp, got_ent = token_logprobs_and_entropy(model, b, chunk_tokens=4)
    # Then they are the model(...).logits ones, position for position
    assert torch.allclose(got_lp, want_lp, atol=1e-5), (got_lp - want_lp).abs().max()
    assert torch.allclose(got_ent, want_ent, atol=1e-5), (got_ent - want_ent).abs().max()
    assert float(want_ent.sum()) > 0


def loss_and_grads(model: Any, b: Batch, chunk: int | None) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    if chunk is None:
        new = reference(model, b)[0]
    else:
        new = token_logprobs_and_entropy(model, b, chunk_tokens=chunk)[0]
    noise = torch.randn(b.old_logprobs.shape, generator=torch.Generator().manual_seed(2))
    old = b.old_logprobs + 0.05 * noise
    loss, _ = policy_loss(new, old * b.loss_mask, b.advantages, b.loss_mask)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("kind", ["llama", "gemma2"])
def test_chunked_loss_and_gradient_equal_the_unchunked(kind: str) -> None:
    # Given one model and batch
    model, b = tiny(kind), batch()
    model.train()
    # When the loss is computed with full logits, one chunk, and chunks of 1, 3 and 7 tokens
    want_loss, want_grads = loss_and_grads(model, b, None)
    for chunk in (1, 3, 7, 10_000):
        loss, grads = loss_and_grads(model, b, chunk)
        # Then the loss and every parameter's gradient agree within 1e-5
        assert loss == pytest.approx(want_loss, abs=1e-5)
        assert len(grads) == len(want_grads)
        for g, w in zip(grads, want_grads, strict=True):
            assert torch.allclose(g, w, atol=1e-5), (g - w).abs().max()


def test_chunk_size_is_validated() -> None:
    with pytest.raises(ValueError, match="logprob_chunk_tokens"):
        TrainConfig(logprob_chunk_tokens=0)


def test_the_backward_pass_keeps_no_full_vocabulary_logits() -> None:
    # Given a batch of N loss tokens and a vocabulary of V
    model, b = tiny("llama"), batch()
    model.train()
    n, vocab = int(b.loss_mask.sum()), model.config.vocab_size
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dim() and t.shape[-1] == vocab:  # logits-like: [..., V]
            saved.append(t.numel() // vocab)  # rows of V values
        return t

    # When the logprobs are computed in chunks of 4 tokens, recording what autograd keeps
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs_and_entropy(model, b, chunk_tokens=4)
    # Then autograd keeps no [tokens, V] tensor at all: each chunk's logits are
    # recomputed in the backward pass, one chunk at a time
    assert n > 4 and saved == []
    # (sanity: the unchunked forward does keep [N, V] logits)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        reference(model, b)
    assert max(saved) >= n
