"""Scripted demonstrations of a generated repository task worked with the standard tools: what
an expert would do, turn by turn, for the tool-use cold start (:mod:`.coldstart`).

A demonstration is a generator of :class:`Step` (one assistant turn: a line of prose and its
tool calls) that is sent each turn's real tool results back and decides the next turn from
them: look at the code and the tests, sometimes run the visible tests first, sometimes write a
test that reproduces the issue and run it (the exposing tests the generator hid, added to the
visible test file), patch, run the tests, finish. Some demonstrations make a mistake first and
recover from what the tools answered:

- ``context``: the reference fix with one context line mis-indented; ``apply_patch`` refuses
  it, the lines are read again, the exact patch follows;
- ``decoy``: another of the template's seeded bugs applied first (the wrong change, in the
  same function where the template has one); the tests show what it broke, the next patch
  undoes it and fixes the bug.

Guarantees: deterministic for (facts, plan, rng); a plan fits the episode's ``max_turns`` and
``max_tool_calls`` as the executor counts them (:func:`choose_plan`); the prose only names
what the tool results showed (failing test names are read from them) or what the task says;
where a result is not what the next step needs (a mistake the tools did not catch, tests that
still fail after the fix) the script raises :class:`Abandon` with the reason instead of going
on. The fix is the item's own ``solution``: the generator made the bug.

Not covered: items without a ``solution`` diff, or whose FAIL_TO_PASS tests are not in one
file of the repository (:func:`task_facts` refuses them); the ``decoy`` mistake needs a
generated item (its template and bug named in the row).
"""

from __future__ import annotations

import random
import re
from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from streamrl.domains.kinds import Record
from streamrl.domains.repo.files import apply_diff, make_diff
from streamrl.domains.repo.templates import TEMPLATES
from streamrl.domains.tools.diff import ToolRefused, parse_patch
from streamrl.protocol.messages import ToolReply


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class Step:
    """One assistant turn: ``content`` (prose, may be empty) and its calls, in order."""

    content: str
    calls: tuple[Call, ...]


Script = Generator[Step, Sequence[ToolReply], Any]
"""Yields the turns, is sent each turn's tool results; a part of one returns what it saw."""


class Abandon(Exception):
    """The demonstration cannot go on as an expert would (the reason is counted)."""


@dataclass(frozen=True)
class Facts:
    """What the script knows of a task: the files, the fix, the tests and the mistakes."""

    module: str  # the file the fix patches
    function: str  # the function it changes
    test_file: str  # the visible test file the FAIL_TO_PASS tests belong to
    failing: tuple[str, ...]  # the FAIL_TO_PASS ids
    fix: str  # the reference diff
    repro: str  # a diff adding the hidden exposing tests to the visible test file ("": none)
    misfit: str  # the fix with one context line mis-indented ("": none)
    hunk: tuple[int, int]  # the lines of the module the fix's first hunk covers
    decoy: str  # a diff applying another seeded bug to the module ("": none)
    decoy_function: str
    undo: str  # the diff from the decoy's module to the fixed one
    statement: str


# --------------------------------------------------------------------------- the facts


