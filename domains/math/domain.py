"""The ``math`` domain: a short problem, a final answer checked for equivalence.

The model is asked to end with ``Answer: <expression>`` (a ``\\boxed{...}`` also counts; the
last one wins). Without either, the last non-empty line counts when it ends in ``= <value>``
or ``is <value>`` ("22 + 11 = 33", "Half of 74 is 37."), the form small models answer in.
Reward is binary: 1.0 when the final answer is in final form for its kind (see
:func:`final_form`: a number is a plain number, an expansion has no factor left, a surd's
radicand has no square factor; so copying the question, e.g. "Answer: 1/5 + 1/3" or
"Answer: (x - 2)(x - 6)", earns nothing) and equivalent to the expected one (numerically, or
symbolically through :mod:`domains.math.equiv`, which runs sympy in a worker process under a
deadline), 0.0 otherwise, including no answer, an answer too long or with names outside the
allow-list, and answers that make the parser hang or blow up.
Nothing is executed in the sandbox (``exec_request`` is None).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from streamrl.domains.base import NO_SANDBOX, SINGLE_TURN, SplitFiles, chat_prompt_ids
from streamrl.domains.math.equiv import equivalent
from streamrl.sandbox.base import ExecRequest, ExecResult

DATA_DIR = Path(__file__).parent / "data"
MAX_NEW_TOKENS = 48  # calibration.json: greedy reward is the same at 32, 48 and 64
INSTRUCTION = "Solve the problem. End your reply with a line 'Answer: <final answer>'."

_ANSWER = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*(.+)", re.IGNORECASE)
_TAIL = re.compile(r"(?:=|\bis\b)([^=]*)$", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_GROUP_WITH_X = re.compile(r"\([^()]*x[^()]*\)")
_RADICAND = re.compile(r"sqrt\((\d+)\)|√(\d+)")
NUMERIC_KINDS = frozenset({"add", "half", "one_step", "linear", "percent", "fraction_sum"})


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
        if matches:
            found = matches[-1]
        else:
            lines = [line for line in text[-4000:].splitlines() if line.strip()]
            tail = _TAIL.search(lines[-1]) if lines else None
            if tail is None:
                return None
            found = tail.group(1)
    found = found.strip().rstrip(".").strip().strip("$").strip()
    found = re.sub(r"^[a-z]\s*=\s*", "", found)  # "x = 5" -> "5"
    return found.rstrip(".").strip() or None


def final_form(kind: str, answer: str) -> bool:
    """The answer is a result, not the question restated: a plain number (integer, decimal
    or a/b) for the numeric kinds, no parenthesised group with x in it for an expansion, a
    square-free radicand for a surd (other kinds: any form)."""
    compact = answer.replace(" ", "").replace(",", "")
    if kind in NUMERIC_KINDS:
        return _NUMBER.fullmatch(compact) is not None
    if kind == "expand":
        return _GROUP_WITH_X.search(compact) is None
    if kind == "sqrt":
        radicands = [int(a or b) for a, b in _RADICAND.findall(compact)]
        return len(radicands) == 1 and all(
            radicands[0] % (k * k) for k in range(2, int(radicands[0] ** 0.5) + 1))
    return True


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
        if answer is None or not final_form(item.kind, answer):
            return 0.0
        return 1.0 if equivalent(answer, item.answer) else 0.0
