"""The arith demo domain (importing it registers ``"arith"``); see :mod:`domains.arith.domain`."""

from domains.arith.domain import Arith, ArithItem, extract_program

__all__ = ["Arith", "ArithItem", "extract_program"]
