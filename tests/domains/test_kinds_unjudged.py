"""Every verifier kind, and the built-in ``code`` domain, tells a failure of its own check
from a wrong answer (issue 32 item 3): a harness that crashed, a test script that wrote no
reward (tests/domains/test_kinds_harbor.py), a reference the scorer cannot read, or a
third-party scorer that raised is :class:`~streamrl.domains.base.VerifierFailed` with the
reason, never a reward of 0; what the model's code did (killing its harness, a garbage
answer) still scores 0. Real process sandbox, real math-verify and reasoning-gym."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import msgspec
import pytest

from streamrl.config.schema import DomainConfig
from streamrl.domains.base import VerifierFailed
from streamrl.domains.code import Code
from streamrl.domains.declared import build_domain
from streamrl.domains.kinds import KINDS, Record
from streamrl.domains.kinds import mathverify as _mathverify  # noqa: F401  (registers it)
from streamrl.domains.kinds.harbor import Harbor
from streamrl.domains.kinds.pytests import PythonTests
from streamrl.domains.kinds.stdio import Stdio
from streamrl.sandbox.process import ProcessSandbox, open_process_sandbox
from tests.domains.test_code import ITEM as CODE
from tests.domains.test_code import fenced
from tests.domains.test_kinds_harbor import _writes
from tests.domains.test_kinds_python_tests import ITEM as ADD
from tests.domains.test_kinds_stdio import ITEM as SUM

UID_BASE = 350_000 + (os.getpid() % 500) * 1024
KINDS_AND_ITEMS = [
    (PythonTests(per_test_timeout_s=1.5), ADD, "    return a + b\n"),
    (Stdio(), SUM, "```python\na, b = map(int, input().split())\nprint(a + b)\n```"),
    (Harbor(solution_timeout_s=3.0, test_timeout_s=3.0), _writes("1"), "```bash\ntrue\n```"),
    (Code(per_test_timeout_s=1.5), CODE, fenced("def add_3(xs):\n    return [x + 3 for x in xs]")),
]


@pytest.fixture
async def box():  # type: ignore[no-untyped-def]
    async with open_process_sandbox(uid_base=UID_BASE) as sandbox:
        yield sandbox


@pytest.mark.parametrize(("verifier", "item", "right"), KINDS_AND_ITEMS,
                         ids=["python_tests", "stdio", "harbor", "code"])
async def test_a_crashed_harness_is_a_verifier_failure_not_a_zero(
    box: ProcessSandbox, verifier: PythonTests | Stdio | Harbor | Code, item: Any, right: str,
) -> None:
    # Given a right answer whose harness crashes in the sandbox (its spec lacks what it reads)
    request = verifier.exec_request(item, right)
    assert request is not None
    assert verifier.score(item, right, await box.run(request)) == 1.0
    result = await box.run(dataclasses.replace(request, stdin=b"{}"))
    # When it is scored, Then the kind says it could not judge it, with the harness's error
    with pytest.raises(VerifierFailed, match="the harness crashed: KeyError"):
        verifier.score(item, right, result)


async def test_a_program_that_kills_its_harness_still_scores_zero(box: ProcessSandbox) -> None:
    verifier = PythonTests(per_test_timeout_s=1.5)
    completion = "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
    request = verifier.exec_request(ADD, completion)
    assert request is not None
    assert verifier.score(ADD, completion, await box.run(request)) == 0.0


def test_math_verify_a_reference_it_cannot_read_is_a_verifier_failure() -> None:
    verifier = KINDS["math_verify"]({})
    with pytest.raises(VerifierFailed, match="cannot parse the reference"):
        verifier.score(Record(id="1", prompt="q", answer="\\boxed{"), "\\boxed{1}", None)
    # while an answer it cannot read is a wrong answer
    assert verifier.score(Record(id="1", prompt="q", answer="1/2"), "\\boxed{\\frac{", None) == 0.0


def test_reasoning_gym_a_score_answer_that_raises_is_a_verifier_failure() -> None:
    # Given an item whose entry reasoning-gym's own scorer cannot read (its metadata lost)
    cfg = msgspec.convert({"kind": "reasoning_gym", "dataset": "word_sorting",
                           "split": {"train_size": 2, "eval_size": 2}}, DomainConfig)
    domain = build_domain("rg-word_sorting", cfg)
    item = domain.load_items("eval")[0]
    assert domain.score(item, f"<answer>{item.answer}</answer>", None) == 1.0
    broken = msgspec.structs.replace(item, prompt=item.prompt + " ",
                                     extra={**item.extra, "metadata": {}})
    # When a completion is scored, Then the failure is typed, naming the scorer's error
    with pytest.raises(VerifierFailed, match="score_answer raised KeyError"):
        domain.score(broken, f"<answer>{item.answer}</answer>", None)
