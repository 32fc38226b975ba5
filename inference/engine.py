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
  it, ``finish_reason == "stop"``) or after ``max_new_tokens`` (``"length"``); only an
  engine asked to abort a request answers ``"abort"`` (with the tokens so far);
- weights may change in the middle of a completion (interruptible rollouts): ``versions[i]``
  is the weight version whose logits token ``i`` was sampled from (and ``logprobs[i]`` is
  that version's logprob); versions never decrease along a completion, and
  ``weight_version`` is the oldest, that of the first token (the version at the start for an
  empty completion). ``versions=None`` means every token is ``weight_version``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import numpy as np

from streamrl.protocol.messages import Sampling

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class Completion:
    tokens: np.ndarray  # int32, completion tokens only (stop token included if produced)
    logprobs: np.ndarray  # float32, one per token
    text: str  # decoded, special tokens skipped
    finish_reason: FinishReason
    weight_version: int  # the oldest token's (see the module docstring)
    versions: np.ndarray | None = None  # int32, one per token; None: all weight_version

    def token_versions(self) -> np.ndarray:
        """The weight version of every token (int32)."""
        if self.versions is None:
            return np.full(len(self.tokens), self.weight_version, dtype=np.int32)
        return self.versions


class Engine(Protocol):
    """Generates completions for token-id prompts; swaps weights between decoding steps."""

    @property
    def weight_version(self) -> int: ...

    async def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[Completion]:
        ...

    async def update_weights(self, path: str | Path, version: int) -> None: ...
