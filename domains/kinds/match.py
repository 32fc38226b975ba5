"""The text kinds: a final answer compared to the item's reference, nothing executed.

- ``exact``: the final answer (:func:`answers.final_answer`: last ``\\boxed{}``, else last
  ``Answer:`` line, else last line) equals ``item.answer`` (option ``strip``: surrounding
  whitespace ignored, default true);
- ``normalised``: the same after :func:`answers.normalise` (case, whitespace, surrounding
  punctuation, ``$``);
- ``numeric``: the final answer is one number (``1,234.5``, ``-3/4``, ``12%``, ``$5``) within
  ``rel_tol`` / ``abs_tol`` (defaults 1e-6 / 1e-9) of ``item.answer``; an answer holding
  several numbers is none (listing candidates earns nothing); nan/inf never match;
- ``choice``: the final answer names exactly one choice letter (``B``, ``(B)``, ``B.``,
  ``B) text``), equal to ``item.answer`` (a letter, or the choice's text, or its 0-based
  index, with ``item.extra[choices_field]`` the list of choices); an answer naming two
  letters, or every choice, is none;
- ``regex``: option ``pattern`` (group 1, or the whole match; the last match wins) picks the
  answer out of the completion, compared as ``compare`` = ``exact`` | ``normalised`` |
  ``numeric``;
- ``json_field``: option ``field`` (a dotted path) of the last JSON object in the completion,
  compared as ``compare`` (default ``normalised``).
Every score is 0.0 or 1.0.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from streamrl.domains.base import NO_SANDBOX, SandboxSpec
from streamrl.domains.kinds import Record, Verifier, kind
from streamrl.domains.kinds.answers import (
    MAX_ANSWER,
    MAX_TAIL,
    check_options,
    field_at,
    final_answer,
    last_json_object,
    normalise,
)
from streamrl.sandbox.base import ExecRequest, ExecResult

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?"
                     r"|[-+]?\.\d+")
_LETTER = re.compile(r"(?<![A-Za-z0-9])([A-Z])(?![A-Za-z0-9])")

Compare = Callable[[str, Any], bool]


def parse_number(text: str) -> float | None:
    """The one number in ``text`` (units, ``$``, ``%`` and words around it ignored), else None."""
    found = _NUMBER.findall(text[:MAX_ANSWER])
    if len(found) != 1:
        return None
    try:
        value = float(Fraction(found[0].replace(",", "")))
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def _expected_number(answer: Any) -> float | None:
    if isinstance(answer, bool):
        return None
    if isinstance(answer, int | float):
        return float(answer) if math.isfinite(answer) else None
    return parse_number(str(answer)) if answer is not None else None


def exact_equal(answer: str, expected: Any) -> bool:
    return answer.strip() == str(expected).strip()


def normalised_equal(answer: str, expected: Any) -> bool:
    return normalise(answer) == normalise(str(expected))


def numeric_equal(rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> Compare:
    def equal(answer: str, expected: Any) -> bool:
        got, want = parse_number(answer), _expected_number(expected)
        return (got is not None and want is not None
                and math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol))

    return equal


@dataclass(frozen=True)
class AnswerMatch:
    """A text kind: ``extract`` finds the answer, ``compare`` judges it against the reference."""

    extract: Callable[[str], str | None]
    compare: Compare
    sandbox: SandboxSpec = NO_SANDBOX

    def check_item(self, item: Record) -> None:
        if item.answer is None:
            raise ValueError(f"item {item.id!r}: no answer (this kind compares to one)")

    def exec_request(self, item: Record, completion: str) -> ExecRequest | None:
        return None

    def score(self, item: Record, completion: str, result: ExecResult | None) -> float:
        answer = self.extract(completion)
        if answer is None or len(answer) > MAX_ANSWER:
            return 0.0
        return 1.0 if self.compare(answer, item.answer) else 0.0


def _comparer(name: str, options: Mapping[str, Any]) -> Compare:
    if name == "exact":
        return exact_equal
    if name == "normalised":
        return normalised_equal
    if name == "numeric":
        return numeric_equal(float(options.get("rel_tol", 1e-6)),
                             float(options.get("abs_tol", 1e-9)))
    raise ValueError(f"compare must be 'exact', 'normalised' or 'numeric', not {name!r}")


@kind("exact")
def exact(options: Mapping[str, Any]) -> Verifier:
    check_options("exact", options, set())
    return AnswerMatch(final_answer, exact_equal)


@kind("normalised")
def normalised(options: Mapping[str, Any]) -> Verifier:
    check_options("normalised", options, set())
    return AnswerMatch(final_answer, normalised_equal)


@kind("numeric")
def numeric(options: Mapping[str, Any]) -> Verifier:
    check_options("numeric", options, {"rel_tol", "abs_tol"})
    return AnswerMatch(final_answer, _comparer("numeric", options))


@dataclass(frozen=True)
class Choice:
    """Multiple choice: the final answer names exactly one letter, the item's."""

    choices_field: str = "choices"
    sandbox: SandboxSpec = NO_SANDBOX

    def expected_letter(self, item: Record) -> str | None:
        expected = str(item.answer).strip()
        choices = item.extra.get(self.choices_field)
        if len(expected) == 1 and expected.isalpha():
            return expected.upper()
        if isinstance(choices, list):
            if expected.isdigit() and int(expected) < len(choices):
                return chr(ord("A") + int(expected))
            texts = [normalise(str(c)) for c in choices]
            if normalise(expected) in texts:
                return chr(ord("A") + texts.index(normalise(expected)))
        return None

    def check_item(self, item: Record) -> None:
        if item.answer is None or self.expected_letter(item) is None:
            raise ValueError(f"item {item.id!r}: answer {item.answer!r} is not a choice "
                             f"letter, index or the text of one of extra[{self.choices_field!r}]")

    def exec_request(self, item: Record, completion: str) -> ExecRequest | None:
        return None

    def score(self, item: Record, completion: str, result: ExecResult | None) -> float:
        answer, want = final_answer(completion), self.expected_letter(item)
        if answer is None or want is None:
            return 0.0
        return 1.0 if named_letters(answer) == {want} else 0.0


