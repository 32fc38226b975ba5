"""``teacher_forced_logprobs``: what a generator's logprobs must equal, from one forward pass
(tests and benchmarks compare engines, servers and dtypes against it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def teacher_forced_logprobs(model: Any, prompt: Sequence[int], tokens: Sequence[int],
                            temperature: float) -> torch.Tensor:
    """The logprob of each of ``tokens`` after ``prompt`` from one forward pass of ``model``
    over both, as a generator samples it: the fp32 ``log_softmax(logits / T)`` of the token
    (``T = 1`` for greedy, ``temperature == 0``), never renormalised over a nucleus."""
    ids = torch.tensor([[*prompt, *tokens]])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, -1).gather(1, ids[0, len(prompt):, None])[:, 0]
