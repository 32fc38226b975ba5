"""The standard tool set of sandbox domains, acting on one episode's sandbox session.

Tools (:data:`TOOLS`, declared for ``inference.chat``): ``read_file``, ``write_file``,
``apply_patch`` (a unified diff), ``list_files``, ``run`` (a shell command with a timeout),
``run_tests`` (the domain's pytest command; results per test, :mod:`.pytest_report`) and
``finish``. :class:`StandardTools` answers a parsed reply's calls in order, each with one
:class:`~streamrl.inference.chat.ToolResult`.

Guarantees:
- nothing the model asks for raises: a refused call (malformed, unknown tool, bad
  arguments), a bad path, a patch that does not apply, a command that fails, hangs or floods
  its output: each is a result, ``error=True`` where the tool refused. Only the
  infrastructure raises (``SandboxUnavailable``, retryable);
- paths stay inside the work dir: absolute paths, ``..``, NUL bytes and over-long paths are
  refused before the sandbox is asked; files are read and written through the session's
  ``get_files`` / ``put_files``, which never follow a link (a link the model planted with
  ``run``, at the path or at any directory on the way, reads as "not a regular file", and a
  write replaces the link instead of writing through it); ``list_files`` refuses a directory
  reached through a link and lists links as links;
- every result is at most ``ToolLimits.output_chars`` characters (cut with a marker saying
  how much); a command's own output is also capped by the session (``Limits.output_bytes``);
- ``apply_patch`` is all or nothing: every hunk must match the file exactly (context and
  removed lines; only its position may differ from the header's line numbers, to the nearest
  exact match after the previous hunk), a file's old and new names must be the same (no
  renames), no file twice; otherwise nothing is written;
- ``run_tests`` writes pytest's JUnit report to a fresh random name in the work dir, reads
  it without following links and removes it. What it reports is feedback to the model only.

Not covered: the session's own limits bound every command (``run``'s ``timeout_s`` and the
test timeout only shorten them); what a command does inside the sandbox is the sandbox's to
contain (a link planted there leads wherever the sandbox lets ``cat`` go: these tools only
promise not to follow it themselves).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from streamrl.domains.kinds import TestResult
from streamrl.domains.tools.pytest_report import (
    JUNIT_ARGS,
    clip,
    parse_junit,
    parse_summary,
    render,
)
from streamrl.inference.chat import (
    ParsedReply,
    Tool,
    ToolCall,
    ToolResult,
    error_result,
    validate_arguments,
)
from streamrl.sandbox.base import ExecRequest, ExecResult, SandboxSession

DEFAULT_TEST_COMMAND = ("python3", "-m", "pytest", "-q")
_PATH = {"type": "string", "minLength": 1, "maxLength": 4096,
         "description": "a path relative to the work dir"}


def _object(required: Sequence[str] = (), **properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required),
            "additionalProperties": False}


READ_FILE = Tool(name="read_file", description="Read a text file of the work dir (optionally "
                 "lines start_line..end_line, 1-based, inclusive).", parameters=_object(
                     ["path"], path=_PATH, start_line={"type": "integer", "minimum": 1},
                     end_line={"type": "integer", "minimum": 1}))
WRITE_FILE = Tool(name="write_file", description="Create or replace a text file of the work dir "
                  "with content.", parameters=_object(["path", "content"], path=_PATH,
                                                      content={"type": "string"}))
APPLY_PATCH = Tool(name="apply_patch", description="Apply a unified diff (--- a/path, +++ b/path,"
                   " @@ hunks) to files of the work dir; all hunks must match exactly, or nothing"
                   " changes. --- /dev/null creates a file, +++ /dev/null deletes one.",
                   parameters=_object(["patch"], patch={"type": "string", "minLength": 1}))
LIST_FILES = Tool(name="list_files", description="List the files under a directory of the work "
                  "dir (default: the work dir), three levels deep.",
                  parameters=_object(path=_PATH))
RUN = Tool(name="run", description="Run a shell command (sh -c) in the work dir; returns its exit "
           "code and output.", parameters=_object(
               ["command"], command={"type": "string", "minLength": 1, "maxLength": 16384},
               timeout_s={"type": "number", "exclusiveMinimum": 0, "maximum": 600}))
RUN_TESTS = Tool(name="run_tests", description="Run the task's tests (pytest), or only the given "
                 "test ids or files; returns each test's result with its failure message.",
                 parameters=_object(tests={"type": "array", "maxItems": 64, "items": {
                     "type": "string", "pattern": r"^[^\s-]\S*$", "maxLength": 512}}))
FINISH = Tool(name="finish", description="End the episode (the work is done).",
              parameters=_object(summary={"type": "string", "maxLength": 4096}))
TOOLS: tuple[Tool, ...] = (READ_FILE, WRITE_FILE, APPLY_PATCH, LIST_FILES, RUN, RUN_TESTS, FINISH)


@dataclass(frozen=True)
class ToolLimits:
    output_chars: int = 8000  # one tool result
    message_chars: int = 600  # one test's failure message
    run_timeout_s: float = 10.0  # run's default and largest timeout
    test_timeout_s: float = 60.0  # run_tests
    list_entries: int = 400


class ToolRefused(Exception):
    """The tool cannot do what the call asks (a bad path, a patch that does not apply)."""


class StandardTools:
    """The standard tools on ``session`` (one episode member's). ``finished`` once the model
    called ``finish``; ``last_tests``: the per-test results of the last ``run_tests``."""

    tools = TOOLS

    def __init__(self, session: SandboxSession, *, test_command: Sequence[str] =
                 DEFAULT_TEST_COMMAND, limits: ToolLimits | None = None) -> None:
        self.session = session
        self.test_command = tuple(test_command)
        self.limits = limits or ToolLimits()
        self.finished = False
        self.summary = ""
        self.last_tests: list[TestResult] = []

    async def answer(self, reply: ParsedReply) -> list[ToolResult]:
        """One result per call, in order; calls after ``finish`` are not run."""
        results = []
        for call in reply.calls:
            if self.finished:
                results.append(error_result(call, "the episode is finished"))
            else:
                results.append(await self.call(call))
        return results

    async def call(self, call: ToolCall) -> ToolResult:
        if call.error:
            return error_result(call)
        tool = next((t for t in self.tools if t.name == call.name), None)
        if tool is None:
            return error_result(call, f"unknown tool {call.name!r}")
        problems = validate_arguments(tool, call.arguments)  # a call built elsewhere, too
        if problems:
            return error_result(call, f"bad arguments for {call.name}: " + "; ".join(problems))
        handler = getattr(self, f"_tool_{call.name}")
        try:
            text = await handler(**call.arguments)
        except ToolRefused as exc:
            return error_result(call, str(exc))
        return ToolResult(call_id=call.id, name=call.name,
                          content=clip(text, self.limits.output_chars))

    # -- the tools ------------------------------------------------------------------------

    async def _tool_read_file(self, path: str, start_line: int = 1,
                              end_line: int | None = None) -> str:
        text = await self._read_text(checked_path(path))
        if start_line == 1 and end_line is None:
            return text
        lines = text.splitlines(keepends=True)
        return "".join(lines[start_line - 1:end_line])

    async def _tool_write_file(self, path: str, content: str) -> str:
        rel = checked_path(path)
        data = content.encode()
        await self.session.put_files({rel: data})
        return f"wrote {rel} ({len(data)} bytes)"

    async def _tool_apply_patch(self, patch: str) -> str:
        files = parse_patch(patch)
        current = await self.session.get_files([f.path for f in files if f.old])
        writes: dict[str, bytes] = {}
        deletes: list[str] = []
        for f in files:
            data = current.get(f.path) if f.old else None
            if f.old and data is None:
                raise ToolRefused(f"{f.path}: not a regular file in the work dir (links are not "
                                  "followed)")
            if not f.old and (await self.session.get_files([f.path]))[f.path] is not None:
                raise ToolRefused(f"{f.path}: already exists (--- /dev/null creates a file)")
            text = _decode(f.path, data) if data is not None else ""
            new = apply_hunks(f.path, text, f.hunks)
            if f.new:
                writes[f.path] = new.encode()
            elif new:
                raise ToolRefused(f"{f.path}: a deletion must remove every line")
            else:
                deletes.append(f.path)
        if writes:
            await self.session.put_files(writes)
        for path in deletes:
            await self._exec(["rm", "-f", "--", path])
        done = [f"patched {p}" for p in writes] + [f"deleted {p}" for p in deletes]
        return "\n".join(done)

    async def _tool_list_files(self, path: str = ".") -> str:
        rel = "." if path.strip() in (".", "./") else checked_path(path)
        r = await self._exec(["sh", "-c", _LIST_SCRIPT, "sh", rel])
        if r.exit_code == 3:
            raise ToolRefused(f"{rel}: a symbolic link on the way is not followed")
        if r.exit_code == 4:
            raise ToolRefused(f"{rel}: not a directory")
        if not r.ok:
            raise ToolRefused(f"listing failed: {_text(r.stderr)[-300:]}")
        rows = sorted(_text(r.stdout).splitlines(), key=lambda row: row.split(" ", 2)[-1])
        out = []
        for row in rows:
            kind, size, name = ([*row.split(" ", 2), "", ""])[:3]
            name = name.removeprefix("./")
            out.append({"d": f"{name}/", "f": f"{name} ({size} bytes)",
                        "l": f"{name} (symbolic link, not followed)"}.get(kind, f"{name} ({kind})"))
        more = len(out) - self.limits.list_entries
        out = out[:self.limits.list_entries] + ([f"[... {more} more]"] if more > 0 else [])
        return "\n".join(out) or "(empty)"

    async def _tool_run(self, command: str, timeout_s: float | None = None) -> str:
        limit = min(timeout_s or self.limits.run_timeout_s, self.limits.run_timeout_s)
        r = await self._exec([*_timeout(limit), "sh", "-c", command])
        return self._render_exec(r, limit)

    async def _tool_run_tests(self, tests: Sequence[str] = ()) -> str:
        for t in tests:
            checked_path(t.split("::", 1)[0])
        report = f".streamrl-junit-{secrets.token_hex(16)}.xml"
        argv = [*self.test_command, *JUNIT_ARGS, f"--junitxml={report}", *tests]
        r = await self._exec(_timeout(self.limits.test_timeout_s) + argv)
        xml = (await self.session.get_files([report]))[report]
        await self._exec(["rm", "-f", "--", report])
        budget = self.limits.message_chars
        results = parse_junit(xml, budget) if xml is not None else None
        output = _text(r.stdout) + _text(r.stderr)
        if not results:
            results = parse_summary(output, budget)
        self.last_tests = list(results)
        timed_out = r.timed_out or r.exit_code == 124
        return render(results, r.exit_code, timed_out, clip(output, 2000, tail=True),
                      self.limits.output_chars)

    async def _tool_finish(self, summary: str = "") -> str:
        self.finished, self.summary = True, summary
        return "finished"

    # -- helpers --------------------------------------------------------------------------

    async def _exec(self, argv: list[str]) -> ExecResult:
        return await self.session.run(ExecRequest(argv=argv))

    async def _read_text(self, rel: str) -> str:
        data = (await self.session.get_files([rel]))[rel]
        if data is None:
            raise ToolRefused(f"{rel}: not a regular file in the work dir (missing, a directory,"
                              " or a link: links are not followed)")
        return _decode(rel, data)

    def _render_exec(self, r: ExecResult, limit: float) -> str:
        if r.timed_out or r.exit_code == 124:
            status = f"timed out after {limit:g} s"
        else:
            status = f"exit code {r.exit_code}" + (" (out of memory)" if r.oom_killed else "")
        half = self.limits.output_chars // 2 - 100
        parts = [status]
        for name, data, dropped in (("stdout", r.stdout, r.stdout_dropped),
                                    ("stderr", r.stderr, r.stderr_dropped)):
            text = _text(data)
            if text or dropped:
                cut = f" ({dropped} more bytes dropped)" if dropped else ""
                parts.append(f"{name}{cut}:\n{_head_tail(text, half)}")
        return "\n".join(parts)


def checked_path(path: str) -> str:
    """``path`` as a clean relative path inside the work dir, or :class:`ToolRefused`."""
    if "\x00" in path or not path.strip():
        raise ToolRefused(f"bad path {path[:80]!r}")
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


# --------------------------------------------------------------------------- unified diffs


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


def apply_hunks(path: str, text: str, hunks: list[Hunk]) -> str:
    """``text`` with ``hunks`` applied exactly (see the module docstring)."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0  # lines[:pos] are done
    for n, hunk in enumerate(hunks, 1):
        old = [body for tag, body in hunk.lines if tag != "+"]
        new = [body for tag, body in hunk.lines if tag != "-"]
        want = max(hunk.old_start - 1 if old else hunk.old_start, pos)
        at = _find(lines, old, want, pos)
        if at is None:
            shown = "".join(old[:3])[:200]
            raise ToolRefused(f"{path}: hunk {n} does not apply (no exact match of its "
                              f"context and removed lines, starting {shown!r})")
        out += lines[pos:at] + new
        pos = at + len(old)
    return "".join(out + lines[pos:])


def _find(lines: list[str], block: list[str], want: int, start: int) -> int | None:
    """The position >= ``start`` nearest ``want`` where ``block`` matches exactly."""
    span = len(lines) - len(block)
    for d in range(0, max(span - start, 0) + abs(want - start) + 1):
        for at in {want - d, want + d}:
            if start <= at <= span and lines[at:at + len(block)] == block:
                return at
    return None


# --------------------------------------------------------------------------- helpers


_LIST_SCRIPT = r"""
cur=.
IFS=/
set -f
for part in $1; do
  if [ -z "$part" ] || [ "$part" = . ]; then continue; fi
  cur="$cur/$part"
  if [ -L "$cur" ]; then exit 3; fi
done
unset IFS
[ -d "$cur" ] || exit 4
exec find "$cur" -mindepth 1 -maxdepth 3 \( -name .git -o -name __pycache__ \
  -o -name '.streamrl-*' \) -prune -o -printf '%y %s %p\n'
"""


def _timeout(seconds: float) -> list[str]:
    return ["timeout", "-k", "1", f"{seconds:g}"]


def _decode(path: str, data: bytes) -> str:
    if b"\x00" in data[:8192]:
        raise ToolRefused(f"{path}: a binary file ({len(data)} bytes)")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise ToolRefused(f"{path}: not UTF-8 text") from None


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _head_tail(text: str, half: int) -> str:
    if len(text) <= 2 * half:
        return text.rstrip("\n")
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
