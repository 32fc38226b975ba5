"""The eval-only ``general`` set: exact answers after normalisation, never a training split."""

from __future__ import annotations

import pytest

from streamrl.config.schema import load_config
from streamrl.domains.general import General, GeneralItem, extract_reply
from streamrl.domains.general.generate import KINDS, make_eval
from streamrl.domains.registry import get_domain

CAPITAL = GeneralItem(id="g1", prompt="What is the capital of Italy?", answer="Rome",
                      kind="capital")
SORT = GeneralItem(id="g2", prompt="Sort ...", answer="apple, fig, pear", kind="sort_words")


def test_registered_eval_only_and_data_committed() -> None:
    domain = get_domain("general")
    assert isinstance(domain, General) and domain.eval_only
    assert domain.load_items("eval") == make_eval()
    assert {i.kind for i in domain.load_items("eval")[: len(KINDS)]} == set(KINDS)
    with pytest.raises(ValueError, match="eval-only"):
        domain.load_items("train")


@pytest.mark.parametrize("text", ["Rome", "Rome.", "**Rome**", "rome", "'Rome'",
                                  "Answer: Rome", "Rome\nRome is the capital since 1871.",
                                  "The capital of Italy is Rome.", 'It is "Rome."'])
def test_right_answers_score_one(text: str) -> None:
    assert General().score(CAPITAL, text, None) == 1.0


@pytest.mark.parametrize("text", ["", "Paris", "The capital is Rome or Milan", "Rome or Milan",
                                  "Answer: Milan\nAnswer: Rome\nAnswer: Paris", "R" * 300])
def test_other_answers_score_zero(text: str) -> None:
    assert General().score(CAPITAL, text, None) == 0.0


def test_lists_compare_without_spacing() -> None:
    assert General().score(SORT, "apple,fig , pear", None) == 1.0
    assert General().score(SORT, "fig, apple, pear", None) == 0.0
    assert extract_reply("\n\n  x  \ny") == "x"


def test_config_lists_it_for_evaluation_only() -> None:
    config = load_config(None, ['scheduler.eval_domains=["general"]',
                                "domain.general.max_new_tokens=32"])
    assert config.scheduler.eval_domains == ["general"]
    assert config.domain_config("general").max_new_tokens == 32
    with pytest.raises(Exception, match="eval_domains"):
        load_config(None, ["domain.nothere.weight=2"])
