"""Unified diffs for the standard tools and the repository tasks: parsed, then applied exactly,
in time linear in the file and the patch.

Guarantees:
- :func:`parse_patch` reads a unified diff into its files and hunks, or raises
  :class:`ToolRefused` saying what is wrong (renames, a file twice, counts that do not add
  up, a path outside the work dir: :func:`checked_path`);
- :func:`apply_hunks` applies a file's hunks exactly: each hunk's context and removed lines
  must match the file's lines, at the match nearest the header's line number that starts
  after the previous hunk (the earlier one on a tie); otherwise :class:`ToolRefused`;
- its cost is linear: the file's lines are indexed once (where each distinct line is, and
  prefix hashes with a random base, so a candidate position costs O(1) and only a hash
  match is compared line by line), a hunk is tried only where its rarest line is, and the
  positions tried in one call are capped at ``2 * (file lines + hunk lines) + 100,000``:
  past that, or past ``deadline`` (``time.monotonic()``), it refuses instead of searching
  on. A pure insertion whose header points past the end goes at the end at once.

Not covered: fuzzy matching (whitespace, context that drifted): a hunk matches exactly or not
at all.
"""

from __future__ import annotations

import math
import random
import re
import time
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import PurePosixPath

from streamrl.sandbox.base import check_text

_P = (1 << 61) - 1  # a Mersenne prime: the hashes' modulus
_TRIES_FLOOR = 100_000
_CHECK_EVERY = 1 << 14  # work between two looks at the deadline


class ToolRefused(Exception):
    """The tool cannot do what the call asks (a bad path, a patch that does not apply)."""


def checked_path(path: str) -> str:
    """``path`` as a clean relative path inside the work dir, or :class:`ToolRefused`."""
    if not path.strip():
        raise ToolRefused(f"bad path {path[:80]!r}")
    try:
        check_text(f"path {path[:80]!r}", path)
    except ValueError as exc:
        raise ToolRefused(str(exc)) from None
    rel = PurePosixPath(path)
    if rel.is_absolute():
        raise ToolRefused(f"{path[:200]}: absolute paths are refused (paths are relative to the"
                          " work dir)")
    if ".." in rel.parts:
        raise ToolRefused(f"{path[:200]}: '..' is refused (paths stay inside the work dir)")
    if len(path) > 4096 or any(len(p) > 255 for p in rel.parts):
        raise ToolRefused("path too long")
    if str(rel) == ".":
        raise ToolRefused("a file path is needed")
    return str(rel)


@dataclass
class Hunk:
    old_start: int
    lines: list[tuple[str, str]]  # (' ' | '-' | '+', text with its newline, if any)


@dataclass
class FilePatch:
    path: str
    old: bool  # False: --- /dev/null (a new file)
    new: bool  # False: +++ /dev/null (a deletion)
    hunks: list[Hunk]


_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def parse_patch(text: str) -> list[FilePatch]:
    """The files of a unified diff; :class:`ToolRefused` for anything else."""
    lines = text.splitlines(keepends=True)
    files: list[FilePatch] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            if lines[i].startswith(("+++ ", "@@")):
                raise ToolRefused(f"patch line {i + 1}: {lines[i][:4]!r} outside a file header")
            i += 1  # diff --git, index, prose: skipped
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise ToolRefused(f"patch line {i + 1}: '---' must be followed by '+++'")
        old, new = _header_path(lines[i]), _header_path(lines[i + 1])
        if old is not None and new is not None and old != new:
            raise ToolRefused(f"renames are refused ({old} -> {new})")
        path = old or new
        if path is None:
            raise ToolRefused("a patch of /dev/null")
        if any(f.path == path for f in files):
            raise ToolRefused(f"{path}: twice in one patch")
        i, hunks = _parse_hunks(lines, i + 2)
        if not hunks:
            raise ToolRefused(f"{path}: no hunks")
        files.append(FilePatch(path, old is not None, new is not None, hunks))
    if not files:
        raise ToolRefused("no file headers (--- a/path, +++ b/path) in the patch")
    return files


def _header_path(line: str) -> str | None:
    name = line[4:].rstrip("\n").split("\t", 1)[0].strip()
    if name == "/dev/null":
        return None
    if name.startswith(("a/", "b/")):
        name = name[2:]
    return checked_path(name)


