"""Finding the final answer in a completion, for the kinds that compare one to a reference.

Guarantees: every function here is linear in its input, reads at most the last
``MAX_TAIL`` characters of a completion, and returns None (never raises) when there is no
answer; an answer longer than ``MAX_ANSWER`` characters counts as none (a completion that
lists everything, or floods, earns nothing).
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Mapping
from typing import Any

MAX_TAIL = 8000
MAX_ANSWER = 200

_ANSWER = re.compile(r"(?im)^[^\S\n]*(?:final\s+)?answer\s*(?:is)?\s*[:=]\s*(.+?)\s*$")
_PUNCT_EDGES = ".,;:!?\"'`*_()[]{} \t\n"


def boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (balanced braces), else None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, min(len(text), i + MAX_ANSWER * 4)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """The last ``\\boxed{}``, else the last ``Answer: ...`` line, else the last non-empty
    line; None when there is none or it is longer than ``MAX_ANSWER``."""
    tail = text[-MAX_TAIL:]
    found = boxed(tail)
    if found is None:
        matches = _ANSWER.findall(tail)
        if matches:
            found = matches[-1]
        else:
            lines = [line for line in tail.splitlines() if line.strip()]
            found = lines[-1] if lines else None
    if found is None:
        return None
    found = found.strip()
    return found if found and len(found) <= MAX_ANSWER else None


def normalise(text: str) -> str:
    """Case-folded, NFKC, whitespace collapsed, surrounding punctuation and ``$``/``\\text{}``
    wrappers dropped: ``"  The  ANSWER. "`` and ``"the answer"`` compare equal."""
    text = unicodedata.normalize("NFKC", text)
    text = re.sub(r"\\text\{([^{}]*)\}", r"\1", text).replace("$", "")
    text = " ".join(text.casefold().split())
    return text.strip(_PUNCT_EDGES)


def last_json_object(text: str) -> dict[str, Any] | None:
    """The last JSON object in ``text`` (a fenced ```json block or a bare ``{...}``)."""
    tail = text[-MAX_TAIL:]
    decoder = json.JSONDecoder()
    found: dict[str, Any] | None = None
    end = 0
    for match in re.finditer(r"\{", tail):
        if match.start() < end:  # inside the object found last: not an outermost one
            continue
        try:
            value, stop = decoder.raw_decode(tail, match.start())
        except ValueError:
            continue
        if isinstance(value, dict):
            found, end = value, stop
    return found


def field_at(value: Any, path: str) -> Any:
    """``value["a"]["b"]`` for ``path = "a.b"`` (list indices as numbers); None if missing."""
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        else:
            return None
    return value


def check_options(kind: str, options: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = set(options) - allowed
    if unknown:
        raise ValueError(f"verifier kind {kind!r}: unknown option(s) {sorted(unknown)}; "
                         f"allowed: {sorted(allowed)}")
