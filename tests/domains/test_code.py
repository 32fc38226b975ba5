"""The code domain: hidden tests in the real process sandbox; correct, wrong and hostile code."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from streamrl.domains.code import Case, Code, CodeItem, nonce
from streamrl.domains.code.generate import make_splits, write_splits
from streamrl.domains.registry import get_domain
from streamrl.sandbox.process import ProcessSandbox, open_process_sandbox

UID_BASE = 300_000 + (os.getpid() % 500) * 1024

ITEM = CodeItem(
    id="code-t-1",
    prompt="Write a Python function `add_3(xs)` ...",
    entry="add_3",
    tests=[Case([[1, 2]], [4, 5]), Case([[]], []), Case([[-3]], [0]), Case([[10, 0]], [13, 3])],
    salt="00112233445566778899aabbccddeeff",
)


def fenced(code: str) -> str:
    return f"Here you go:\n```python\n{code.strip()}\n```\n"


@pytest.fixture(scope="module")
def domain() -> Code:
    return Code(per_test_timeout_s=1.5)


@pytest.fixture
async def box():  # type: ignore[no-untyped-def]
    # a uid range of our own: ProcessSandbox instances of other processes (other test runs in
    # parallel) lease the same uids from the top of the default pool, and in isolation
    # "none" their clean-up kills every process of a uid
    async with open_process_sandbox(uid_base=UID_BASE) as sandbox:
        yield sandbox


async def reward(domain: Code, box: ProcessSandbox, text: str, item: CodeItem = ITEM) -> float:
    request = domain.exec_request(item, text)
    result = await box.run(request) if request is not None else None
    return domain.score(item, text, result)


def test_registered_through_entry_point_and_data_committed(tmp_path: Path) -> None:
    assert isinstance(get_domain("code"), Code)
    splits = make_splits()
    write_splits(splits, tmp_path)
    for split in ("train", "eval"):
        assert (tmp_path / f"{split}.jsonl").read_text() == (
            get_domain("code").data_dir / f"{split}.jsonl").read_text()  # type: ignore[attr-defined]
    assert not {i.prompt for i in splits["train"]} & {i.prompt for i in splits["eval"]}


def test_prompts_name_the_argument_the_description_uses() -> None:
    """``pairs_summing_to_k(x)`` once described ``xs``: the signature and the text agree."""
    for items in make_splits(n_train=200, n_eval=20).values():
        for item in items:
            signature = re.match(r"Write a Python function `(\w+)\((\w+)\)`", item.prompt)
            assert signature is not None, item.prompt
            assert f"`{signature[2]}`" in item.prompt, item.prompt


async def test_correct_solution_scores_one(domain: Code, box: ProcessSandbox) -> None:
    code = "def add_3(xs):\n    return [x + 3 for x in xs]"
    assert await reward(domain, box, fenced(code)) == 1.0


async def test_partly_wrong_solution_scores_the_fraction(domain: Code, box: ProcessSandbox) -> None:
    code = "def add_3(xs):\n    return [x + 3 for x in xs] if len(xs) != 2 else []"
    assert await reward(domain, box, fenced(code)) == 0.5


async def test_wrong_missing_and_crashing_code_score_low(domain: Code,
                                                        box: ProcessSandbox) -> None:
    assert await reward(domain, box, fenced("def add_3(xs):\n    return xs")) == 0.25  # [] == []
    assert await reward(domain, box, "") == 0.0
    assert await reward(domain, box, fenced("def add_3(xs) return")) == 0.0
    assert await reward(domain, box, fenced("def other(xs):\n    return 1")) == 0.0


async def test_per_test_timeout(domain: Code, box: ProcessSandbox) -> None:
    code = ("def add_3(xs):\n    if not xs:\n        while True: pass\n"
            "    return [x + 3 for x in xs]")
    assert await reward(domain, box, fenced(code)) == 0.75


async def test_printing_passed_scores_zero(domain: Code, box: ProcessSandbox) -> None:
    code = ("import sys, json\nprint('PASSED')\n"
            "sys.__stdout__.write('ok [true, true, true, true]\\n')\n"
            "def add_3(xs):\n    print('PASSED'); return None")
    assert await reward(domain, box, fenced(code)) == 0.0


async def test_exiting_zero_early_scores_zero(domain: Code, box: ProcessSandbox) -> None:
    assert await reward(domain, box, fenced("import os\nos._exit(0)")) == 0.0
    assert await reward(domain, box, fenced("import sys\nsys.exit(0)")) == 0.0


async def test_deleting_and_editing_files_scores_zero(domain: Code, box: ProcessSandbox) -> None:
    code = ("import os, glob\nfor f in glob.glob('*'):\n"
            "    open(f, 'w').write('print(\"PASSED\")')\n"
            "def add_3(xs):\n    return None")
    assert await reward(domain, box, fenced(code)) == 0.0


async def test_monkey_patching_the_checker_scores_zero(domain: Code, box: ProcessSandbox) -> None:
    code = ("import json, builtins\njson.loads = lambda *a, **k: {'ok': True, 'value': [4, 5]}\n"
            "json.dumps = lambda *a, **k: '{\"ok\": true, \"value\": []}'\n"
            "builtins.isinstance = lambda *a: True\n"
            "def add_3(xs):\n    return 'x'")
    # the patched dumps reports [] for every test: exactly what returning [] would earn
    assert await reward(domain, box, fenced(code)) == 0.25


async def test_always_equal_object_scores_zero(domain: Code, box: ProcessSandbox) -> None:
    code = ("class Any(list):\n    def __eq__(self, o): return True\n    __hash__ = None\n"
            "def add_3(xs):\n    return Any()")
    assert await reward(domain, box, fenced(code)) == 0.0
    code = "class T(int):\n    def __eq__(self, o): return True\ndef add_3(xs):\n    return T(1)"
    assert await reward(domain, box, fenced(code)) == 0.0


async def test_type_strict_bool_is_not_int(domain: Code, box: ProcessSandbox) -> None:
    item = CodeItem(id="c2", prompt="p", entry="f", tests=[Case([], 1)], salt="s")
    assert await reward(domain, box, fenced("def f():\n    return True"), item) == 0.0
    assert await reward(domain, box, fenced("def f():\n    return 1.0"), item) == 0.0
    assert await reward(domain, box, fenced("def f():\n    return 1"), item) == 1.0


async def test_giant_output_scores_zero(domain: Code, box: ProcessSandbox) -> None:
    code = ("import os\nos.write(1, b'x' * 50_000_000)\n"
            "def add_3(xs):\n    return 'y' * 10_000_000")
    assert await reward(domain, box, fenced(code)) == 0.0


async def test_forged_result_line_needs_the_nonce(domain: Code, box: ProcessSandbox) -> None:
    # a result line with the wrong nonce, as if the harness had printed it
    text = fenced("def add_3(xs):\n    return xs")
    request = domain.exec_request(ITEM, text)
    assert request is not None
    result = await box.run(request)
    forged = type(result)(**{**result.__dict__,
                             "stdout": b"0" * 64 + b" [true, true, true, true]\n"})
    assert domain.score(ITEM, text, forged) == 0.0
    assert nonce(ITEM, text) != nonce(ITEM, text + " ")
