"""The finance domain: structured JSON answers checked against the table and for consistency."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streamrl.domains.finance import Finance, FinanceItem, Row
from streamrl.domains.finance.generate import make_splits, write_splits
from streamrl.domains.registry import get_domain

ROWS = [Row("Retail", 1200, 800), Row("Cloud", 600, 200), Row("Ads", 200, 150)]
SHARE = FinanceItem(id="f1", prompt="p", rows=ROWS, kind="share", target="Cloud")
MARGIN = FinanceItem(id="f2", prompt="p", rows=ROWS, kind="margin")


def reply(obj: object, fence: bool = True) -> str:
    body = json.dumps(obj)
    return f"Sure.\n```json\n{body}\n```" if fence else f"The answer is {body} as asked."


@pytest.fixture(scope="module")
def domain() -> Finance:
    return Finance()


def test_registered_and_data_committed(tmp_path: Path) -> None:
    assert isinstance(get_domain("finance"), Finance)
    splits = make_splits()
    write_splits(splits, tmp_path)
    for split in ("train", "eval"):
        assert (tmp_path / f"{split}.jsonl").read_text() == (
            Finance().data_dir / f"{split}.jsonl").read_text()


def test_correct_answers_score_one(domain: Finance) -> None:
    share = {"parts": {"Retail": 1200, "Cloud": 600, "Ads": 200}, "total": 2000, "ratio": 0.3}
    assert domain.score(SHARE, reply(share), None) == 1.0
    assert domain.score(SHARE, reply(share, fence=False), None) == 1.0
    margin = {"parts": {"Retail": 400, "Cloud": 400.0, "Ads": 50}, "total": 850,
              "ratio": 0.425}
    assert domain.score(MARGIN, reply(margin), None) == 1.0


def test_consistent_but_wrong_scores_partly(domain: Finance) -> None:
    # every amount doubled: consistent, the share ratio is still right, the amounts are not
    doubled = {"parts": {"Retail": 2400, "Cloud": 1200, "Ads": 400}, "total": 4000,
               "ratio": 0.3}
    assert domain.score(SHARE, reply(doubled), None) == pytest.approx(1 / 3)


@pytest.mark.parametrize(("answer", "right"), [
    ({"parts": {"Retail": 1200, "Cloud": 600, "Ads": 200}, "total": 2100, "ratio": 0.3}, 2),
    ({"parts": {"Retail": 1200, "Cloud": 600, "Ads": 200}, "total": 2000, "ratio": 0.35}, 2),
    ({"parts": {"Retail": 1200, "Cloud": 600, "Ads": 200}, "total": 2000, "ratio": 30}, 2),
    ({"parts": {"Retail": 1200, "Cloud": 600}, "total": 1800, "ratio": 0.333}, 2 / 3),  # missing
])
def test_inconsistent_answers_get_half_of_what_they_got_right(
    domain: Finance, answer: dict[str, object], right: float
) -> None:
    assert domain.score(SHARE, reply(answer), None) == pytest.approx(right / 3 * 0.5)


def test_padding_parts_with_extra_keys_costs(domain: Finance) -> None:
    # the table's revenues copied, plus the total and a ratio inside "parts" (as SmolLM2 does)
    padded = {"parts": {"Retail": 1200, "Cloud": 600, "Ads": 200, "Total": 2000, "ratio": 1},
              "total": 2000, "ratio": 0.3}
    assert domain.score(SHARE, reply(padded), None) == pytest.approx((3 / 5 + 1 + 1) / 3 * 0.5)


def test_the_primed_opening_is_part_of_the_answer(domain: Finance) -> None:
    # the prompt ends with '```json\n{"parts": {"Retail": ' (render_prompt); the model goes on
    from streamrl.domains.finance.domain import answer_prefix

    assert answer_prefix(SHARE) == '```json\n{"parts": {"Retail": '
    rest = '1200, "Cloud": 600, "Ads": 200}, "total": 2000, "ratio": 0.3}\n```'
    assert domain.score(SHARE, rest, None) == 1.0
    assert domain.score(SHARE, '1200, "Cloud": 600}, "total": 1800, "ratio": 0.333}', None
                        ) == pytest.approx(2 / 3 / 3 * 0.5)


@pytest.mark.parametrize("text", [
    "I cannot answer.",
    reply({"parts": {"Retail": "1200", "Cloud": 600, "Ads": 200}, "total": 2000, "ratio": 0.3}),
    reply({"parts": {"Retail": True, "Cloud": True, "Ads": True}, "total": 3, "ratio": 0.333}),
    '```json\n{"parts": {"Retail": NaN, "Cloud": 600, "Ads": 200}, "total": NaN, "ratio": NaN}```',
    '```json\n{"parts": {"Retail": 1e999, "Cloud": 600, "Ads": 200}, "total": 1e999, '
    '"ratio": 0}```',
    reply([1200, 600, 200]),
    reply({"parts": {"Retail": 1200, "Cloud": 600, "Ads": 200, **{f"k{i}": 0 for i in range(400)}},
           "total": 2000, "ratio": 0.3}),  # over the size cap, and extra segments
    "{" * 100_000,  # deep nesting bomb
])
def test_malformed_and_hostile_answers_score_zero(domain: Finance, text: str) -> None:
    assert domain.score(SHARE, text, None) == 0.0
