"""The arith demo domain: data set, prompt, program extraction and the verifier (real sandbox)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from streamrl.domains.arith import Arith, ArithItem, extract_program
from streamrl.domains.arith.generate import make_splits, write_splits
from streamrl.domains.registry import ENTRY_POINT_GROUP, get_domain
from streamrl.models import load_tokenizer, resolve_model
from streamrl.sandbox.base import ExecResult
from streamrl.sandbox.process import ProcessSandbox, open_process_sandbox

ITEM = ArithItem(id="t-1", prompt="Write a Python program that prints the sum of 29 and 21.",
                 answer="50", kind="add2")


@pytest.fixture
def domain() -> Arith:
    return Arith()


@pytest.fixture
async def box():  # type: ignore[no-untyped-def]
    async with open_process_sandbox() as sandbox:
        yield sandbox


async def reward(domain: Arith, box: ProcessSandbox, item: ArithItem, text: str) -> float:
    request = domain.exec_request(item, text)
    result = await box.run(request) if request is not None else None
    return domain.score(item, text, result)


def test_registered_by_name() -> None:
    assert isinstance(get_domain("arith"), Arith)
    assert get_domain("arith") is get_domain("arith")
    assert ENTRY_POINT_GROUP == "streamrl.domains"
    with pytest.raises(KeyError):
        get_domain("no-such-domain")


def test_splits_are_deterministic_disjoint_and_committed(tmp_path: Path,
                                                         domain: Arith) -> None:
    a, b = make_splits(), make_splits()
    assert a == b
    assert len(a["train"]) == 2000 and len(a["eval"]) == 64
    train, evals = {it.prompt for it in a["train"]}, {it.prompt for it in a["eval"]}
    assert len(train) == 2000 and len(evals) == 64 and not train & evals
    assert make_splits(seed=7) != a
    # the committed files are exactly what the generator writes
    write_splits(a, tmp_path)
    for split in ("train", "eval"):
        committed = (domain.data_dir / f"{split}.jsonl").read_text()
        assert (tmp_path / f"{split}.jsonl").read_text() == committed
    assert domain.load_items("eval") == a["eval"]


def test_eval_split_covers_every_kind(domain: Arith) -> None:
    from streamrl.domains.arith.tasks import KINDS

    assert {it.kind for it in domain.load_items("eval")} == set(KINDS)


def test_items_travel_as_task_spec(domain: Arith) -> None:
    item = domain.load_items("train")[0]
    spec = msgspec.to_builtins(item)
    assert spec["id"] == item.id and spec["prompt"] == item.prompt
    assert msgspec.convert(spec, domain.item_type) == item


def test_prompt_uses_the_chat_template(domain: Arith) -> None:
    tok = load_tokenizer(resolve_model("tiny"))
    ids = domain.render_prompt(ITEM, tok)
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n")
    assert f"<|im_start|>user\n{ITEM.prompt}<|im_end|>" in text
    expected = tok.apply_chat_template([{"role": "user", "content": ITEM.prompt}],
                                       add_generation_prompt=True, tokenize=False)
    assert ids == tok(expected, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    ("text", "program"),
    [
        ("Sure!\n```python\nprint(1)\n```\nThis prints 1.", "print(1)"),
        ("```py\nprint(2)\n```", "print(2)"),
        ("```\nprint(3)\n```", "print(3)"),
        ("```Python\nx = 4\nprint(x)\n```", "x = 4\nprint(x)"),
        ("```python\nprint(5)\n```\n```python\nprint(6)\n```", "print(5)"),
        ("```python\nprint(7)\nprint(", "print(7)\nprint("),  # cut by the length limit
        ("print(8)\n", "print(8)"),  # no fence: the raw text
    ],
)
def test_extract_program(text: str, program: str) -> None:
    assert extract_program(text) == program


def test_nothing_to_run_scores_zero(domain: Arith) -> None:
    assert domain.exec_request(ITEM, "   \n") is None
    assert domain.exec_request(ITEM, "```python\n```") is None
    assert domain.score(ITEM, "", None) == 0.0


async def test_correct_program_scores_one(domain: Arith, box: ProcessSandbox) -> None:
    text = "Here you go:\n```python\na = 29\nb = 21\nprint(a + b)\n```\nIt prints 50."
    assert await reward(domain, box, ITEM, text) == 1.0


async def test_every_eval_answer_is_reachable(domain: Arith, box: ProcessSandbox) -> None:
    for item in domain.load_items("eval")[:17]:
        assert await reward(domain, box, item, f"```python\nprint({item.answer!r})\n```") == 1.0


@pytest.mark.parametrize(
    "text",
    [
        "```python\nprint(51)\n```",  # wrong answer
        "```python\nprint('50 ')\nprint(1)\n```",  # extra output
        "```python\nprint(50\n```",  # syntax error
        "The answer is 50.",  # prose, no code
        "```python\nimport sys\nsys.stdout.buffer.write(b'\\xff\\xfe')\n```",  # not UTF-8
    ],
)
async def test_wrong_program_scores_zero(domain: Arith, box: ProcessSandbox, text: str) -> None:
    assert await reward(domain, box, ITEM, text) == 0.0


async def test_hanging_program_scores_zero(domain: Arith, box: ProcessSandbox) -> None:
    text = "```python\nprint(50)\nwhile True:\n    pass\n```"
    request = domain.exec_request(ITEM, text)
    assert request is not None and request.limits.timeout_s <= 2.0
    result = await box.run(request)
    assert result.timed_out
    assert domain.score(ITEM, text, result) == 0.0


def test_timed_out_result_scores_zero_even_with_the_answer(domain: Arith) -> None:
    result = ExecResult(exit_code=None, stdout=b"50\n", stderr=b"", timed_out=True,
                        oom_killed=False, duration_s=2.0)
    assert domain.score(ITEM, "print(50)", result) == 0.0


async def test_clean_run_credit_is_opt_in(box: ProcessSandbox) -> None:
    wrong, crash = "```python\nprint(51)\n```", "```python\nraise SystemExit(3)\n```"
    assert await reward(Arith(), box, ITEM, wrong) == 0.0
    assert await reward(Arith(clean_run_credit=0.1), box, ITEM, wrong) == 0.1
    assert await reward(Arith(clean_run_credit=0.1), box, ITEM, crash) == 0.0
