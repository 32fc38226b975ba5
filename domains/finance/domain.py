"""The ``finance`` domain: a small financial table and a question; the answer is JSON.

The model must answer with one JSON object ``{"parts": {<segment>: number, ...}, "total":
number, "ratio": number}`` (the question says what the parts are: each segment's revenue,
or each segment's profit = revenue - cost, and which ratio). The verifier recomputes
everything from the table in the item, never from a stored answer string, and scores:

- 0.0 unless the answer is well-formed: one JSON object (a ```json fence, else the last
  ``{...}`` of the reply) of at most ``MAX_JSON_CHARS`` characters, ``parts`` naming exactly
  the table's segments, every value a finite int/float (``true``, strings, ``NaN`` and
  ``Infinity`` are refused);
- 0.0 unless it is internally consistent: ``total`` equals the sum of the reported parts
  and ``ratio`` equals the ratio recomputed from the reported values (and the table's other
  column where the ratio needs one);
- else the mean of three checks against the table: the parts (fraction right), the total,
  the ratio. Tolerances: relative 1e-6 for amounts (absolute 0.01), absolute 0.0015 for
  ratios (three decimals are enough).
Nothing runs in the sandbox: the checks are arithmetic on parsed JSON.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import msgspec

from domains.base import NO_SANDBOX, SINGLE_TURN, SplitFiles, chat_prompt_ids
from sandbox.base import ExecRequest, ExecResult

DATA_DIR = Path(__file__).parent / "data"
MAX_NEW_TOKENS = 160
MAX_JSON_CHARS = 4000
RATIO_TOL = 0.0015

_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)```", re.DOTALL | re.IGNORECASE)


class Row(msgspec.Struct, frozen=True):
    segment: str
    revenue: int
    cost: int


class FinanceItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    prompt: str
    rows: list[Row]
    kind: str  # "share": parts = revenue, ratio = target's share; "margin": parts = profit,
    #            ratio = total profit / total revenue
    target: str = ""  # the segment of a "share" question


def parts_of(item: FinanceItem) -> dict[str, float]:
    if item.kind == "share":
        return {r.segment: float(r.revenue) for r in item.rows}
    return {r.segment: float(r.revenue - r.cost) for r in item.rows}


def ratio_of(item: FinanceItem, parts: dict[str, float], total: float) -> float | None:
    """The question's ratio computed from ``parts``/``total`` (reported or true)."""
    if item.kind == "share":
        return parts[item.target] / total if total else None
    revenue = sum(r.revenue for r in item.rows)
    return total / revenue if revenue else None


def _last_object(text: str) -> str | None:
    end = text.rfind("}")
    depth = 0
    for i in range(end, max(-1, end - MAX_JSON_CHARS - 1), -1):
        depth += {"}": 1, "{": -1}.get(text[i], 0)
        if depth == 0:
            return text[i : end + 1]
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def parse_answer(text: str) -> dict[str, Any] | None:
    fenced = _FENCE.findall(text)
    raw = fenced[-1] if fenced else _last_object(text)
    if raw is None or len(raw) > MAX_JSON_CHARS:
        return None
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _number(v: Any) -> float | None:
    if type(v) not in (int, float):  # bool is an int subclass: refused
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _amount_eq(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=0.01)


def check(item: FinanceItem, answer: dict[str, Any]) -> float:
    parts_raw, total, ratio = answer.get("parts"), _number(answer.get("total")), _number(
        answer.get("ratio"))
    segments = [r.segment for r in item.rows]
    if type(parts_raw) is not dict or sorted(parts_raw) != sorted(segments):
        return 0.0
    if total is None or ratio is None:
        return 0.0
    parts: dict[str, float] = {}
    for k, v in parts_raw.items():
        n = _number(v)
        if n is None:
            return 0.0
        parts[k] = n
    # internal consistency: totals equal their parts, the ratio follows from the numbers
    if not _amount_eq(total, sum(parts.values())):
        return 0.0
    own_ratio = ratio_of(item, parts, total)
    if own_ratio is None or abs(own_ratio - ratio) > RATIO_TOL:
        return 0.0
    # against the table
    truth = parts_of(item)
    true_total = sum(truth.values())
    true_ratio = ratio_of(item, truth, true_total)
    parts_ok = sum(_amount_eq(parts[s], truth[s]) for s in segments) / len(segments)
    total_ok = float(_amount_eq(total, true_total))
    ratio_ok = float(true_ratio is not None and abs(ratio - true_ratio) <= RATIO_TOL)
    return (parts_ok + total_ok + ratio_ok) / 3


class Finance(SplitFiles):
    name = "finance"
    item_type = FinanceItem
    default_max_new_tokens = MAX_NEW_TOKENS
    episode = SINGLE_TURN
    sandbox = NO_SANDBOX

    def __init__(self, data_dir: Path = DATA_DIR) -> None:
        self.data_dir = data_dir

    def render_prompt(self, item: FinanceItem, tokenizer: Any) -> list[int]:
        return chat_prompt_ids(tokenizer, item.prompt)

    def exec_request(self, item: FinanceItem, completion_text: str) -> ExecRequest | None:
        return None

    def score(self, item: FinanceItem, completion_text: str, result: ExecResult | None
              ) -> float:
        answer = parse_answer(completion_text)
        return 0.0 if answer is None else check(item, answer)