def task_facts(item: Record) -> Facts:
    """The facts of ``item`` (a ``repo_tests`` record with an inline ``repo`` and a
    ``solution``); ``ValueError`` for one the script cannot demonstrate."""
    extra = item.extra
    repo, fix = extra.get("repo"), extra.get("solution")
    if not isinstance(repo, dict) or not isinstance(fix, str) or not fix.strip():
        raise ValueError("no inline repository and solution diff to demonstrate")
    files = {p: t.encode() for p, t in repo.items()}
    try:
        [patched] = parse_patch(fix)
        fixed = apply_diff(files, fix)[patched.path].decode()
    except (ToolRefused, ValueError) as exc:
        raise ValueError(f"the solution is not one file's diff that applies: {exc}") from None
    failing = tuple(str(t) for t in extra.get("FAIL_TO_PASS") or ())
    test_files = {t.split("::", 1)[0] for t in failing}
    if len(test_files) != 1 or next(iter(test_files)) not in repo:
        raise ValueError("the FAIL_TO_PASS tests are not in one file of the repository")
    [test_file] = test_files
    module, buggy = patched.path, repo[patched.path]
    start = patched.hunks[0].old_start
    length = sum(kind != "+" for kind, _ in patched.hunks[0].lines)
    hidden = item.tests.get(test_file) if isinstance(item.tests, dict) else None
    repro = make_diff({test_file: repo[test_file].encode()},
                      {test_file: hidden.encode()}) if isinstance(hidden, str) else ""
    changed = start + next((i for i, (k, _) in enumerate(patched.hunks[0].lines) if k != " "), 0)
    decoy, decoy_function, undo = _decoy(extra, module, buggy, fixed, test_file, changed)
    return Facts(module=module, function=enclosing(buggy, changed), test_file=test_file,
                 failing=failing, fix=fix, repro=repro, misfit=_misfit(fix),
                 hunk=(start, start + max(length, 1) - 1), decoy=decoy,
                 decoy_function=decoy_function, undo=undo,
                 statement=str(extra.get("problem_statement") or ""))


def enclosing(source: str, line: int) -> str:
    """The name of the function (or class) whose body holds 1-based ``line``."""
    lines = source.splitlines()
    target = lines[min(line, len(lines)) - 1] if lines else ""
    depth = len(target) - len(target.lstrip())
    for text in reversed(lines[:line - 1]):
        m = re.match(r"(\s*)(?:async\s+)?(?:def|class)\s+(\w+)", text)
        if m and len(m.group(1)) < depth:
            return m.group(2)
    return "the module"


def _misfit(fix: str) -> str:
    """``fix`` with its first non-blank context line re-indented: a patch that does not
    apply (the mistake of a model that misremembers the code)."""
    lines = fix.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith(" ") and line.strip():
            code = line[1:]
            lines[i] = " " + (code[4:] if code.startswith("    ") else "    " + code)
            return "".join(lines)
    return ""


def _decoy(extra: dict[str, Any], module: str, buggy: str, fixed: str, test_file: str,
           line: int) -> tuple[str, str, str]:
    """Another seeded bug of the item's template as a wrong change: ``(diff, function,
    undo)``, the one in the bug's own function where there is one; ``("", "", "")`` where
    no other bug applies or no visible test would show it."""
    template = next((t for t in TEMPLATES if t.name == extra.get("template")), None)
    if template is None:
        return "", "", ""
    visible = set(extra.get("PASS_TO_PASS") or ())
    function = enclosing(buggy, line)
    options = []
    for bug in template.bugs:
        if bug.name == extra.get("bug") or buggy.count(bug.find) != 1 or fixed.count(
                bug.find) != 1:
            continue
        shown = [n for n, _, tags in template.tests
                 if bug.name in tags and f"{test_file}::{n}" in visible]
        if shown:
            at = buggy[:buggy.index(bug.find)].count("\n") + 1
            options.append((enclosing(buggy, at) != function, bug.name, bug, at))
    if not options:
        return "", "", ""
    _, _, bug, at = min(options)
    wrong = buggy.replace(bug.find, bug.replace)
    return (make_diff({module: buggy.encode()}, {module: wrong.encode()}),
            enclosing(buggy, at),
            make_diff({module: wrong.encode()}, {module: fixed.encode()}))


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Plan:
    """The shape of one demonstration, drawn before it runs."""

    reads: tuple[tuple[str, ...], ...]  # turns of reads: "list", "tests", "module"
    baseline: bool  # run the visible tests before anything else
    reproduce: bool  # add the exposing tests and run them
    late_module: bool  # read the module after reproducing
    mistake: str  # "", "context" or "decoy"
    together: bool  # a patch and its test run in one turn

    def turns(self) -> int:
        reproduce = (1 if self.together else 2) if self.reproduce else 0
        mistake = {"": 0, "context": 2, "decoy": 1 if self.together else 2}[self.mistake]
        return (len(self.reads) + self.baseline + reproduce + self.late_module + mistake
                + (2 if self.together else 3))

    def calls_before_finish(self) -> int:
        reproduce = 2 if self.reproduce else 0
        mistake = {"": 0, "context": 2, "decoy": 2}[self.mistake]
        return (sum(map(len, self.reads)) + self.baseline + reproduce + self.late_module
                + mistake + 2)


