"""The math domain (entry point ``math = "domains.math:Math"``); see :mod:`domains.math.domain`."""

from domains.math.domain import Math, MathItem, extract_answer

__all__ = ["Math", "MathItem", "extract_answer"]
