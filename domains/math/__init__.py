"""The math domain (entry point ``math = "streamrl.domains.math:Math"``);
see :mod:`streamrl.domains.math.domain`."""

from streamrl.domains.math.domain import Math, MathItem, extract_answer

__all__ = ["Math", "MathItem", "extract_answer"]
