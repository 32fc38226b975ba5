"""The math domain: answer extraction and equivalence (numeric, symbolic) under a deadline."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.domains.base import VerifierFailed
from streamrl.domains.math import Math, MathItem, extract_answer
from streamrl.domains.math.equiv import SymbolicChecker, equivalent, screen
from streamrl.domains.math.generate import make_splits, write_splits
from streamrl.domains.registry import get_domain

POLY = MathItem(id="m1", prompt="Expand (x - 2)(x - 6).", answer="x**2 + (-8)*x + (12)",
                kind="expand")
FRAC = MathItem(id="m2", prompt="Compute 1/5 + 1/3.", answer="8/15", kind="fraction_sum")


@pytest.fixture(scope="module")
def domain() -> Math:
    return Math()


def test_registered_and_data_committed(tmp_path: Path) -> None:
    assert isinstance(get_domain("math"), Math)
    splits = make_splits()
    write_splits(splits, tmp_path)
    for split in ("train", "eval"):
        assert (tmp_path / f"{split}.jsonl").read_text() == (
            Math().data_dir / f"{split}.jsonl").read_text()
    assert not {i.prompt for i in splits["train"]} & {i.prompt for i in splits["eval"]}


def test_extraction() -> None:
    assert extract_answer("so\nAnswer: x = 5.") == "5"
    assert extract_answer(r"first \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert extract_answer("The answer is: $8/15$.") == "8/15"
    assert extract_answer("So, the answer is 12.") == "12"
    assert extract_answer("no final line") is None


@pytest.mark.parametrize("text", ["Answer: 8/15", "Answer: 0.5333333333", r"\boxed{16/30}"])
def test_numeric_equivalents_score_one(domain: Math, text: str) -> None:
    assert domain.score(FRAC, text, None) == 1.0


@pytest.mark.parametrize("text", ["Answer: x^2 - 8x + 12", r"\boxed{x**2 - 8*x + 12}",
                                  "Answer: 12 - 8*x + x**2", "(x - 2)(x - 6) = x^2 - 8x + 12"])
def test_symbolic_equivalents_score_one(domain: Math, text: str) -> None:
    assert domain.score(POLY, text, None) == 1.0


@pytest.mark.parametrize(("item", "text"), [
    (POLY, "Answer: (x-2)*(x-6)"), (POLY, r"\boxed{(x-6)(x-2)}"),  # the question, restated
    (FRAC, "Answer: 1/5 + 1/3"), (FRAC, "1/5 + 1/3 = 1/5 + 1/3"),
    (MathItem(id="m3", prompt="Compute 22 + 11.", answer="33", kind="add"), "Answer: 22 + 11"),
    (MathItem(id="m4", prompt="Simplify sqrt(128) to the form a*sqrt(b).", answer="8*sqrt(2)",
              kind="sqrt"), "Answer: sqrt(128)"),
    (MathItem(id="m5", prompt="Simplify sqrt(128) to the form a*sqrt(b).", answer="8*sqrt(2)",
              kind="sqrt"), "Answer: 4*sqrt(8)"),
])
def test_equivalent_answers_not_in_final_form_score_zero(
    domain: Math, item: MathItem, text: str
) -> None:
    assert domain.score(item, text, None) == 0.0


def test_a_last_line_ending_in_a_value_counts_as_the_answer(domain: Math) -> None:
    add = MathItem(id="m6", prompt="Compute 22 + 11.", answer="33", kind="add")
    assert domain.score(add, "22 + 11 = 33", None) == 1.0
    assert domain.score(add, "Let me think.\nThe sum of 22 and 11 is 33.", None) == 1.0
    assert domain.score(add, "22 + 11 = 33\nThis is because we add.", None) == 0.0
    assert extract_answer("To solve for x, we need") is None


@pytest.mark.parametrize("text", ["Answer: 8/16", "Answer: 0.53", "nothing", "Answer: nan",
                                  "Answer: x^2 - 8x + 13", "Answer: (x-2)*(x+6)"])
def test_wrong_answers_score_zero(domain: Math, text: str) -> None:
    item = FRAC if "x" not in text else POLY
    assert domain.score(item, text, None) == 0.0


@pytest.mark.parametrize("text", [
    'Answer: open("/etc/passwd").read()',  # parse_expr evaluates Python: names are screened
    "Answer: __import__('os').system('true')",
    "Answer: 9**9**9",  # exponent tower
    "Answer: 2**100000",  # huge exponent
    "Answer: " + "(x+1)*" * 60 + "1",  # too long
    "Answer: lambda: 0",
])
def test_hostile_answers_are_refused_before_parsing(domain: Math, text: str) -> None:
    answer = extract_answer(text)
    assert answer is None or screen(answer) is None
    assert domain.score(POLY, text, None) == 0.0


def test_a_parse_that_misses_its_deadline_is_killed_and_counts_as_wrong() -> None:
    checker = SymbolicChecker(deadline_s=0.5)
    try:
        assert checker.equal("x + 1", "1 + x")  # warm: sympy imported
        heavy = "(x+1)**64*(x+2)**64*(x+3)**64*(x+4)**64 - 1"  # passes the screen, slow
        assert screen(heavy) is not None
        assert not checker.equal(heavy, "(x+1)**64")
        assert checker.restarts == 1  # wrong because its worker was killed at the deadline
        assert checker.equal("2*x", "x + x")  # a fresh worker serves the next call
    finally:
        checker.close()


def test_numbers_fast_path_needs_no_sympy() -> None:
    assert equivalent("1,000", "1000")
    assert not equivalent("1e400", "1000")  # not a plain number, and not allowed by screen
    with pytest.raises(VerifierFailed):  # as a reference: the check cannot read it
        equivalent("1e400", "1e400")
