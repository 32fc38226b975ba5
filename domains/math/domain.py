"""The ``math`` domain: a short problem, a final answer checked for equivalence.

The model is asked to end with ``Answer: <expression>`` (a ``\\boxed{...}`` also counts; the
last one wins). Reward is binary: 1.0 when the final answer is equivalent to the expected
one (numerically, or symbolically through :mod:`domains.math.equiv`, which runs sympy in a
worker process under a deadline), 0.0 otherwise, including no answer, an answer too long or
with names outside the allow-list, and answers that make the parser hang or blow up.
Nothing is executed in the sandbox (``exec_request`` is None).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from domains.base import NO_SANDBOX, SINGLE_TURN, SplitFiles, chat_prompt_ids
from domains.math.equiv import equivalent
from sandbox.base import ExecRequest, ExecResult

DATA_DIR = Path(__file__).parent / "data"
MAX_NEW_TOKENS = 128
INSTRUCTION = "Solve the problem. End your reply with a line 'Answer: <final answer>'."

_ANSWER = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*(.+)", re.IGNORECASE)


class MathItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    prompt: str  # the problem
    answer: str  # the expected answer (a number or a sympy-parsable expression)
    kind: str


def _boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, min(len(text), i + 500)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer: the last ``\\boxed{}``, else the last ``Answer: ...`` line."""
    found = _boxed(text)
    if found is None:
        matches = _ANSWER.findall(text[-4000:])
        if not matches:
            return None
        found = matches[-1]
    found = found.strip().rstrip(".").strip().strip("$").strip()
    found = re.sub(r"^[a-z]\s*=\s*", "", found)  # "x = 5" -> "5"
    return found.rstrip(".").strip() or None


class Math(SplitFiles):
    name = "math"
    item_type = MathItem
    default_max_new_tokens = MAX_NEW_TOKENS
    episode = SINGLE_TURN
    sandbox = NO_SANDBOX

    def __init__(self, data_dir: Path = DATA_DIR) -> None:
        self.data_dir = data_dir

    def render_prompt(self, item: MathItem, tokenizer: Any) -> list[int]:
        return chat_prompt_ids(tokenizer, f"{item.prompt}\n{INSTRUCTION}")

    def exec_request(self, item: MathItem, completion_text: str) -> ExecRequest | None:
        return None

    def score(self, item: MathItem, completion_text: str, result: ExecResult | None) -> float:
        answer = extract_answer(completion_text)
        if answer is None:
            return 0.0
        return 1.0 if equivalent(answer, item.answer) else 0.0
