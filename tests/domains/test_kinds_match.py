"""The text kinds (exact, normalised, numeric, choice, regex, json_field): right answers
score 1, wrong ones 0, and answers that game the extraction (huge, listing every candidate,
several numbers, every choice) score 0."""

from __future__ import annotations

import pytest

from streamrl.domains.kinds import KINDS, Record
from streamrl.domains.kinds import match as _match  # noqa: F401  (registers the kinds)


def _score(kind: str, answer: object, completion: str, **options: object) -> float:
    verifier = KINDS[kind](options)
    item = Record(id="1", prompt="q", answer=answer,
                  extra={"choices": ["red", "green", "blue", "black"]})
    verifier.check_item(item)
    return verifier.score(item, completion, None)


@pytest.mark.parametrize(("kind", "answer", "completion"), [
    ("exact", "Paris", "Thinking...\nAnswer: Paris"),
    ("exact", "42", "so it is \\boxed{42}"),
    ("normalised", "New York", "Final answer:   new  YORK."),
    ("normalised", "yes", "$\\text{Yes}$"),
    ("numeric", "1234.5", "Answer: $1,234.50"),
    ("numeric", 0.75, "Answer: 3/4"),
    ("numeric", "12", "Answer: 12%"),
    ("choice", "C", "I think it is blue.\nAnswer: (C)"),
    ("choice", "blue", "Answer: C) blue"),
    ("choice", "2", "Answer: C"),
])
def test_right_answers_score_one(kind: str, answer: object, completion: str) -> None:
    assert _score(kind, answer, completion) == 1.0


@pytest.mark.parametrize(("kind", "answer", "completion"), [
    ("exact", "Paris", "Answer: paris"),
    ("normalised", "New York", "Answer: York"),
    ("numeric", "12", "Answer: 12.5"),
    ("numeric", "12", "Answer: twelve"),
    ("choice", "C", "Answer: B"),
    ("exact", "Paris", ""),
])
def test_wrong_answers_score_zero(kind: str, answer: object, completion: str) -> None:
    assert _score(kind, answer, completion) == 0.0


def test_numeric_tolerance_is_an_option() -> None:
    assert _score("numeric", "3.14159", "Answer: 3.14", rel_tol=1e-2) == 1.0
    assert _score("numeric", "3.14159", "Answer: 3.14") == 0.0


@pytest.mark.parametrize(("kind", "answer", "completion"), [
    ("numeric", "12", "Answer: 11 12 13"),  # several candidates
    ("numeric", "12", "Answer: nan"),
    ("numeric", "12", "Answer: " + "1" * 500),  # huge
    ("exact", "Paris", "Answer: " + "Paris " * 1000),
    ("normalised", "paris", "Answer: Paris, London, Rome, Berlin, Madrid"),
    ("choice", "C", "Answer: A B C D"),  # every choice
    ("choice", "C", "Answer: (A) or (C)"),
    ("choice", "C", "Answer: " + "C" * 10_000),
])
def test_gamed_answers_score_zero(kind: str, answer: object, completion: str) -> None:
    assert _score(kind, answer, completion) == 0.0


def test_regex_kind_takes_the_last_match_group() -> None:
    pattern = r"<answer>(.*?)</answer>"
    assert _score("regex", "17", "<answer>3</answer> no wait <answer>17</answer>",
                  pattern=pattern, compare="numeric") == 1.0
    assert _score("regex", "17", "<answer>17</answer> no wait <answer>3</answer>",
                  pattern=pattern, compare="numeric") == 0.0
    assert _score("regex", "17", "17", pattern=pattern) == 0.0  # no match: no answer


def test_json_field_kind_reads_the_last_object() -> None:
    completion = 'draft {"result": {"city": "Rome"}}\n```json\n{"result": {"city": "Paris"}}\n```'
    assert _score("json_field", "paris", completion, field="result.city") == 1.0
    assert _score("json_field", "rome", completion, field="result.city") == 0.0
    assert _score("json_field", "paris", '{"result": "not json', field="result.city") == 0.0
    # a list of every candidate is not a value
    assert _score("json_field", "paris", '{"result": {"city": ["Paris", "Rome"]}}',
                  field="result.city") == 0.0


def test_unknown_options_and_missing_answers_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown option"):
        KINDS["numeric"]({"tolerance": 1})
    with pytest.raises(ValueError, match="needs option 'pattern'"):
        KINDS["regex"]({})
    with pytest.raises(ValueError, match="no answer"):
        KINDS["exact"]({}).check_item(Record(id="1", prompt="q"))
