"""The standard tool set of sandbox domains, acting on one episode's sandbox session.

Tools (:data:`TOOLS`, declared for ``inference.chat``): ``read_file``, ``write_file``,
``apply_patch`` (a unified diff), ``list_files``, ``run`` (a shell command with a timeout),
``run_tests`` (the domain's pytest command; results per test, :mod:`.pytest_report`) and
``finish``. :class:`StandardTools` answers a parsed reply's calls in order, each with one
:class:`~streamrl.inference.chat.ToolResult`.

Guarantees:
- nothing the model asks for raises: a refused call (malformed, unknown tool, bad
  arguments), a bad path, a patch that does not apply, a command that fails, hangs or floods
  its output, a directory where a file is expected, text no file or command can hold (a
  lone surrogate, valid JSON; a NUL in a command), a write that what the model did keeps
  from happening (a disk it filled: the sandbox's ``WriteRefused``; a directory it made
  read-only does not: the sandbox writes anyway), a deletion its permissions keep out: each
  is a result, ``error=True`` where the tool refused, saying what was wrong. Only the
  infrastructure raises (``SandboxUnavailable``, retryable);
- no model input holds the event loop: a patch is parsed and placed (:mod:`.diff`, linear
  in the file and the patch) and a test report parsed in a worker thread, each against
  ``ToolLimits.host_timeout_s`` (past it the call is refused, or the report ignored);
- a command is reported "timed out" when its limit ended it, SIGKILLed because it ignored
  SIGTERM included; exit codes 124 and 137 that the command reached on its own before
  its limit are reported as they are;
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
  renames), no file twice, a file it creates must not exist (not even as a directory);
  otherwise nothing is written (deletions go first and stop it when one fails; a write the
  sandbox refuses part way, a full disk, leaves the deletions and the files before it);
- ``run_tests`` writes pytest's JUnit report to a fresh random name in the work dir, reads
  it without following links and removes it. What it reports is feedback to the model only.

Not covered: the session's own limits bound every command (``run``'s ``timeout_s`` and the
test timeout only shorten them); what a command does inside the sandbox is the sandbox's to
contain (a link planted there leads wherever the sandbox lets ``cat`` go: these tools only
promise not to follow it themselves).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import trio

from streamrl.domains.kinds import TestResult
from streamrl.domains.tools.diff import (
    FilePatch,
    ToolRefused,
    apply_hunks,
    checked_path,
    parse_patch,
)
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
from streamrl.sandbox.base import (
    ExecRequest,
    ExecResult,
    SandboxSession,
    WriteRefused,
    check_text,
)

__all__ = ["TOOLS", "StandardTools", "ToolLimits", "ToolRefused", "apply_hunks", "checked_path",
           "parse_patch"]
T = TypeVar("T")

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
    host_timeout_s: float = 10.0  # placing one patch's hunks, parsing one test report


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
        data = _encoded("content", content)
        await self._put({rel: data})
        return f"wrote {rel} ({len(data)} bytes)"

    async def _tool_apply_patch(self, patch: str) -> str:
        _encoded("patch", patch)
        files = await _off_loop(parse_patch, patch)
        current = await self._get([f.path for f in files])
        for f in files:
            if f.old and current[f.path] is None:
                raise ToolRefused(f"{f.path}: not a regular file in the work dir (missing, a "
                                  "directory, unreadable, or a link: links are not followed)")
            if not f.old and (current[f.path] is not None or await self._exists(f.path)):
                raise ToolRefused(f"{f.path}: already exists (--- /dev/null creates a file)")
        deadline = time.monotonic() + self.limits.host_timeout_s
        writes, deletes = await _off_loop(_patched, files, current, deadline)
        for path in deletes:  # (first: one the model's permissions keep changes nothing)
            r = await self._exec(["rm", "-f", "--", path])
            if not r.ok:
                raise ToolRefused(f"{path}: cannot delete it: {_text(r.stderr)[-300:].strip()}")
        if writes:
            await self._put(writes)
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
        _checked_text("command", command)
        limit = min(timeout_s or self.limits.run_timeout_s, self.limits.run_timeout_s)
        r = await self._exec([*_timeout(limit), "sh", "-c", command])
        return self._render_exec(r, limit)

    async def _tool_run_tests(self, tests: Sequence[str] = ()) -> str:
        for t in tests:
            checked_path(t.split("::", 1)[0])
            _checked_text(f"test {t[:80]!r}", t)
        report = f".streamrl-junit-{secrets.token_hex(16)}.xml"
        argv = [*self.test_command, *JUNIT_ARGS, f"--junitxml={report}", *tests]
        limit = self.limits.test_timeout_s
        r = await self._exec(_timeout(limit) + argv)
        xml = (await self._get([report]))[report]
        await self._exec(["rm", "-f", "--", report])
        deadline = time.monotonic() + self.limits.host_timeout_s
        results, text = await _off_loop(_test_report, xml, r, _timed_out(r, limit),
                                        self.limits, deadline)
        self.last_tests = results
        return text

    async def _tool_finish(self, summary: str = "") -> str:
        self.finished, self.summary = True, summary
        return "finished"

    # -- helpers --------------------------------------------------------------------------

    async def _exec(self, argv: list[str]) -> ExecResult:
        try:
            return await self.session.run(ExecRequest(argv=argv))
        except ValueError as exc:  # a request the sandbox cannot express
            raise ToolRefused(str(exc)) from None

    async def _put(self, files: dict[str, bytes]) -> None:
        """Write ``files``; what the model left in the way (a full disk) is the call's
        answer."""
        try:
            await self.session.put_files(files)
        except (WriteRefused, ValueError) as exc:
            raise ToolRefused(str(exc)) from None

    async def _get(self, paths: list[str]) -> dict[str, bytes | None]:
        try:
            return await self.session.get_files(paths)
        except ValueError as exc:
            raise ToolRefused(str(exc)) from None

    async def _exists(self, rel: str) -> bool:
        """Whether anything (a directory, a link, a fifo) is at ``rel``."""
        r = await self._exec(["sh", "-c", '[ -e "$1" ] || [ -L "$1" ]', "sh", rel])
        return r.exit_code == 0

    async def _read_text(self, rel: str) -> str:
        data = (await self._get([rel]))[rel]
        if data is None:
            raise ToolRefused(f"{rel}: not a regular file in the work dir (missing, a directory,"
                              " unreadable, or a link: links are not followed)")
        return _decode(rel, data)

    def _render_exec(self, r: ExecResult, limit: float) -> str:
        if _timed_out(r, limit):
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


def _timed_out(r: ExecResult, limit: float) -> bool:
    """Whether a command run under :func:`_timeout` ran out of time: the sandbox's deadline,
    or ``timeout``'s, which exits 124 after SIGTERM and 137 after the SIGKILL a second later
    (a command that ignores SIGTERM; a shell that does not pass it on). Those exit codes
    before ``limit`` seconds are the command's own."""
    return r.timed_out or (r.exit_code in (124, 137) and r.duration_s >= limit)


