"""The ``code`` domain: write a Python function; hidden tests decide, in the sandbox.

The program is the first fenced code block of the completion (as in ``arith``). The sandbox
runs ``python3 -I harness.py`` (:mod:`domains.code.harness`, staged by the sandbox spec)
with the source, the entry point, the hidden tests and a nonce on stdin; every test runs in
its own child process with a per-test deadline, and the harness compares the results itself
(type-strict JSON values). Reward = fraction of tests passed, counted only from a result the
harness printed: exit code 0, no host timeout, and stdout exactly one line ``<nonce> <json
list of one boolean per test>``. Anything else scores 0: a submission that prints "PASSED",
exits early (``os._exit(0)`` only ends its own child), edits or deletes files (the tests are
not files), monkey-patches (it never shares a process with the checker), returns an object
whose ``__eq__`` is always True (not a plain JSON value: fails), or floods its output (its
output goes to /dev/null; a flood of the result pipe is cut at a byte cap: fails).

The nonce is an HMAC of the item id and the completion under a key: ``$STREAMRL_VERIFY_KEY``
when set (a deployment sets one per run, the same for executors and verifiers), else the
item's own ``salt`` (like the hidden tests, never shown to the model). Executor and
verifier compute it independently, so it never travels in a message the code can see.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

import msgspec

from streamrl.domains.base import SINGLE_TURN, SandboxSpec, SplitFiles, chat_prompt_ids
from streamrl.domains.fences import block_or_text
from streamrl.domains.kinds import TestResult
from streamrl.domains.kinds.harness_host import check_harness, report_body
from streamrl.sandbox.base import ExecRequest, ExecResult, Limits

DATA_DIR = Path(__file__).parent / "data"
HARNESS = "harness.py"
HARNESS_SOURCE = (Path(__file__).parent / "harness.py").read_bytes()
KEY_ENV = "STREAMRL_VERIFY_KEY"
MAX_NEW_TOKENS = 160
PER_TEST_TIMEOUT_S = 2.0
MAX_RESULT_BYTES = 64 << 10
LIMITS = Limits(timeout_s=20.0, memory_mb=512, cpu_s=20, max_processes=32, max_file_mb=4,
                output_bytes=64 << 10)


class Case(msgspec.Struct, frozen=True):
    args: list[Any]
    expected: Any


class CodeItem(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    prompt: str
    entry: str  # the function's name
    tests: list[Case]  # hidden
    salt: str  # hidden; the nonce key when no $STREAMRL_VERIFY_KEY


def extract_program(text: str) -> str:
    return block_or_text(text)


def nonce(item: CodeItem, completion_text: str) -> str:
    key = (os.environ.get(KEY_ENV) or item.salt).encode()
    msg = item.id.encode() + b"\0" + completion_text.encode("utf-8", "replace")
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


class Code(SplitFiles):
    name = "code"
    item_type = CodeItem
    default_max_new_tokens = MAX_NEW_TOKENS
    episode = SINGLE_TURN
    sandbox = SandboxSpec(limits=LIMITS, files={HARNESS: HARNESS_SOURCE})

    def __init__(self, data_dir: Path = DATA_DIR,
                 per_test_timeout_s: float = PER_TEST_TIMEOUT_S) -> None:
        self.data_dir = data_dir
        self.per_test_timeout_s = per_test_timeout_s

    def render_prompt(self, item: CodeItem, tokenizer: Any) -> list[int]:
        return chat_prompt_ids(tokenizer, item.prompt)

    def exec_request(self, item: CodeItem, completion_text: str,
                     report: bool = False) -> ExecRequest | None:
        """The harness run (``report``: each test's result with its message, for feedback)."""
        source = extract_program(completion_text)
        if not source:
            return None
        spec = {
            "nonce": nonce(item, completion_text),
            "entry": item.entry,
            "source": source,
            "tests": [{"args": c.args, "expected": c.expected} for c in item.tests],
            "timeout_s": self.per_test_timeout_s,
            "max_result_bytes": MAX_RESULT_BYTES,
            "report": report,
        }
        budget = self.per_test_timeout_s * len(item.tests) + 5.0
        limits = Limits(**{**LIMITS.__dict__, "timeout_s": max(LIMITS.timeout_s, budget),
                           "cpu_s": int(max(LIMITS.cpu_s, budget))})
        return ExecRequest(argv=["python3", "-I", HARNESS], files=dict(self.sandbox.files),
                           stdin=json.dumps(spec).encode(), limits=limits)

    def score(self, item: CodeItem, completion_text: str, result: ExecResult | None) -> float:
        """The fraction of tests passed; 0 without a trustworthy report, unless the harness
        failed by itself (``harness_host.check_harness``: not a reward)."""
        passed = _report(item, completion_text, result)
        if passed is None:
            check_harness(result)
        if passed is None or not item.tests:
            return 0.0
        return sum(1 for p in passed if p is True) / len(item.tests)

    def test_results(self, item: CodeItem, completion_text: str,
                     result: ExecResult | None) -> list[TestResult]:
        """Each test's result from a ``report`` run, or [] if there is no trustworthy one."""
        found = _report(item, completion_text, result)
        try:
            return msgspec.convert(found or [], list[TestResult])
        except msgspec.ValidationError:
            return []


def _report(item: CodeItem, completion_text: str, result: ExecResult | None) -> list[Any] | None:
    """The harness's list (one entry per test) if the run printed exactly its one line under
    the right nonce with exit code 0, else None."""
    body = report_body(result, nonce(item, completion_text))
    if body is None:
        return None
    try:
        found = json.loads(body)
    except ValueError:
        return None
    return found if type(found) is list and len(found) == len(item.tests) else None
