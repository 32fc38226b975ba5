"""The arith demo domain (importing it registers ``"arith"``); see :mod:`domains.arith.domain`."""

from streamrl.domains.arith.domain import Arith, ArithItem, extract_program

__all__ = ["Arith", "ArithItem", "extract_program"]