def choose_plan(facts: Facts, rng: random.Random, max_turns: int, max_tool_calls: int = 0,
                mistakes: float = 0.4) -> Plan:
    """A plan drawn with ``rng`` (a mistake with probability ``mistakes``), simplified until
    it fits ``max_turns`` turns and, before the last turn, fewer than ``max_tool_calls``
    calls (0: no limit); ``ValueError`` when even the simplest does not."""
    names = ["tests", "module"] + (["list"] if rng.random() < 0.4 else [])
    rng.shuffle(names)
    if "list" in names:  # a listing comes first
        names.remove("list")
        names.insert(0, "list")
    reproduce = bool(facts.repro) and rng.random() < 0.5
    late = reproduce and "tests" in names and rng.random() < 0.3
    if late:
        names.remove("module")
    cut = rng.randint(1, len(names))
    reads = tuple(t for t in (tuple(names[:cut]), tuple(names[cut:])) if t)
    kinds = [k for k, ok in (("context", facts.misfit), ("decoy", facts.decoy)) if ok]
    plan = Plan(reads=reads, baseline=rng.random() < 0.25, reproduce=reproduce,
                late_module=late, together=rng.random() < 0.4,
                mistake=rng.choice(kinds) if kinds and rng.random() < mistakes else "")
    for candidate in _simplifications(plan):
        if candidate.turns() <= max_turns and (
                not max_tool_calls or candidate.calls_before_finish() < max_tool_calls):
            return candidate
    raise ValueError(f"no demonstration fits {max_turns} turns and {max_tool_calls} calls")


def _simplifications(plan: Plan) -> Generator[Plan, None, None]:
    """``plan``, then ever simpler versions of it (the last is the simplest there is)."""
    yield plan
    reads = tuple(n for turn in plan.reads for n in turn if n != "list")
    late = ("module",) if plan.late_module else ()
    for change in ({"baseline": False}, {"reads": (reads,)}, {"together": True},
                   {"late_module": False, "reads": (reads + late,)}, {"reproduce": False},
                   {"mistake": ""}):
        plan = replace(plan, **change)
        yield plan


# --------------------------------------------------------------------------- the script


def call(name: str, **arguments: Any) -> Call:
    return Call(name, arguments)


def failures(results: Sequence[ToolReply]) -> list[str]:
    """The tests a ``run_tests`` result lists as failed or in error."""
    return [m.group(2) for r in results
            for m in re.finditer(r"^(FAIL|ERROR) (\S+)", r.content, re.M)]


def _names(tests: Sequence[str]) -> str:
    shown = [f"`{t.split('::')[-1]}`" for t in tests[:3]]
    more = f" and {len(tests) - 3} more" if len(tests) > 3 else ""
    return ", ".join(shown) + more


def _expect(results: Sequence[ToolReply], what: str, *, error: bool = False) -> None:
    if any(r.error != error for r in results):
        raise Abandon(what)


