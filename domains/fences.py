"""Fenced code blocks in a completion: the one pattern every domain that reads a block uses.

A block is three backticks, an optional info string out of the domain's languages, a
newline, then the body up to the closing fence, or to the end of the text when the
completion was cut off at its token limit (unless the domain scores closed blocks only, as
``cad`` does: a program cut off mid-way is not the model's answer)."""

from __future__ import annotations

import re

PYTHON = ("python3?", "py")
SHELL = ("bash", "sh", "shell", "console")
DIFF = ("diff", "patch", "udiff")
JSON = ("json",)


def fence(languages: tuple[str, ...], *, closed: bool = False) -> re.Pattern[str]:
    """A block whose info string is empty or one of ``languages`` (regular expressions);
    group 1 is its body. ``closed``: only a block with its closing fence."""
    end = "```" if closed else r"(?:```|\Z)"
    return re.compile(rf"```[ \t]*(?:{'|'.join(languages)})?[ \t]*\n(.*?){end}",
                      re.DOTALL | re.IGNORECASE)


PYTHON_BLOCK = fence(PYTHON)


def block_or_text(text: str, pattern: re.Pattern[str] = PYTHON_BLOCK) -> str:
    """The body of the first block matching ``pattern``, else the whole text; stripped."""
    match = pattern.search(text)
    return (match.group(1) if match else text).strip()
