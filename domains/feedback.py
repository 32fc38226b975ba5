"""``code`` with feedback: attempt, run the visible tests, show the model what failed and why,
next attempt, up to ``max_turns``; then a final check decides the reward.

``[domain.<name>.feedback] enabled = true`` makes a code domain a
:class:`~streamrl.domains.base.MultiTurnDomain` (:func:`feedback_domain`): the built-in
``code`` domain, and declared domains of the ``python_tests`` (HumanEval / MBPP) and
``stdio`` (APPS) kinds. Every turn:

- the program (the first fenced block of the reply, as in the single-shot domain) runs in
  the member's sandbox session on the item's **visible** tests, through the kind's own
  harness (its guarantees hold: the program cannot forge a result); it is also staged in the
  session as the member's latest program;
- the observation is the per-test result, compact (:func:`render_results`): a count line,
  then ``FAIL`` / ``ERROR`` lines with their message (the assertion, the value returned vs
  the expected one, the traceback or stderr tail, each cut to ``message_chars``), then the
  passing tests' names, all within ``observation_chars``;
- the member is done once every visible test passed.

What is visible: with ``visible_column`` (a declared domain's column of visible tests, e.g.
MBPP's ``test_list``), those tests, and the item's ``tests`` are the hidden final check
alone; otherwise the first ceil(``visible_fraction`` x n) of the item's n tests (at least
one: the built-in ``code`` item's cases, a ``python_tests`` program's assert statements in
order, a ``stdio`` item's cases), and the final check runs all n, the rest never shown.

The final check (``final_request``, when the member ended: done, ``max_turns``, a budget)
runs the latest program on the final tests through ``feedback_final.py`` and the harness,
under a nonce of its own; :func:`episode_reward` turns its pass fraction and the number of
turns into the reward (``final``, ``early_bonus``, ``turn_penalty``), always in [0, 1].
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import msgspec

from streamrl.config.schema import FEEDBACK_TURNS, DomainConfig, FeedbackConfig
from streamrl.domains.base import EpisodePolicy, SandboxSpec
from streamrl.domains.kinds import Record, TestResult
from streamrl.protocol.messages import Turn
from streamrl.sandbox.base import ExecRequest, ExecResult

LAUNCHER = "feedback_final.py"
LAUNCHER_SOURCE = (Path(__file__).parent / LAUNCHER).read_bytes()
PROGRAM_FILE = ".streamrl-program"
TURN_TAG = "```python\n# a turn's visible tests\n```"
FINAL_TAG = "```python\n# the final check of the latest program\n```"
"""Stand-ins for the completion in the nonces (a turn's result is read without its text; the
final check's program is the staged file): constants, keyed like the kind's own nonce."""
NO_CODE = "No code found. Reply with the whole program in one ```python block."


# -- the pieces a reader can check by hand ------------------------------------------------


def visible_count(n: int, fraction: float) -> int:
    return min(n, max(1, math.ceil(fraction * n))) if n else 0


def render_results(results: Sequence[TestResult], observation_chars: int = 1500,
                   message_chars: int = 300) -> str:
    """The per-test results as the model sees them, at most ``observation_chars``."""
    passed = [r for r in results if r.status == "pass"]
    failed = [r for r in results if r.status != "pass"]
    head = f"{len(passed)}/{len(results)} tests passed."
    if not failed:
        head += " All visible tests pass."
    lines = [head]
    for r in failed:
        label = "FAIL" if r.status == "fail" else r.status.upper()
        message = " ".join(r.message.split())
        if len(message) > message_chars:
            message = message[: message_chars - 3] + "..."
        lines.append(f"{label} {r.name}" + (f": {message}" if message else ""))
    lines.extend(f"PASS {r.name}" for r in passed)
    out: list[str] = []
    used = 0  # characters in out, with the newlines after them
    for k, line in enumerate(lines):
        room = observation_chars - used
        if sum(len(rest) + 1 for rest in lines[k:]) - 1 <= room:
            out.extend(lines[k:])
            break
        marker = f"[... {len(lines) - k} more lines cut]"
        if len(line) + 1 + len(marker) > room:
            out.append(marker)
            break
        out.append(line)
        used += len(line) + 1
    return "\n".join(out)


def render_failure(result: ExecResult | None, limit: int) -> str:
    """The observation when the tests produced no trustworthy report."""
    if result is None:
        return NO_CODE
    status = "timed out" if result.timed_out else f"exit code {result.exit_code}"
    tail = result.stderr.decode("utf-8", "replace").strip()[-limit:]
    return f"The tests did not run to the end ({status})." + (f"\n{tail}" if tail else "")


def episode_reward(passed: float, turns: int, max_turns: int, opts: FeedbackConfig) -> float:
    """The reward of a member whose final check passed the fraction ``passed`` of its tests
    after ``turns`` model turns (of at most ``max_turns``)."""
    base = float(passed >= 1.0) if opts.final == "all_pass" else passed
    reward = (1 - opts.early_bonus) * base
    if passed >= 1.0 and opts.early_bonus:
        left = (max_turns - turns) / (max_turns - 1) if max_turns > 1 else 1.0
        reward += opts.early_bonus * max(0.0, left)
    reward -= opts.turn_penalty * max(0, turns - 1)
    return min(1.0, max(0.0, reward))


def _select_tests(program: str, k: int) -> tuple[str, int]:
    """``program`` with only its first ``k`` tests, and how many tests it has in all (a test
    is a statement holding an ``assert``, at top level or in ``check``'s body, numbered in
    order as the harness numbers them)."""
    tree = ast.parse(program)
    seen = 0

    def keep(stmts: list[ast.stmt]) -> list[ast.stmt]:
        nonlocal seen
        out: list[ast.stmt] = []
        for stmt in stmts:
            if isinstance(stmt, ast.FunctionDef) and stmt.name == "check":
                stmt.body = keep(stmt.body) or [ast.Pass()]
            elif not isinstance(stmt, ast.FunctionDef | ast.ClassDef) and any(
                    isinstance(n, ast.Assert) for n in ast.walk(stmt)):
                seen += 1
                if seen > k:
                    continue
            out.append(stmt)
        return out

    tree.body = keep(tree.body)
    return ast.unparse(tree) + "\n", seen


def first_tests(program: str, k: int) -> str:
    """A ``python_tests`` program with only its first ``k`` tests."""
    return _select_tests(program, k)[0]


def count_tests(program: str) -> int:
    return _select_tests(program, 0)[1]


# -- the test suites of the code kinds ---------------------------------------------------


class Suite(Protocol):
    """A code kind's tests split into the visible ones and the final check."""

    program_key: str  # the harness input's field that holds the program
    harness: str  # the harness file (staged by the kind's sandbox spec)

    def visible(self, item: Any) -> Any: ...

    def final(self, item: Any) -> Any: ...

    def exec_request(self, item: Any, completion: str) -> ExecRequest | None: ...

    def test_results(self, item: Any, completion: str,
                     result: ExecResult | None) -> list[TestResult]: ...

    def nonce(self, item: Any, completion: str) -> str: ...


class CodeSuite:
    """The built-in ``code`` domain: an item's cases; the first ones visible."""

    program_key = "source"

    def __init__(self, code: Any, opts: FeedbackConfig) -> None:
        from streamrl.domains.code import domain as code_module

        if opts.visible_column:
            raise ValueError("feedback.visible_column: the code domain's items have no columns")
        self.code, self.module, self.fraction = code, code_module, opts.visible_fraction
        self.harness = code_module.HARNESS

    def visible(self, item: Any) -> Any:
        return msgspec.structs.replace(
            item, tests=item.tests[: visible_count(len(item.tests), self.fraction)])

    def final(self, item: Any) -> Any:
        return item

    def exec_request(self, item: Any, completion: str) -> ExecRequest | None:
        return self.code.exec_request(item, completion, report=True)  # type: ignore[no-any-return]

    def test_results(self, item: Any, completion: str,
                     result: ExecResult | None) -> list[TestResult]:
        return self.code.test_results(item, completion, result)  # type: ignore[no-any-return]

    def nonce(self, item: Any, completion: str) -> str:
        return self.module.nonce(item, completion)  # type: ignore[no-any-return]


class RecordSuite:
    """A declared domain of the ``python_tests`` or ``stdio`` kind over :class:`Record`s."""

    program_key = "program"

    def __init__(self, verifier: Any, opts: FeedbackConfig) -> None:
        from streamrl.domains.kinds.pytests import PythonTests

        self.verifier, self.opts = verifier, opts
        self.python = isinstance(verifier, PythonTests)
        self.harness = next(iter(verifier.sandbox.files))

    def visible(self, item: Record) -> Record:
        column = self.opts.visible_column
        if column:
            return msgspec.structs.replace(item, tests=item.extra.get(column))
        if self.python:
            from streamrl.domains.kinds.pytests import test_program

            program = test_program(item)
            k = visible_count(count_tests(program), self.opts.visible_fraction)
            return msgspec.structs.replace(item, tests=first_tests(program, k))
        cases = self.verifier.cases(item)
        return msgspec.structs.replace(
            item, tests=cases[: visible_count(len(cases), self.opts.visible_fraction)])

    def final(self, item: Record) -> Record:
        return item

    def check_item(self, item: Record) -> None:
        if self.opts.visible_column and self.opts.visible_column not in item.extra:
            raise ValueError(f"item {item.id!r}: no visible tests column "
                             f"{self.opts.visible_column!r}")
        self.verifier.check_item(self.visible(item))

    def exec_request(self, item: Record, completion: str) -> ExecRequest | None:
        return self.verifier.exec_request(item, completion)  # type: ignore[no-any-return]

    def test_results(self, item: Record, completion: str,
                     result: ExecResult | None) -> list[TestResult]:
        return self.verifier.test_results(item, completion, result)  # type: ignore[no-any-return]

    def nonce(self, item: Record, completion: str) -> str:
        return self.verifier.nonce(item, completion)  # type: ignore[no-any-return]


# -- the domain ---------------------------------------------------------------------------


class FeedbackDomain:
    """A code domain as a multi-turn one with test feedback (see the module docstring)."""

    def __init__(self, base: Any, suite: Suite, opts: FeedbackConfig, max_turns: int) -> None:
        self.base, self.suite, self.opts = base, suite, opts
        self.name = base.name
        self.item_type = base.item_type
        self.default_max_new_tokens = base.default_max_new_tokens
        spec: SandboxSpec = base.sandbox
        self.sandbox = replace(spec, files={**spec.files, LAUNCHER: LAUNCHER_SOURCE})
        self.episode = EpisodePolicy(multi_turn=True, max_turns=max_turns or FEEDBACK_TURNS)

    def load_items(self, split: str) -> list[Any]:
        items: list[Any] = self.base.load_items(split)
        check = getattr(self.suite, "check_item", None)
        checked: set[str] = self.__dict__.setdefault("_checked", set())
        if check is not None and split not in checked:
            for item in items:
                try:
                    check(item)
                except ValueError as exc:
                    raise ValueError(f"domain {self.name!r} (feedback): {exc}") from None
            checked.add(split)
        return items

    def render_prompt(self, item: Any, tokenizer: Any) -> list[int]:
        return self.base.render_prompt(item, tokenizer)  # type: ignore[no-any-return]

    def session_files(self, item: Any) -> dict[str, bytes]:
        return {}

    def exec_request(self, item: Any, completion_text: str) -> ExecRequest | None:
        visible = self.suite.visible(item)
        request = self.suite.exec_request(visible, completion_text)
        if request is None:
            return None
        spec = json.loads(request.stdin)
        spec["nonce"] = self.suite.nonce(visible, TURN_TAG)
        program = str(spec[self.suite.program_key]).encode()
        return replace(request, stdin=json.dumps(spec).encode(),
                       files={**request.files, PROGRAM_FILE: program})

    def visible_results(self, item: Any, result: ExecResult | None) -> list[TestResult]:
        return self.suite.test_results(self.suite.visible(item), TURN_TAG, result)

    def render_observation(self, item: Any, result: ExecResult | None) -> str:
        results = self.visible_results(item, result)
        if not results:
            return render_failure(result, self.opts.message_chars)
        return render_results(results, self.opts.observation_chars, self.opts.message_chars)

    def is_done(self, item: Any, turn_text: str, result: ExecResult | None = None) -> bool:
        results = self.visible_results(item, result)
        return bool(results) and all(r.status == "pass" for r in results)

    def final_request(self, item: Any) -> ExecRequest | None:
        request = self.suite.exec_request(self.suite.final(item), FINAL_TAG)
        if request is None:
            return None
        job = {"harness": self.suite.harness, "key": self.suite.program_key,
               "file": PROGRAM_FILE, "spec": json.loads(request.stdin)}
        return replace(request, argv=["python3", "-I", LAUNCHER],
                       files={**request.files, LAUNCHER: LAUNCHER_SOURCE},
                       stdin=json.dumps(job).encode())

    def final_fraction(self, item: Any, result: ExecResult | None) -> float:
        results = self.suite.test_results(self.suite.final(item), FINAL_TAG, result)
        return sum(r.status == "pass" for r in results) / len(results) if results else 0.0

    def score(self, item: Any, completion_text: str, result: ExecResult | None) -> float:
        """The reward of a one-turn episode (the verifier calls :meth:`score_episode`)."""
        return self.score_turns(item, 1, result)

    def score_episode(self, item: Any, turns: Sequence[Turn], result: ExecResult | None
                      ) -> float:
        return self.score_turns(item, len(turns), result)

    def score_turns(self, item: Any, turns: int, result: ExecResult | None) -> float:
        return episode_reward(self.final_fraction(item, result), max(1, turns),
                              self.episode.max_turns, self.opts)


def feedback_domain(domain: Any, cfg: DomainConfig) -> FeedbackDomain:
    """``domain`` (the built-in code domain, or a declared python_tests / stdio one) with
    test feedback; ``ValueError`` if it is no code domain."""
    from streamrl.domains.code import Code
    from streamrl.domains.kinds.pytests import PythonTests
    from streamrl.domains.kinds.stdio import Stdio

    base = getattr(domain, "base", domain)  # a plugin over declared data: its class
    verifier = getattr(domain, "verifier", None)
    suite: Suite
    if isinstance(base, Code):
        suite = CodeSuite(base, cfg.feedback)
    elif isinstance(verifier, PythonTests | Stdio):
        suite = RecordSuite(verifier, cfg.feedback)
    else:
        raise ValueError("feedback.enabled needs a code domain: the built-in 'code', or a "
                         "declared kind 'python_tests' or 'stdio'")
    return FeedbackDomain(domain, suite, cfg.feedback, cfg.max_turns)
