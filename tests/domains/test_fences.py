"""The one fenced-block pattern the domains share (domains/fences.py)."""

from __future__ import annotations

from streamrl.domains.fences import PYTHON, SHELL, block_or_text, fence


def test_a_block_of_the_languages_or_untagged_and_cut_off_unless_closed() -> None:
    text = "Here:\n```python3\nprint(1)\n```\nand\n```\nprint(2)"
    assert block_or_text(text) == "print(1)"
    assert [m.group(1) for m in fence(PYTHON).finditer(text)] == ["print(1)\n", "print(2)"]
    assert [m.group(1) for m in fence(PYTHON, closed=True).finditer(text)] == ["print(1)\n"]
    assert block_or_text("```bash\nls\n```", fence(PYTHON)) == "```bash\nls\n```"  # not ours
    assert block_or_text("```Shell\nls -l\n```", fence(SHELL)) == "ls -l"
    assert block_or_text("  just text\n") == "just text"
