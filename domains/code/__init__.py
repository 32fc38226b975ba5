"""The code domain (entry point ``code = "streamrl.domains.code:Code"``);
see :mod:`streamrl.domains.code.domain`."""

from streamrl.domains.code.domain import Case, Code, CodeItem, extract_program, nonce

__all__ = ["Case", "Code", "CodeItem", "extract_program", "nonce"]
