"""The ``finance`` domain: a small financial table and a question; the answer is JSON.

The model must answer with one JSON object ``{"parts": {<segment>: number, ...}, "total":
number, "ratio": number}`` (the question says what the parts are: each segment's revenue,
or each segment's profit = revenue - cost, and which ratio; the prompt names the segments).
The assistant turn is primed with the object's opening, ``ANSWER_PREFIX`` up to the first
segment's value (``render_prompt`` appends it after the chat template's generation prompt,
``score`` prepends it to the completion), so even a small model answers in the format. The
verifier recomputes everything from the table in the item, never from a stored answer
string, and scores:

- 0.0 unless the answer is well-formed: one JSON object (a ```json fence, else the last
  ``{...}`` of the reply) of at most ``MAX_JSON_CHARS`` characters, ``parts`` an object and
  every value in it, ``total`` and ``ratio`` a finite int/float (``true``, strings, ``NaN``
  and ``Infinity`` anywhere there are refused);
- else the mean of three checks against the table: the parts (fraction of the table's
  segments right, times the fraction of reported keys that are segments: padding ``parts``
  with extra keys costs), the total, the ratio. Tolerances: relative 1e-6 for amounts
  (absolute 0.01), absolute 0.0015 for ratios (three decimals are enough);
- times ``INCONSISTENT_FACTOR`` (0.5) unless the answer is internally consistent: ``parts``
  names exactly the table's segments, ``total`` equals the sum of the reported parts and
  ``ratio`` equals the ratio recomputed from the reported values (and the table's other
  column where the ratio needs one). A consistent answer that is right on all three is the
  only way to 1.0.
Nothing runs in the sandbox: the checks are arithmetic on parsed JSON.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgspec

from streamrl.domains.base import NO_SANDBOX, SINGLE_TURN, SplitFiles, chat_prompt_ids
from streamrl.domains.fences import JSON, fence
from streamrl.sandbox.base import ExecRequest, ExecResult

DATA_DIR = Path(__file__).parent / "data"
MAX_NEW_TOKENS = 64  # calibration.json: the same reward at 64 and 96, none at 48
MAX_JSON_CHARS = 4000
RATIO_TOL = 0.0015
INCONSISTENT_FACTOR = 0.5

_FENCE = fence(JSON, closed=True)


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


def _parse(raw: str | None) -> dict[str, Any] | None:
    if raw is None or len(raw) > MAX_JSON_CHARS:
        return None
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def parse_answer(text: str) -> dict[str, Any] | None:
    """The last ```json fence of ``text`` that holds a JSON object, else its last ``{...}``."""
    for raw in reversed(_FENCE.findall(text)):
        value = _parse(raw)
        if value is not None:
            return value
    return _parse(_last_object(text))


def _number(v: Any) -> float | None:
    if type(v) not in (int, float):  # bool is an int subclass: refused
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _amount_eq(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=0.01)


def answer_prefix(item: FinanceItem) -> str:
    """The primed opening of the answer (the assistant turn starts with it)."""
    return '```json\n{"parts": {"' + item.rows[0].segment + '": '


def check(item: FinanceItem, answer: dict[str, Any]) -> float:
    parts_raw, total, ratio = answer.get("parts"), _number(answer.get("total")), _number(
        answer.get("ratio"))
    if type(parts_raw) is not dict or not parts_raw or total is None or ratio is None:
        return 0.0
    parts: dict[str, float] = {}
    for k, v in parts_raw.items():
        n = _number(v)
        if n is None:
            return 0.0
        parts[k] = n
    segments = [r.segment for r in item.rows]
    # against the table
    truth = parts_of(item)
    true_total = sum(truth.values())
    true_ratio = ratio_of(item, truth, true_total)
    right = sum(1 for s in segments if s in parts and _amount_eq(parts[s], truth[s]))
    parts_ok = right / len(segments) * min(1.0, len(segments) / len(parts))
    total_ok = float(_amount_eq(total, true_total))
    ratio_ok = float(true_ratio is not None and abs(ratio - true_ratio) <= RATIO_TOL)
    # internal consistency: totals equal their parts, the ratio follows from the numbers
    consistent = sorted(parts) == sorted(segments) and _amount_eq(total, sum(parts.values()))
    own_ratio = ratio_of(item, parts, total) if consistent else None
    consistent = own_ratio is not None and abs(own_ratio - ratio) <= RATIO_TOL
    return (parts_ok + total_ok + ratio_ok) / 3 * (1.0 if consistent else INCONSISTENT_FACTOR)


class Finance(SplitFiles):
    name = "finance"
    item_type = FinanceItem
    default_max_new_tokens = MAX_NEW_TOKENS
    episode = SINGLE_TURN
    sandbox = NO_SANDBOX

    def __init__(self, data_dir: Path = DATA_DIR) -> None:
        self.data_dir = data_dir

    def render_prompt(self, item: FinanceItem, tokenizer: Any) -> list[int]:
        primed = tokenizer.encode(answer_prefix(item), add_special_tokens=False)
        return chat_prompt_ids(tokenizer, item.prompt) + [int(i) for i in primed]

    def exec_request(self, item: FinanceItem, completion_text: str) -> ExecRequest | None:
        return None

    def score(self, item: FinanceItem, completion_text: str, result: ExecResult | None
              ) -> float:
        answer = parse_answer(answer_prefix(item) + completion_text) or parse_answer(
            completion_text)  # the primed object, else one the model wrote whole
        return 0.0 if answer is None else check(item, answer)
