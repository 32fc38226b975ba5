"""Fixtures for the learner tests: the real tiny Llama (random weights, SmolLM2 tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamrl.models import load_model, resolve_model


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return resolve_model("tiny")


@pytest.fixture
def tiny_model(tiny_dir: Path) -> Any:
    return load_model(tiny_dir)
