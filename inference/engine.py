"""The inference engine interface the generator actor talks to.

Every backend (the in-process :class:`~inference.transformers_engine.TransformersEngine`,
a later SGLang HTTP client) keeps these guarantees:

- ``generate`` returns one :class:`Completion` per prompt, in order;
- ``Completion.logprobs[i]`` is the behaviour logprob of ``tokens[i]`` under the weights
  named by ``weight_version``: ``log_softmax(logits / temperature)[token]``, or the plain
  ``log_softmax(logits)[token]`` for greedy decoding (temperature 0). It is *not*
  renormalised over the top-p nucleus, so a learner that recomputes
  ``log_softmax(logits / T)`` on the same tokens gets the same numbers (up to float noise);
- a completion ends at the first stop token (included in ``tokens``, never anything after
  it, ``finish_reason == "stop"``) or after ``max_new_tokens`` (``"length"``);
- every token of one completion was sampled under one weight version: weights change only
  between batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from queues.messages import Sampling

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Completion:
    tokens: np.ndarray  # int32, completion tokens only (stop token included if produced)
    logprobs: np.ndarray  # float32, one per token
    text: str  # decoded, special tokens skipped
    finish_reason: FinishReason
    weight_version: int


class Engine(Protocol):
    """Generates completions for token-id prompts; swaps weights between batches."""

    @property
    def weight_version(self) -> int: ...

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        ...

    async def update_weights(self, path: str | Path, version: int) -> None: ...
