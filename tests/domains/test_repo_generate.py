"""domains/repo/generate.py: the generated repository tasks are deterministic from the seed,
hold out bugs the training split never has, load as a declared ``repo_tests`` domain, and
every instance checks out: the buggy repository fails FAIL_TO_PASS and passes PASS_TO_PASS,
the reference fix passes all (run with the harness, as the sandbox runs it)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from streamrl.config.schema import DomainConfig
from streamrl.domains.declared import build_domain
from streamrl.domains.repo.generate import check_rows, generate, instance, write_dataset
from streamrl.domains.repo.templates import TEMPLATES


def test_the_set_is_deterministic_with_a_held_out_split() -> None:
    a, b, other = generate(0), generate(0), generate(1)
    assert a == b and a != other
    assert (len(a["train"]), len(a["eval"])) == (48, 16)
    rows = a["train"] + a["eval"]
    assert len({r["id"] for r in rows}) == len({r["prompt"] for r in rows}) == len(rows)
    train_bugs = {(r["template"], r["bug"]) for r in a["train"]}
    eval_bugs = {(r["template"], r["bug"]) for r in a["eval"]}
    assert not train_bugs & eval_bugs
    assert {t for t, _ in eval_bugs} == {t for t, _ in train_bugs} == {t.name for t in TEMPLATES}
    assert {r["bug_kind"] for r in rows} == {"off_by_one", "wrong_operator", "missing_edge_case"}
    for r in rows:  # the exposing tests are hidden: not in the repository the model sees
        visible = "".join(r["repo"].values())
        assert not any(t.split("::")[1] in visible for t in r["FAIL_TO_PASS"])


def test_every_bug_of_every_template_checks_out() -> None:
    rows = [instance(t, bug, t.packages[0], 0) for t in TEMPLATES for bug in t.bugs]
    assert len(rows) == 22
    assert check_rows(rows) == []


@pytest.mark.system
def test_every_generated_instance_checks_out() -> None:
    sets = generate(0)
    assert check_rows(sets["train"] + sets["eval"]) == []


def test_the_rows_load_as_a_declared_domain(tmp_path: Path) -> None:
    write_dataset(tmp_path / "repo", seed=0, n_train=8, n_eval=4)
    cfg = msgspec.convert({"kind": "repo_tests", "data": str(tmp_path / "repo"),
                           "split": {"by": "files", "train": "train.jsonl",
                                     "eval": "eval.jsonl"},
                           "verifier": {"test_timeout_s": 30}}, DomainConfig)
    domain = build_domain("repo", cfg)
    train, held = domain.load_items("train"), domain.load_items("eval")
    assert (len(train), len(held)) == (8, 4)
    item = train[0]
    completion = f"```diff\n{item.extra['solution']}```"
    request = domain.exec_request(item, completion)
    assert request is not None and request.argv == ["python3", "-I", ".repo_tests_harness.py"]
    assert domain.exec_request(item, "I cannot fix this.") is None
    assert domain.score(item, "I cannot fix this.", None) == 0.0