def _parse_hunks(lines: list[str], i: int) -> tuple[int, list[Hunk]]:
    hunks = []
    while i < len(lines) and lines[i].startswith("@@"):
        m = _HUNK.match(lines[i])
        if not m:
            raise ToolRefused(f"patch line {i + 1}: bad hunk header {lines[i][:60]!r}")
        old_left = int(m.group(2) or 1)
        new_left = int(m.group(4) or 1)
        hunk = Hunk(int(m.group(1)), [])
        i += 1
        while old_left > 0 or new_left > 0:
            if i >= len(lines):
                raise ToolRefused("patch ends inside a hunk (its line counts are wrong)")
            line = lines[i]
            tag, body = (line[0], line[1:]) if line not in ("\n", "") else (" ", line)
            if tag not in " -+":
                raise ToolRefused(f"patch line {i + 1}: {line[:60]!r} inside a hunk")
            if tag != "+":
                old_left -= 1
            if tag != "-":
                new_left -= 1
            if old_left < 0 or new_left < 0:
                raise ToolRefused(f"patch line {i + 1}: more lines than the hunk header says")
            hunk.lines.append((tag, body))
            i += 1
            if i < len(lines) and lines[i].startswith("\\"):  # \ No newline at end of file
                hunk.lines[-1] = (tag, body.removesuffix("\n"))
                i += 1
        hunks.append(hunk)
    return i, hunks


def apply_hunks(path: str, text: str, hunks: list[Hunk], deadline: float = math.inf) -> str:
    """``text`` with ``hunks`` applied exactly (see the module docstring)."""
    lines = text.splitlines(keepends=True)
    tries = 2 * (len(lines) + sum(len(h.lines) for h in hunks)) + _TRIES_FLOOR
    try:
        index = LineIndex(lines, deadline, tries)
    except _TooCostly as exc:
        raise ToolRefused(f"{path}: {exc} (the file is too large)") from None
    out: list[str] = []
    pos = 0  # lines[:pos] are done
    for n, hunk in enumerate(hunks, 1):
        old = [body for tag, body in hunk.lines if tag != "+"]
        new = [body for tag, body in hunk.lines if tag != "-"]
        want = max(hunk.old_start - 1 if old else hunk.old_start, pos)
        try:
            at = index.find(old, want, pos)
        except _TooCostly as exc:
            raise ToolRefused(f"{path}: hunk {n}: {exc} (give it the line numbers where it "
                              "applies, or more distinctive context)") from None
        if at is None:
            shown = "".join(old[:3])[:200]
            raise ToolRefused(f"{path}: hunk {n} does not apply (no exact match of its "
                              f"context and removed lines, starting {shown!r})")
        out += lines[pos:at] + new
        pos = at + len(old)
    return "".join(out + lines[pos:])


class _TooCostly(Exception):
    """Placing the hunks would take more than their share of work or time."""


class LineIndex:
    """A file's lines indexed once, in O(lines): each distinct line's positions and a random
    value, and the prefix hashes of the sequence, so a block of m lines is compared with the
    file at any position in O(1) (line by line only where the hashes agree)."""

    def __init__(self, lines: list[str], deadline: float = math.inf,
                 tries: int = 1 << 62) -> None:
        self.lines = lines
        self.deadline = deadline
        self.tries_left = tries  # candidate positions :meth:`find` may still try
        self.base = random.randrange(1 << 20, _P - 1)
        self.value: dict[str, int] = {}
        self.where: dict[str, list[int]] = {}
        self.prefix = [0] * (len(lines) + 1)
        value, where, prefix, base = self.value, self.where, self.prefix, self.base
        for i, line in enumerate(lines):
            if i % _CHECK_EVERY == 0:
                self._in_time()
            v = value.get(line)
            if v is None:
                v = value[line] = random.randrange(1, _P)
                where[line] = []
            where[line].append(i)
            prefix[i + 1] = (prefix[i] * base + v) % _P

    def find(self, block: list[str], want: int, start: int) -> int | None:
        """The position >= ``start`` nearest ``want`` (the earlier on a tie) where ``block``
        matches exactly, or None; :class:`_TooCostly` past the tries left or the deadline."""
        m, n = len(block), len(self.lines)
        if m == 0:
            return min(want, n)
        if any(line not in self.value for line in block) or n - m < start:
            return None
        anchor = min(range(m), key=lambda k: len(self.where[block[k]]))
        spots = self.where[block[anchor]]  # the block starts at spot - anchor
        lo = bisect_left(spots, start + anchor)
        hi = bisect_left(spots, n - m + anchor + 1)
        target = self._hash(block)
        power = pow(self.base, m, _P)
        left = right = bisect_left(spots, want + anchor, lo, hi)
        left -= 1
        while left >= lo or right < hi:
            self._spend()
            take_left = right >= hi or (
                left >= lo and want - (spots[left] - anchor) <= spots[right] - anchor - want)
            at = (spots[left] if take_left else spots[right]) - anchor
            if take_left:
                left -= 1
            else:
                right += 1
            if self._window(at, m, power) == target and self.lines[at:at + m] == block:
                return at
        return None

    def _hash(self, block: list[str]) -> int:
        h = 0
        for line in block:
            h = (h * self.base + self.value[line]) % _P
        return h

    def _window(self, at: int, m: int, power: int) -> int:
        return (self.prefix[at + m] - self.prefix[at] * power) % _P

    def _spend(self) -> None:
        self.tries_left -= 1
        if self.tries_left < 0:
            raise _TooCostly("too many places to try")
        if self.tries_left % _CHECK_EVERY == 0:
            self._in_time()

    def _in_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _TooCostly("out of time placing it")
