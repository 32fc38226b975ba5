"""The math domain tells a reference it cannot read from a wrong answer (issue 32 item 3):
a reference that is neither a number nor a screened expression, or one sympy cannot parse,
is :class:`~streamrl.domains.base.VerifierFailed`; an answer it cannot read still scores 0.
Real sympy worker."""

from __future__ import annotations

import pytest

from streamrl.domains.base import VerifierFailed
from streamrl.domains.math import Math, MathItem
from streamrl.domains.math.equiv import SymbolicChecker, equivalent, screen


def test_a_reference_outside_the_screen_is_a_verifier_failure() -> None:
    with pytest.raises(VerifierFailed, match="cannot check the reference"):
        equivalent("1", "__import__('os')")
    item = MathItem(id="m", prompt="Compute 1/5 + 1/3.", answer="eight fifteenths",
                    kind="fraction_sum")
    with pytest.raises(VerifierFailed, match="cannot check the reference"):
        Math().score(item, "The answer is \\boxed{8/15}", None)
    assert not equivalent("__import__('os')", "8/15")  # while such an answer is just wrong


def test_a_reference_sympy_cannot_parse_is_a_verifier_failure() -> None:
    checker = SymbolicChecker()
    try:
        assert screen("sin(") is not None  # it passes the screen, then fails to parse
        with pytest.raises(VerifierFailed, match="cannot parse the reference 'sin\\('"):
            equivalent("x + 1", "sin(", checker)
        assert not equivalent("sin(", "x + 1", checker)  # an answer that does not parse
        assert equivalent("2*x", "x + x", checker)  # and the worker serves on
        assert checker.restarts == 0
    finally:
        checker.close()
