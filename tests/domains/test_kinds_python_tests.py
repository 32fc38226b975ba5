"""The ``python_tests`` kind (HumanEval / MBPP format) in the real process sandbox: right
code passes with a result per test, wrong code fails with the assertion message, crashing
code errors with its traceback, and code that tries to forge a pass gets nothing for it."""

from __future__ import annotations

import os
import random

import pytest

from streamrl.domains.kinds import KINDS, Record
from streamrl.domains.kinds import pytests as _pytests  # noqa: F401  (registers the kind)
from streamrl.domains.kinds.humaneval import load_humaneval
from streamrl.domains.kinds.pytests import PythonTests
from streamrl.sandbox.process import ProcessSandbox, open_process_sandbox

UID_BASE = 330_000 + (os.getpid() % 500) * 1024

PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
CHECK = """
def check(candidate):
    assert candidate(1, 2) == 3
    assert candidate(-1, 1) == 0, "zero"
    assert candidate((1,), (2,)) == (1, 2)
"""
ITEM = Record(id="add", prompt=PROMPT, tests=CHECK, extra={"entry_point": "add"})
MBPP = Record(id="mbpp-1", prompt="Write a function to square a number.",
              tests=["assert square(2) == 4", "assert square(-3) == 9"])


@pytest.fixture
async def box():  # type: ignore[no-untyped-def]
    async with open_process_sandbox(uid_base=UID_BASE) as sandbox:
        yield sandbox


async def run(box: ProcessSandbox, completion: str, item: Record = ITEM,
              verifier: PythonTests | None = None) -> tuple[float, list[str]]:
    verifier = verifier or PythonTests(per_test_timeout_s=1.5)
    verifier.check_item(item)
    request = verifier.exec_request(item, completion)
    result = await box.run(request) if request is not None else None
    statuses = [r.status for r in verifier.test_results(item, completion, result)]
    return verifier.score(item, completion, result), statuses


async def test_a_body_continuing_the_prompt_passes_every_test(box: ProcessSandbox) -> None:
    assert await run(box, "    return a + b\n") == (1.0, ["pass", "pass", "pass"])


async def test_a_whole_function_in_a_fence_passes(box: ProcessSandbox) -> None:
    completion = "Sure:\n```python\ndef add(a, b):\n    return a + b\n```"
    assert await run(box, completion) == (1.0, ["pass", "pass", "pass"])


async def test_mbpp_asserts_are_tests_and_the_entry_point_is_found(box: ProcessSandbox) -> None:
    assert await run(box, "def square(x):\n    return x * x", MBPP) == (1.0, ["pass", "pass"])


async def test_wrong_code_fails_with_the_assertion_message(box: ProcessSandbox) -> None:
    verifier = PythonTests()
    item, completion = ITEM, "    return a - b if a == -1 else a + b\n"
    result = await box.run(verifier.exec_request(item, completion))  # type: ignore[arg-type]
    results = verifier.test_results(item, completion, result)
    assert [r.status for r in results] == ["pass", "fail", "pass"]
    assert results[1].message == "AssertionError: zero"
    assert "candidate(-1, 1)" in results[1].name
    assert verifier.score(item, completion, result) == pytest.approx(2 / 3)


async def test_crashing_code_errors_with_its_traceback(box: ProcessSandbox) -> None:
    verifier = PythonTests()
    completion = "    if a == 1:\n        raise KeyError('nope')\n    return a + b\n"
    result = await box.run(verifier.exec_request(ITEM, completion))  # type: ignore[arg-type]
    results = verifier.test_results(ITEM, completion, result)
    assert [r.status for r in results] == ["error", "pass", "pass"]
    assert "KeyError" in results[0].message and "nope" in results[0].message


async def test_hanging_code_errors_at_its_deadline_and_the_next_test_runs(
    box: ProcessSandbox,
) -> None:
    completion = "    while a == 1:\n        pass\n    return a + b\n"
    assert await run(box, completion) == (pytest.approx(2 / 3), ["error", "pass", "pass"])


async def test_code_that_does_not_parse_errors_every_test(box: ProcessSandbox) -> None:
    assert await run(box, "    return a +\n") == (0.0, ["error", "error", "error"])


@pytest.mark.parametrize("hack", [
    # print a pass (or a line shaped like the harness's report)
    '    print("PASS")\n    print("0" * 64 + \' [{"name": "t", "status": "pass"}]\')\n'
    "    return -999\n",
    "import sys\nsys.exit(0)\n",  # exit 0 before any assert runs
    "import os\nos._exit(0)\n",
    # override check, and the asserts' exception
    "def check(candidate):\n    pass\nimport builtins\n"
    "builtins.AssertionError = ZeroDivisionError\n"
    "def add(a, b):\n    return -999\n",
    # monkeypatch builtins the checker might use; patch the comparison
    "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.len = lambda *a: 0\n"
    "def add(a, b):\n    return -999\n",
    # an object equal to everything
    "class Any:\n    def __eq__(self, other):\n        return True\n"
    "def add(a, b):\n    return Any()\n",
    # kill the harness (its parent) and write a forged report where one might be read
    "import os, signal\nopen('result.json', 'w').write('[true, true, true]')\n"
    "os.kill(os.getppid(), signal.SIGKILL)\n",
    # read the harness's stdin/stdout through /proc (non-dumpable: refused)
    "import os\nout = open(f'/proc/{os.getppid()}/fd/1', 'w')\n"
    "out.write(open(f'/proc/{os.getppid()}/fd/0').read())\n",
])
async def test_forging_a_pass_earns_nothing(box: ProcessSandbox, hack: str) -> None:
    completion = f"```python\n{hack}```"
    score, statuses = await run(box, completion)
    assert score == 0.0 and "pass" not in statuses


async def test_huge_output_and_huge_completions_earn_nothing(box: ProcessSandbox) -> None:
    flood = "    print('x' * 10_000_000)\n    return -999\n"
    assert (await run(box, flood))[0] == 0.0
    huge = "    return -999\n" + "# " + "y" * 3_000_000 + "\n"
    assert (await run(box, huge))[0] == 0.0


def test_the_kind_is_registered_and_refuses_items_without_tests() -> None:
    verifier = KINDS["python_tests"]({"per_test_timeout_s": 1.0})
    with pytest.raises(ValueError, match="no tests"):
        verifier.check_item(Record(id="x", prompt="p", extra={"entry_point": "f"}))
    with pytest.raises(ValueError, match="entry point"):
        verifier.check_item(Record(id="x", prompt="p", tests="x = 1\nassert x"))


def test_humaneval_loads_all_164_problems() -> None:
    items = load_humaneval()
    assert len(items) == 164 and len({i.id for i in items}) == 164
    for item in items:
        PythonTests().check_item(item)


@pytest.mark.system
async def test_humaneval_canonical_solutions_pass_in_the_sandbox(box: ProcessSandbox) -> None:
    # Given a sample of the real HumanEval problems and their canonical solutions
    items = random.Random(16).sample(load_humaneval(), 20)
    verifier = PythonTests()
    for item in items:
        completion = item.extra["canonical_solution"]
        # When each runs through the kind in the real sandbox
        result = await box.run(verifier.exec_request(item, completion))  # type: ignore[arg-type]
        # Then every test of every problem passes
        results = verifier.test_results(item, completion, result)
        assert results and all(r.status == "pass" for r in results), (item.id, results)
        # and a wrong body (returning None) does not
        assert (await run(box, "    return None\n", item))[0] < 1.0, item.id
