"""Versioned weights: atomic HF directories, pruning, and in-place reloads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from streamrl.learner.weights import latest_version, list_versions, load_state_into, save_weights
from streamrl.models import load_model, load_tokenizer

IDS = torch.tensor([[1, 510, 2021, 314, 17, 2]])


def logits(model: Any) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def perturb(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def test_save_then_load_round_trip(tiny_model: Any, tiny_dir: Path, tmp_path: Path) -> None:
    # Given a model that differs from the base weights
    perturb(tiny_model, seed=1)
    expected = logits(tiny_model)

    # When it is saved as version 7
    path = save_weights(tiny_model, tiny_dir, tmp_path, version=7, keep_last=3)

    # Then the directory is a complete HF model that loads on its own
    assert path == tmp_path / "v000007"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in path.iterdir()
    }
    assert torch.equal(logits(load_model(path)), expected)
    assert (
        load_tokenizer(path)("hello")["input_ids"] == load_tokenizer(tiny_dir)("hello")["input_ids"]
    )

    # And loading in place into another copy gives identical logits, keeping the tie
    other = load_model(tiny_dir)
    embed = other.model.embed_tokens.weight
    assert not torch.equal(logits(other), expected)
    load_state_into(other, path)
    assert torch.equal(logits(other), expected)
    assert other.model.embed_tokens.weight is embed
    assert other.lm_head.weight.data_ptr() == embed.data_ptr()


def test_keep_last_prunes_older_versions(tiny_model: Any, tiny_dir: Path, tmp_path: Path) -> None:
    assert latest_version(tmp_path / "nothing-yet") is None
    tok = load_tokenizer(tiny_dir)
    for version in range(1, 6):
        save_weights(tiny_model, tok, tmp_path, version, keep_last=2)
    (tmp_path / ".v000006.999999.tmp").mkdir()  # a writer that crashed mid-save
    save_weights(tiny_model, tok, tmp_path, 6, keep_last=2)
    assert list_versions(tmp_path) == [5, 6]
    assert latest_version(tmp_path) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000005", "v000006"]  # no temp dirs

    # the version just written survives even when it is not among the newest
    save_weights(tiny_model, tiny_dir, tmp_path, 3, keep_last=1)
    assert list_versions(tmp_path) == [3, 6]

    with pytest.raises(FileExistsError):
        save_weights(tiny_model, tiny_dir, tmp_path, 6, keep_last=2)


def test_load_refuses_a_file_that_does_not_fit(tiny_model: Any, tmp_path: Path) -> None:
    before = logits(tiny_model)
    state = {k: v.clone() for k, v in tiny_model.state_dict().items() if k != "lm_head.weight"}

    wrong_shape = dict(state, **{"model.norm.weight": torch.ones(3)})
    save_file(wrong_shape, tmp_path / "shape.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        load_state_into(tiny_model, tmp_path / "shape.safetensors")

    missing = {k: v for k, v in state.items() if k != "model.norm.weight"}
    save_file(missing, tmp_path / "missing.safetensors")
    with pytest.raises(KeyError, match=r"model\.norm\.weight"):
        load_state_into(tiny_model, tmp_path / "missing.safetensors")

    assert torch.equal(logits(tiny_model), before)  # nothing was half-loaded
