"""The tool-use cold start (domains/repo/coldstart.py, demos.py) against the real thing: a
generated repository domain worked with the standard tools in the real process sandbox, the
domain's own final check, SmolLM2's tokenizer and chat template (the tiny model's), the
RL-time parser and renderers.

What must hold: rows come from the train split only; every row replays, call by call in a
fresh session, to the same tool results and a passing final check; the learner's SFT loader
renders a row into exactly the tokens the generator builds at RL time, and its replies parse
back into the row's calls; the same seed writes the same file; a task whose fix fails is not
written."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from streamrl.actors.episodes import observation_ids
from streamrl.actors.executor import Sandboxes
from streamrl.config.schema import DomainConfig, PromptConfig, SplitConfig, ToolsConfig
from streamrl.domains.agentic import ToolDomain
from streamrl.domains.base import write_jsonl
from streamrl.domains.declared import build_domain
from streamrl.domains.repo.coldstart import (
    Budgets,
    Statistics,
    reply_text,
    step_of,
    write_coldstart,
)
from streamrl.domains.repo.demos import Abandon, Plan, choose_plan, demonstration, task_facts
from streamrl.domains.repo.generate import generate
from streamrl.inference.chat import parse_tool_calls, tool_format
from streamrl.learner.sft_data import render_chat
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol.messages import ToolReply, Turn
from tests.domains.test_kinds_repo_tests import SANDBOX_PYTEST

pytestmark = pytest.mark.skipif(not SANDBOX_PYTEST, reason="the sandbox's python3 has no "
                                "pytest (Debian: apt-get install python3-pytest; .ci/run does)")

NAME = "repo_coldstart_test"
REPO = Path(__file__).resolve().parents[2]
EPISODES = 8


def table(data: Path) -> DomainConfig:
    return DomainConfig(kind="repo_tests", data=str(data), max_turns=8, max_tool_calls=24,
                        split=SplitConfig(by="files", train="train.jsonl", eval="eval.jsonl"),
                        prompt=PromptConfig(template="Issue: {problem_statement}"),
                        verifier={"test_timeout_s": 30.0}, tools=ToolsConfig(enabled=True))


def tool_domain(data: Path, rows: dict[str, list[dict[str, Any]]]) -> ToolDomain:
    data.mkdir(parents=True, exist_ok=True)
    for split, items in rows.items():
        write_jsonl(items, data / f"{split}.jsonl")
    domain = build_domain(NAME, table(data))
    assert isinstance(domain, ToolDomain)
    return domain


def write(domain: ToolDomain, out: Path, tokenizer: Any, **kw: Any) -> Statistics:
    async def main() -> Statistics:
        async with Sandboxes("process").opened() as boxes:
            return await write_coldstart(domain, boxes.session, out, tokenizer=tokenizer, **kw)

    return trio.run(main)


def stable(text: str) -> str:
    """``text`` without what pytest's output varies by from run to run: the addresses of
    objects in a traceback (``<RingQueue object at 0x7f...>``)."""
    return re.sub(r"0x[0-9a-f]+", "0x?", text)


def read_rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model("tiny"))  # SmolLM2's tokenizer and chat template


@pytest.fixture(scope="module")
def generated() -> dict[str, list[dict[str, Any]]]:
    return generate(seed=3, n_train=8, n_eval=4)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any,
            generated: dict[str, list[dict[str, Any]]]) -> tuple[ToolDomain, Path, Statistics]:
    """EPISODES demonstrations, a mistake in most (both kinds), written once for the module."""
    tmp = tmp_path_factory.mktemp("coldstart")
    domain = tool_domain(tmp / "data", generated)
    out = tmp / "rows.jsonl"
    stats = write(domain, out, tokenizer, episodes=EPISODES, seed=1, mistakes=0.8,
                  budgets=Budgets(max_turns=8, max_tool_calls=24, max_new_tokens=1024,
                                  max_total_tokens=8192))
    return domain, out, stats


def test_kept_demonstrations_are_counted_and_varied(
        written: tuple[ToolDomain, Path, Statistics]) -> None:
    _, out, stats = written
    rows = read_rows(out)
    # every episode of a generated train task succeeds: the script recovers from its own
    # mistakes, and the reference fix passes the hidden tests
    assert stats.kept == len(rows) == EPISODES, stats.as_dict()
    assert set(stats.mistakes) >= {"context", "decoy"}, stats.as_dict()
    assert len({json.dumps(r) for r in rows}) == len(rows)
    for row in rows:
        roles = [m["role"] for m in row["messages"]]
        assert roles[:3] == ["system", "user", "assistant"] and roles[-1] == "assistant"
        last = row["messages"][-1]["tool_calls"]
        assert [c["function"]["name"] for c in last] == ["finish"]
        names = {c["function"]["name"] for m in row["messages"] for c in m.get("tool_calls", [])}
        assert {"read_file", "apply_patch", "run_tests"} <= names
        assert [t["function"]["name"] for t in row["tools"]] == [t.name for t in written[0].tools]


def test_rows_come_from_the_train_split_only(
        written: tuple[ToolDomain, Path, Statistics],
        generated: dict[str, list[dict[str, Any]]]) -> None:
    domain, out, stats = written
    train = {i.id for i in domain.load_items("train")}
    assert stats.items and stats.items <= train
    text = out.read_text()
    for row in generated["eval"]:  # no held-out statement, fix or package shows up
        statement = json.dumps(row["problem_statement"])[1:-1]
        assert statement not in text and json.dumps(row["solution"])[1:-1] not in text
    users = {m["content"] for r in read_rows(out) for m in r["messages"] if m["role"] == "user"}
    assert users <= {f"Issue: {r['problem_statement']}" for r in generated["train"]}


def test_a_domain_without_train_items_is_refused(tmp_path: Path, tokenizer: Any,
                                                 generated: dict[str, list[dict[str, Any]]]
                                                 ) -> None:
    domain = tool_domain(tmp_path / "data", {"train": [], "eval": generated["eval"]})
    with pytest.raises(ValueError, match="no train items"):  # refused before any session
        trio.run(partial(write_coldstart, domain, Sandboxes("process").session,
                         tmp_path / "rows.jsonl", episodes=2, tokenizer=tokenizer))
    assert not (tmp_path / "rows.jsonl").exists()


def test_every_row_replays_to_a_passing_verification(
        written: tuple[ToolDomain, Path, Statistics]) -> None:
    domain, out, _ = written
    items = {i.id: i for i in domain.load_items("train")}
    rows = read_rows(out)

    async def replay(boxes: Sandboxes, row: dict[str, Any]) -> float:
        user = next(m["content"] for m in row["messages"] if m["role"] == "user")
        [item] = [i for i in items.values() if user == f"Issue: {i.extra['problem_statement']}"]
        async with boxes.session(domain, "replay") as session:
            await session.put_files(domain.session_files(item))
            messages = row["messages"]
            for k, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                action = await domain.act(item, reply_text(step_of(m)), session, "hermes")
                recorded = [t["content"] for t in messages[k + 1:k + 1 + len(m["tool_calls"])]
                            if t["role"] == "tool"]
                assert [r.name for r in action.results] == [
                    c["function"]["name"] for c in m["tool_calls"]]
                if not action.done:  # the same results as when the row was written
                    assert [stable(r.content) for r in action.results] == list(map(
                        stable, recorded))
            assert action.done
            check = domain.final_request(item)
            result = await session.run(check) if check else None
        return domain.score(item, "", result)

    async def main() -> list[float]:
        async with Sandboxes("process").opened() as boxes:
            return [await replay(boxes, row) for row in rows]

    assert trio.run(main) == [1.0] * len(rows)


def test_the_sft_loader_renders_rows_as_rl_time_and_they_parse_back(
        written: tuple[ToolDomain, Path, Statistics], tokenizer: Any) -> None:
    domain, out, _ = written
    items = {f"Issue: {i.extra['problem_statement']}": i for i in domain.load_items("train")}
    fmt = tool_format(tokenizer)
    assert fmt == "hermes"  # SmolLM2's template renders no tools: the RL-time fallback
    for row in read_rows(out):
        # When the learner's SFT loader renders the row with SmolLM2's template
        prompt, tokens, mask = render_chat(tokenizer, row["messages"], row["tools"])
        # Then the prompt is the generator's, to the token
        item = items[row["messages"][1]["content"]]
        assert prompt == domain.render_prompt(item, tokenizer)
        # and the rest is the generator's episode: each reply as the model writes it and the
        # end of turn it stops at (trained), then the results as the generator appends them
        expected: list[int] = []
        trained: list[int] = []
        messages = row["messages"][2:]
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            text = reply_text(step_of(m))
            reply = tokenizer(text, add_special_tokens=False)["input_ids"]
            decoded = tokenizer.decode(reply, skip_special_tokens=True)  # what act() gets
            parsed = parse_tool_calls(decoded, domain.tools, fmt)
            assert [(c.name, c.arguments, c.error) for c in parsed.calls] == [
                (c["function"]["name"], c["function"]["arguments"], "") for c in m["tool_calls"]]
            expected += [*reply, tokenizer.eos_token_id]
            trained += [1] * (len(reply) + 1)
            results = []
            for t in messages[k + 1:]:
                if t["role"] != "tool":
                    break
                results.append(ToolReply(call_id=t["tool_call_id"], name=t["name"],
                                         content=t["content"]))
            if results:
                obs = observation_ids(tokenizer, domain, Turn(text=decoded, tools=results),
                                      closed=True)
                expected += obs
                trained += [0] * len(obs)
        assert tokens == expected and mask == trained


def test_the_same_seed_writes_the_same_rows(tmp_path: Path, tokenizer: Any,
                                            generated: dict[str, list[dict[str, Any]]]) -> None:
    domain = tool_domain(tmp_path / "data", generated)
    for name in ("a", "b"):
        write(domain, tmp_path / f"{name}.jsonl", tokenizer, episodes=3, seed=7, mistakes=0.5)
    write(domain, tmp_path / "c.jsonl", tokenizer, episodes=3, seed=8, mistakes=0.5)
    a, b, c = (stable((tmp_path / f"{n}.jsonl").read_text()) for n in "abc")
    assert a and a == b
    assert a != c


def test_a_task_whose_fix_fails_is_not_written(tmp_path: Path, tokenizer: Any,
                                               generated: dict[str, list[dict[str, Any]]]
                                               ) -> None:
    # Given train items whose "fix" changes a comment only (the visible tests still pass)
    broken = []
    for row in generated["train"][:2]:
        module = next(p for p in row["repo"] if p.endswith(".py") and "/tests" not in p
                      and not p.startswith("tests/") and not p.endswith("__init__.py"))
        lines = row["repo"][module].splitlines(keepends=True)
        fix = (f"--- a/{module}\n+++ b/{module}\n@@ -1,1 +1,2 @@\n {lines[0]}"
               f"+# nothing fixed\n")
        broken.append({**row, "solution": fix})
    domain = tool_domain(tmp_path / "data", {"train": broken, "eval": generated["eval"]})
    # When the cold start demonstrates them (with and without a reproducing test)
    stats = write(domain, tmp_path / "rows.jsonl", tokenizer, episodes=4, seed=0)
    # Then nothing is written, and each drop says why
    assert stats.kept == 0 and (tmp_path / "rows.jsonl").read_text() == ""
    assert sum(stats.dropped.values()) == 4
    assert set(stats.dropped) <= {"the final check did not pass",
                                  "the tests fail after the fix"}, stats.dropped


def test_plans_fit_the_episode_budgets(generated: dict[str, list[dict[str, Any]]]) -> None:
    from streamrl.domains.repo.generate import record

    facts = task_facts(record(generated["train"][0]))
    for seed in range(50):
        for turns, calls in ((3, 0), (4, 5), (8, 24)):
            plan = choose_plan(facts, random.Random(seed), turns, calls, mistakes=1.0)
            assert plan.turns() <= turns
            assert not calls or plan.calls_before_finish() < calls
    with pytest.raises(ValueError, match="no demonstration fits"):
        choose_plan(facts, random.Random(0), 2)


def test_a_mistake_the_tools_do_not_catch_abandons_the_script(
        generated: dict[str, list[dict[str, Any]]]) -> None:
    from streamrl.domains.repo.generate import record

    facts = task_facts(record(generated["train"][0]))
    plan = Plan(reads=(("module",),), baseline=False, reproduce=False, late_module=False,
                mistake="context", together=False)
    script = demonstration(facts, plan, random.Random(0))
    step = next(script)
    with pytest.raises(Abandon, match="mis-indented patch applied"):
        while True:  # every call "succeeds", the mis-indented patch too
            ok = [ToolReply(call_id=f"call_{i}", name=c.name, content="ok")
                  for i, c in enumerate(step.calls)]
            step = script.send(ok)


def test_the_command_writes_the_shipped_configs_cold_start(
        tmp_path: Path, generated: dict[str, list[dict[str, Any]]]) -> None:
    # Given the shipped config with its repository data generated here (the tiny model:
    # SmolLM2's tokenizer and template, no weights converted)
    data = tmp_path / "repo"
    data.mkdir()
    for split, rows in generated.items():
        write_jsonl(rows, data / f"{split}.jsonl")
    out = tmp_path / "rows.jsonl"

    def streamrl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "streamrl", "coldstart", "--config", "configs/agentic.toml",
             "--set", f"domain.repo.data={data}", "--set", "model.spec=tiny",
             "--out", str(out), *args],
            cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip

    # When `streamrl coldstart` runs
    done = streamrl("--episodes", "3", "--seed", "2")
    # Then it writes the rows and says what it kept
    assert done.returncode == 0, done.stderr[-2000:]
    stats = json.loads(done.stdout.strip().splitlines()[-1])
    assert stats["kept"] == 3 == len(read_rows(out)) and stats["dropped"] == {}
    assert 0 < stats["longest_turn_tokens"] <= 384 and stats["longest_episode_tokens"] <= 6144
    # and refuses a domain that is not worked with the tools
    refused = streamrl("--domain", "code")
    assert refused.returncode == 2 and "tools.enabled" in refused.stderr
