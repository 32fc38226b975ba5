"""The ``math_verify`` kind: equivalence judged by the math-verify package, on the final
answer only."""

from __future__ import annotations

import pytest

from streamrl.domains.kinds import KINDS, Record
from streamrl.domains.kinds import mathverify as _mathverify  # noqa: F401  (registers it)


def _score(answer: str, completion: str) -> float:
    return KINDS["math_verify"]({}).score(Record(id="1", prompt="q", answer=answer),
                                          completion, None)


@pytest.mark.parametrize(("answer", "completion"), [
    ("\\frac{1}{2}", "so \\boxed{0.5}"),
    ("1/2", "Answer: \\frac{2}{4}"),
    ("x^2 + 2x + 1", "We get \\boxed{(x+1)^2}"),
    ("\\sqrt{8}", "Answer: 2\\sqrt{2}"),
    ("(1, 2]", "\\boxed{(1,2]}"),
])
def test_equivalent_answers_score_one(answer: str, completion: str) -> None:
    assert _score(answer, completion) == 1.0


@pytest.mark.parametrize(("answer", "completion"), [
    ("\\frac{1}{2}", "\\boxed{0.6}"),
    ("x^2 + 2x + 1", "\\boxed{(x+2)^2}"),
    ("3", "no idea"),
    ("3", ""),
])
def test_wrong_answers_score_zero(answer: str, completion: str) -> None:
    assert _score(answer, completion) == 0.0


@pytest.mark.parametrize("completion", [
    "\\boxed{1/2} \\boxed{3}",  # several boxes: the last one is the answer
    "Answer: 1/2 or 3",  # a set of candidates (math-verify: {1/2, 3}) or the last one
    "\\boxed{3, 1/2}",
    "\\boxed{1/2 = 3}",
    "Answer: " + "1/2 + " * 5000 + "0",  # huge
    "\\boxed{" + "{" * 10_000 + "}",  # unbalanced, deep
])
def test_gamed_answers_score_zero(completion: str) -> None:
    assert _score("1/2", completion) == 0.0