async def _off_loop(work: Callable[..., T], *args: Any) -> T:
    """``work(*args)`` in a worker thread: CPU work on the model's input (a patch, a test
    report) never holds the event loop; ``work`` bounds itself with a deadline."""
    return await trio.to_thread.run_sync(work, *args)


def _patched(files: list[FilePatch], current: dict[str, bytes | None],
             deadline: float) -> tuple[dict[str, bytes], list[str]]:
    """What applying ``files`` to ``current`` writes and deletes (:class:`ToolRefused`)."""
    writes: dict[str, bytes] = {}
    deletes: list[str] = []
    for f in files:
        data = current[f.path] if f.old else None
        text = _decode(f.path, data) if data is not None else ""
        new = apply_hunks(f.path, text, f.hunks, deadline)
        if f.new:
            writes[f.path] = new.encode()
        elif new:
            raise ToolRefused(f"{f.path}: a deletion must remove every line")
        else:
            deletes.append(f.path)
    return writes, deletes


def _test_report(xml: bytes | None, r: ExecResult, timed_out: bool, limits: ToolLimits,
                 deadline: float) -> tuple[list[TestResult], str]:
    """Each test's result (from the JUnit report where it has any, else pytest's summary)
    and what the model reads of them."""
    output = _text(r.stdout) + _text(r.stderr)
    budget = limits.message_chars
    results = parse_junit(xml, budget, deadline) if xml is not None else None
    results = results or parse_summary(output, budget)
    text = render(results, r.exit_code, timed_out, clip(output, 2000, tail=True),
                  limits.output_chars)
    return list(results), text


def _checked_text(what: str, text: str) -> None:
    """:class:`ToolRefused` for text no command can receive (a NUL, a lone surrogate)."""
    try:
        check_text(what, text)
    except ValueError as exc:
        raise ToolRefused(str(exc)) from None


def _encoded(what: str, text: str) -> bytes:
    """``text`` as UTF-8; :class:`ToolRefused` for a lone surrogate (valid JSON, no text)."""
    try:
        return text.encode()
    except UnicodeEncodeError as exc:
        raise ToolRefused(f"{what}: not valid Unicode (a lone surrogate "
                          f"U+{ord(text[exc.start]):04X} at character {exc.start})") from None


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