def named_letters(answer: str) -> set[str]:
    """The choice letters an answer names: standalone capitals (``B``, ``(B)``, ``B.``,
    ``B) text``), except ``A``/``I`` used as a word (``A cat``, ``I think``)."""
    return {m.group(1) for m in _LETTER.finditer(answer)
            if not (m.group(1) in "AI" and re.match(r"\s+[a-z]", answer[m.end():]))}


@kind("choice")
def choice(options: Mapping[str, Any]) -> Verifier:
    check_options("choice", options, {"choices_field"})
    return Choice(str(options.get("choices_field", "choices")))


@kind("regex")
def regex(options: Mapping[str, Any]) -> Verifier:
    check_options("regex", options, {"pattern", "compare", "rel_tol", "abs_tol"})
    if "pattern" not in options:
        raise ValueError("verifier kind 'regex' needs option 'pattern'")
    pattern = re.compile(str(options["pattern"]))

    def extract(text: str) -> str | None:
        matches = list(pattern.finditer(text[-MAX_TAIL:]))
        if not matches:
            return None
        last = matches[-1]
        return (last.group(1) if pattern.groups else last.group(0)).strip()

    return AnswerMatch(extract, _comparer(str(options.get("compare", "normalised")), options))


@kind("json_field")
def json_field(options: Mapping[str, Any]) -> Verifier:
    check_options("json_field", options, {"field", "compare", "rel_tol", "abs_tol"})
    if "field" not in options:
        raise ValueError("verifier kind 'json_field' needs option 'field'")
    path = str(options["field"])

    def extract(text: str) -> str | None:
        value = field_at(last_json_object(text), path)
        if value is None or isinstance(value, dict | list):
            return None
        return str(value)

    return AnswerMatch(extract, _comparer(str(options.get("compare", "normalised")), options))
