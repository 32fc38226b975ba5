"""The inference engine interface the generator actor talks to.

Every backend (the in-process :class:`~inference.transformers_engine.TransformersEngine`,
the HTTP clients of SGLang / serve-model and of vLLM servers, :mod:`inference.http_engine`)
keeps these guarantees (tests/inference/test_engine_contract.py holds all of them to it):

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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

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


def stop_token_ids(tokenizer: Any, generation_eos: Any = None) -> set[int]:
    """The tokens a completion stops at, whatever engine samples it: the tokenizer's EOS,
    ``<|im_end|>`` where the vocabulary has it, and the generation config's
    ``eos_token_id`` (an int or a list)."""
    stops = {tokenizer.eos_token_id}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id:
        stops.add(im_end)
    stops.update(generation_eos if isinstance(generation_eos, list) else [generation_eos])
    return {int(s) for s in stops if s is not None}


def model_stop_token_ids(model_dir: str | Path, tokenizer: Any) -> set[int]:
    """:func:`stop_token_ids` of the model in ``model_dir`` (its generation_config.json),
    without loading its weights (for engines that serve it from another process)."""
    path = Path(model_dir) / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
    return stop_token_ids(tokenizer, eos)