def demonstration(facts: Facts, plan: Plan, rng: random.Random) -> Script:
    """The turns of ``plan`` on ``facts``; each ``yield`` returns that turn's tool results."""
    f = facts
    reads = {"list": call("list_files"), "tests": call("read_file", path=f.test_file),
             "module": call("read_file", path=f.module)}
    for i, turn in enumerate(plan.reads):
        prose = rng.choice(LOOK) if i == 0 else rng.choice(("", "Now the rest."))
        _expect((yield Step(prose, tuple(reads[n] for n in turn))), "a read failed")
    if plan.baseline:
        shown = yield Step(rng.choice(BASELINE), (call("run_tests"),))
        if failures(shown):
            raise Abandon("the visible tests fail before any change")
    seen = (yield from _reproduce(f, plan, rng)) if plan.reproduce else []
    news = f"{_names(seen)} fail{'s' if len(seen) == 1 else ''}, as the issue says. " if seen \
        else ""
    if plan.late_module:
        _expect((yield Step(news + f"The code is in {f.module}.", (reads["module"],))),
                "a read failed")
    prose = rng.choice(FIX).format(function=f.function)
    prose = prose if plan.late_module else news + prose
    fix = f.fix
    if plan.mistake == "context":
        _expect((yield Step(prose, (call("apply_patch", patch=f.misfit),))),
                "the mis-indented patch applied", error=True)
        start, end = f.hunk
        _expect((yield Step(rng.choice(REREAD), (call(
            "read_file", path=f.module, start_line=max(1, start - 2), end_line=end + 2),))),
            "a read failed")
        prose = rng.choice(REFIX).format(function=f.function)
    elif plan.mistake == "decoy":
        broken = yield from _decoy_turns(f, plan, rng)
        where = ("the real bug" if f.decoy_function == f.function
                 else f"`{f.function}` instead")
        fix, prose = f.undo, (f"That broke {_names(broken)}: my change to "
                              f"`{f.decoy_function}` was wrong. Undoing it and fixing {where}.")
    patch = call("apply_patch", patch=fix)
    if plan.together:
        shown = yield Step(prose, (patch, call("run_tests")))
    else:
        _expect((yield Step(prose, (patch,))), "the fix did not apply")
        shown = yield Step(rng.choice(VERIFY), (call("run_tests"),))
    if failures(shown) or any(r.error for r in shown):
        raise Abandon("the tests fail after the fix")
    yield Step(rng.choice(DONE), (call("finish", summary=rng.choice(SUMMARY).format(
        function=f.function, module=f.module)),))


def _reproduce(f: Facts, plan: Plan, rng: random.Random) -> Script:
    """Add the exposing tests to the visible file and run them: they must fail (returns
    the failing ones)."""
    only = list(f.failing) if rng.random() < 0.5 else [f.test_file]
    add, run = call("apply_patch", patch=f.repro), call("run_tests", tests=only)
    if plan.together:
        shown = yield Step(rng.choice(REPRODUCE), (add, run))
    else:
        _expect((yield Step(rng.choice(REPRODUCE), (add,))), "the test patch did not apply")
        shown = yield Step("", (run,))
    seen = failures(shown)
    if not seen:
        raise Abandon("the reproducing tests pass before the fix")
    return seen


def _decoy_turns(f: Facts, plan: Plan, rng: random.Random) -> Script:
    """The wrong change, and the tests that show it wrong (returns what they showed)."""
    prose = rng.choice(GUESS).format(function=f.decoy_function)
    wrong = call("apply_patch", patch=f.decoy)
    if plan.together:
        shown = yield Step(prose, (wrong, call("run_tests")))
    else:
        _expect((yield Step(prose, (wrong,))), "the wrong patch did not apply")
        shown = yield Step(rng.choice(VERIFY), (call("run_tests"),))
    broken = failures(shown)
    if not broken:
        raise Abandon("the wrong change broke no test")
    return broken


LOOK = ("Let me look at the code and its tests.", "", "First, the code.",
        "I'll read the relevant files.")
BASELINE = ("Running the existing tests first.", "")
REPRODUCE = ("First a test that reproduces the issue.",
             "I'll add tests for the behaviour the issue describes, then run them.")
REREAD = ("The patch did not apply: its context does not match the file. Reading those "
          "lines again.", "The context of my patch was wrong; let me check the exact lines.")
FIX = ("The bug is in `{function}`. Fixing it.", "`{function}` is wrong here; the fix:", "")
REFIX = ("Now the patch with the exact lines.", "Fixing `{function}` with the right context.")
GUESS = ("The problem may be in `{function}`.", "Let me try a change to `{function}`.")
VERIFY = ("Running the tests.", "")
DONE = ("All tests pass.", "")
SUMMARY = ("Fixed `{function}` in {module}.", "{module}: `{function}` fixed; the tests pass.")
