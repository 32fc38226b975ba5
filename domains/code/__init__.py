"""The code domain (entry point ``code = "domains.code:Code"``); see :mod:`domains.code.domain`."""

from domains.code.domain import Case, Code, CodeItem, extract_program, nonce

__all__ = ["Case", "Code", "CodeItem", "extract_program", "nonce"]
