"""Repository tasks worked with the standard tools, end to end through the real actors: a
real Redis, the real process sandbox, the real tokenizer and chat template, and (first test)
planted replies, so the rewards are known: read, patch, test, finish earns 1.0; finishing at
once earns 0; attacks (escaping the work dir, malformed JSON, unknown tools) come back as
error results, a reply without a call gets a reminder, rewriting the tests earns nothing.
The second test runs the tiny real model through ``streamrl up`` on the same domain."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import trio

from streamrl.actors.episodes import EpisodeSessions
from streamrl.actors.executor import Executor, Sandboxes
from streamrl.actors.generator import Generator
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import Verifier
from streamrl.config.schema import (
    DomainConfig,
    FeedbackConfig,
    PromptConfig,
    SplitConfig,
    ToolsConfig,
)
from streamrl.domains import registry
from streamrl.domains.agentic import NO_CALL, ToolDomain
from streamrl.domains.base import write_jsonl
from streamrl.domains.declared import ENV, declare_domains
from streamrl.domains.repo.generate import instance
from streamrl.domains.repo.templates import STRINGS
from streamrl.learner.batch import build_batch
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling, bytes_to_ids
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import Producer
from streamrl.sandbox import ProcessSandbox, opened
from tests.actors.test_multiturn import Replica, ScriptedEngine, entries, trajectory
from tests.domains.test_kinds_repo_tests import SANDBOX_PYTEST
from tests.up_run import run_up

pytestmark = pytest.mark.skipif(not SANDBOX_PYTEST, reason="the sandbox's python3 has no "
                                "pytest (Debian: apt-get install python3-pytest; .ci/run does)")

NAME = "repo_tools_test"
ROWS = [instance(STRINGS, next(b for b in STRINGS.bugs if b.name == "slug_last_word"),
                 "textkit", 0),
        instance(STRINGS, next(b for b in STRINGS.bugs if b.name == "slug_last_word"),
                 "wordy", 1)]
ROW = ROWS[0]
MODULE, TESTS = "textkit/text.py", "tests/test_text.py"


def table(data: Path, **extra: Any) -> DomainConfig:
    return DomainConfig(kind="repo_tests", data=str(data), max_turns=4,
                        split=SplitConfig(by="files", train="train.jsonl", eval="eval.jsonl"),
                        prompt=PromptConfig(template="Issue:\n{problem_statement}"),
                        verifier={"test_timeout_s": 30.0},
                        tools=ToolsConfig(enabled=True), **extra)


def write_rows(data: Path) -> None:
    write_jsonl(ROWS[:1], data / "train.jsonl")
    write_jsonl(ROWS[1:], data / "eval.jsonl")


@pytest.fixture
def repo_domain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DomainConfig]:
    """``[domain.repo_tools_test]`` declared in this process, gone afterwards."""
    write_rows(tmp_path / "data")
    cfg = table(tmp_path / "data", max_tool_calls=5)
    monkeypatch.delenv(ENV, raising=False)
    declare_domains({NAME: cfg})
    yield cfg
    registry._factories.pop(NAME, None)
    registry._instances.pop(NAME, None)


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


SOLVER = [  # member 0: look, patch, test, finish
    call("list_files") + "\n" + call("read_file", path=MODULE),
    "The last word is dropped.\n" + call("apply_patch", patch=ROW["solution"]),
    call("run_tests"),
    call("finish", summary="slugify keeps the last word"),
]
ATTACKER = [  # member 2: attacks, no call, a rewrite of the tests, nothing
    call("read_file", path="../../../etc/passwd") + call("read_file", path="/etc/passwd")
    + '<tool_call>{"name": "run", "arguments": {"command": </tool_call>'
    + call("rm_rf", path="."),
    "I fixed it.",
    call("write_file", path=TESTS, content="def test_slugify_words():\n    pass\n"),
    "Done.",
]


async def test_repo_episode_with_tools_through_the_actors(
    client: RedisClient, names: N.Names, repo_domain: DomainConfig
) -> None:
    tokenizer = load_tokenizer(resolve_model("tiny"))

    def script(turn: int, pos: int) -> str:
        # turn 1: members 0, 1, 2 live; then members 0 and 2 (pos 0 and 1)
        if turn == 1:
            return [SOLVER[0], call("finish"), ATTACKER[0]][pos]
        return (SOLVER if pos == 0 else ATTACKER)[turn - 1]

    engine = ScriptedEngine(tokenizer, script)
    sandboxes = Sandboxes("process")
    executor = Executor(sandboxes, EpisodeSessions(sandboxes), {NAME: repo_domain})
    replicas = [Replica(Generator(engine, tokenizer), "g"), Replica(executor, "e"),
                Replica(Verifier(), "v")]
    domain = registry.get_domain(NAME)
    assert isinstance(domain, ToolDomain)
    [item] = domain.load_items("train")
    async with trio.open_nursery() as nursery:
        for r in replicas:
            await nursery.start(r.serve, client, names)
        task = make_task(NAME, item, split="train", group_size=3,
                         sampling=Sampling(max_new_tokens=256), version=0)
        await Producer(client, names).publish(N.TASKS, [encode(task)])
        traj = await trajectory(client, names)
        nursery.cancel_scope.cancel()
    await sandboxes.aclose()

    ep = traj.rollout.task.episode
    # the attacker's 4 calls of turn 1 and its test rewrite of turn 3 reach max_tool_calls
    assert ep is not None and ep.ended == ["done", "done", "tool_calls"]
    assert ep.tool_format == "hermes"  # SmolLM2's template renders no tools: the fallback
    assert traj.rewards == [1.0, 0.0, 0.0]
    solver, quitter, attacker = traj.rollout.samples
    assert [len(s.turns) for s in traj.rollout.samples] == [4, 1, 3]

    # the solver's tool results, each a tool message
    listing, source = solver.turns[0].tools
    assert not listing.error and f"{MODULE} (" in listing.content
    assert not source.error and source.content == ROW["repo"][MODULE]
    assert not solver.turns[1].tools[0].error, solver.turns[1].tools[0].content
    tests = solver.turns[2].tools[0]
    assert not tests.error and "passed" in tests.content and "FAIL" not in tests.content
    assert solver.turns[3].tools[0].name == "finish"
    # the model saw them as tool messages in the template, after its own reply
    turn2 = next(p for t, ps in engine.calls if t == 2 for p in ps)
    shown = tokenizer.decode(turn2)
    assert "<tools>" in shown and '"name": "apply_patch"' in shown  # the declared tools
    assert "<|im_start|>tool\n" + ROW["repo"][MODULE] in shown

    # every attack is an error result; nothing escaped or crashed
    escape, absolute, malformed, unknown = attacker.turns[0].tools
    assert all(r.error for r in attacker.turns[0].tools)
    assert "root:" not in escape.content + absolute.content
    assert ".." in escape.content and "relative" in absolute.content
    assert "JSON" in malformed.content or "json" in malformed.content
    assert "unknown tool 'rm_rf'" in unknown.content
    assert attacker.turns[1].tools == [] and attacker.turns[1].observation == NO_CALL
    assert not attacker.turns[2].tools[0].error  # it may rewrite the tests: they are restored
    assert quitter.turns[0].tools[0].name == "finish"

    # only the model's tokens are trained
    for s in traj.rollout.samples:
        tokens, mask = bytes_to_ids(s.tokens), np.frombuffer(s.mask, dtype=np.uint8)
        replies = [engine.reply_ids(t.text) for t in s.turns]
        assert tokens[mask == 1].tolist() == [i for r in replies for i in r]
        assert (mask == 0).any() == (len(s.turns) > 1)
    batch = build_batch([traj], pad_id=0)
    assert int(batch.loss_mask.sum()) == sum(
        int(np.frombuffer(s.mask, np.uint8).sum()) for s in traj.rollout.samples)


MISTAKES = [  # member 0: the mistakes models make (issue 32), then the fix
    call("read_file", path="textkit") + call("write_file", path="notes.txt", content="\ud800")
    + call("run", command="echo a\x00b") + call("apply_patch", patch="--- a/tests\n+++ b/tests\n"
                                                 "@@ -1 +1 @@\n-x\n+y\n"),
    call("run", command="chmod 555 . textkit") + call("apply_patch", patch=ROW["solution"]),
    call("run", command="trap '' TERM; sleep 30", timeout_s=1),
    call("run_tests") + call("run", command="chmod 555 . textkit tests") + call("finish"),
]


@pytest.fixture
def mistakes_domain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[DomainConfig]:
    """``[domain.repo_tools_test]`` with room for the mistakes (turns, tool calls)."""
    write_rows(tmp_path / "data")
    cfg = table(tmp_path / "data", max_tool_calls=20)
    cfg = msgspec.structs.replace(cfg, max_turns=len(MISTAKES))
    monkeypatch.delenv(ENV, raising=False)
    declare_domains({NAME: cfg})
    yield cfg
    registry._factories.pop(NAME, None)
    registry._instances.pop(NAME, None)


async def test_a_models_mistakes_are_observations_through_the_actors(
    client: RedisClient, names: N.Names, mistakes_domain: DomainConfig
) -> None:
    # Given a repository task whose member 0 reads a directory, writes a lone surrogate,
    # runs a NUL, patches a directory, fixes the bug in a directory it made read-only, runs
    # a command that ignores SIGTERM past its timeout, runs the tests and leaves the work
    # dir read-only for the final check; member 1 quits
    tokenizer = load_tokenizer(resolve_model("tiny"))
    engine = ScriptedEngine(tokenizer, lambda turn, pos: call("finish") if pos else
                            MISTAKES[turn - 1])
    sandboxes = Sandboxes("process")
    executor = Executor(sandboxes, EpisodeSessions(sandboxes), {NAME: mistakes_domain})
    replicas = [Replica(Generator(engine, tokenizer), "g"), Replica(executor, "e"),
                Replica(Verifier(), "v")]
    [item] = registry.get_domain(NAME).load_items("train")
    # When the episode runs through the real actors
    async with trio.open_nursery() as nursery:
        for r in replicas:
            await nursery.start(r.serve, client, names)
        task = make_task(NAME, item, split="train", group_size=2,
                         sampling=Sampling(max_new_tokens=256), version=0)
        await Producer(client, names).publish(N.TASKS, [encode(task)])
        traj = await trajectory(client, names)
        nursery.cancel_scope.cancel()
    await sandboxes.aclose()
    # Then every mistake is an error observation, the fix earns its reward, nothing is
    # dead-lettered
    ep = traj.rollout.task.episode
    assert ep is not None and ep.ended == ["done", "done"]
    assert traj.rewards == [1.0, 0.0]
    turns = traj.rollout.samples[0].turns
    directory, surrogate, nul, patch_dir = turns[0].tools
    assert all(r.error for r in turns[0].tools), turns[0].tools
    assert "textkit: not a regular file" in directory.content
    assert "not valid Unicode" in surrogate.content and "NUL" in nul.content
    assert "tests: not a regular file" in patch_dir.content
    chmod, fixed = turns[1].tools
    assert not chmod.error and fixed.content == f"patched {MODULE}", fixed
    [stubborn] = turns[2].tools
    assert stubborn.content.startswith("timed out after 1 s"), stubborn
    tests, read_only, _ = turns[3].tools
    assert "passed" in tests.content and "FAIL" not in tests.content, tests.content
    assert read_only.content == "exit code 0", read_only
    assert await entries(client, names, N.DEAD) == []


def test_tools_table_is_checked_at_load() -> None:
    from streamrl.domains.declared import build_domain
    from streamrl.domains.template import DeclarationError

    assert "choose one" in (DomainConfig(kind="repo_tests", data="x", tools=ToolsConfig(
        enabled=True), feedback=FeedbackConfig(enabled=True)).budget_error() or "")
    assert "tools.enabled" in (DomainConfig(tools=ToolsConfig(output_chars=500))
                               .budget_error() or "")
    with pytest.raises(DeclarationError, match="repo_tests"):
        build_domain("code", DomainConfig(tools=ToolsConfig(enabled=True)))


@pytest.mark.system
def test_repo_tasks_with_tools_run_with_the_tiny_model(redis_url: str, tmp_path: Path) -> None:
    write_rows(tmp_path / "data")
    overrides = {
        "scheduler.domains": f'["{NAME}"]', "scheduler.group_size": "2",
        "scheduler.max_new_tokens": "24", "scheduler.eval_items": "1",
        "scheduler.eval_every": "0",
        f"domain.{NAME}.kind": "repo_tests", f"domain.{NAME}.data": str(tmp_path / "data"),
        f"domain.{NAME}.split.by": "files", f"domain.{NAME}.split.train": "train.jsonl",
        f"domain.{NAME}.split.eval": "eval.jsonl",
        f"domain.{NAME}.prompt.template": "Issue: {problem_statement}",
        f"domain.{NAME}.tools.enabled": "true", f"domain.{NAME}.max_turns": "2",
        f"domain.{NAME}.max_total_tokens": "2048",
        "learner.max_steps": "1", "learner.groups_per_step": "1",
    }
    done = run_up(redis_url, tmp_path, overrides, prefix="rt")
    assert done.summary["steps"] >= 1 and done.summary["dead_letters"] == 0

    trajectories = done.trajectories()
    assert trajectories
    for t in trajectories:
        ep = t.rollout.task.episode
        assert ep is not None and set(ep.ended) <= {"done", "max_turns", "budget"}
        assert t.rewards == [0.0] * len(t.rewards)  # a random model fixes nothing
        for s in t.rollout.samples:
            assert 1 <= len(s.turns) <= 2 and s.turns[0].observation
            mask = np.frombuffer(s.mask, dtype=np.uint8)
            assert (mask == 0).any() == (len(s.turns) == 2)
    metrics = done.metrics()
    assert metrics and metrics[0].groups >= 1


async def test_act_reads_the_models_format(repo_domain: DomainConfig) -> None:
    domain = registry.get_domain(NAME)
    [item] = domain.load_items("train")
    box = ProcessSandbox()
    async with opened(box), box.session(domain.sandbox.limits, label="act") as session:
        await session.put_files(domain.session_files(item))
        text = '{"name": "list_files", "parameters": {}}'  # a llama3-style reply
        action = await domain.act(item, text, session, "llama3")
        assert not action.results[0].error and MODULE in action.results[0].content
        assert not action.changed and not action.done
        hermes = await domain.act(item, text, session, "hermes")  # no call in that format
        assert hermes.results == [] and hermes.observation == NO_CALL
        # the session holds the repository and nothing else (no harness, no hidden test)
        listing = action.results[0].content.splitlines()
        assert sorted(line.split(" ")[0] for line in listing if not line.endswith("/")) == \
            sorted(ROW["repo"])
