"""``code`` with feedback (domains/feedback.py): the reward options and the feedback rendering
computed by hand, the budgets refused at config load, and the built-in ``code``, a HumanEval
``python_tests`` and an APPS ``stdio`` domain played turn by turn in one real process
sandbox session, as the executor plays them."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from streamrl.config.schema import ConfigError, DomainConfig, FeedbackConfig, load_config
from streamrl.domains.base import EpisodePolicy, is_multi_turn, tool_calls
from streamrl.domains.code import Case, CodeItem
from streamrl.domains.declared import build_domain
from streamrl.domains.feedback import (
    NO_CODE,
    count_tests,
    episode_reward,
    first_tests,
    render_results,
)
from streamrl.domains.kinds import TestResult as Result
from streamrl.domains.template import DeclarationError
from streamrl.sandbox.process import ProcessSandbox, open_process_sandbox

UID_BASE = 360_000 + (os.getpid() % 500) * 1024

ITEM = CodeItem(id="fb-1", prompt="Write add_3(xs).", entry="add_3",
                tests=[Case([[1, 2]], [4, 5]), Case([[]], []), Case([[-3]], [0]),
                       Case([[10, 0]], [13, 3])],
                salt="00112233445566778899aabbccddeeff")
WRONG = "```python\ndef add_3(xs):\n    return [x + 2 for x in xs]\n```"
RIGHT = "```python\ndef add_3(xs):\n    return [x + 3 for x in xs]\n```"
# passes the two visible tests (the first half), fails the hidden ones
VISIBLE_ONLY = ("```python\ndef add_3(xs):\n    return {(1, 2): [4, 5], (): []}.get(tuple(xs), [])"
                "\n```")


def fb(**options: Any) -> FeedbackConfig:
    return FeedbackConfig(enabled=True, **options)


@pytest.fixture
async def box() -> AsyncIterator[ProcessSandbox]:
    async with open_process_sandbox(uid_base=UID_BASE) as sandbox:
        yield sandbox


async def play(box: ProcessSandbox, domain: Any, item: Any, replies: list[str]
               ) -> tuple[list[str], list[bool], float]:
    """Every reply as one turn in one session until done, then the final check, as the
    executor does: (observations, done after each turn, the reward)."""
    observations, done = [], []
    async with box.session(domain.sandbox.limits, "fb") as session:
        await session.put_files({**domain.sandbox.files, **domain.session_files(item)})
        turns = 0
        for text in replies:
            turns += 1
            request = domain.exec_request(item, text)
            result = await session.run(request) if request is not None else None
            observations.append(domain.render_observation(item, result))
            done.append(domain.is_done(item, text, result))
            if done[-1]:
                break
        final = domain.final_request(item)
        result = await session.run(final) if final is not None else None
        return observations, done, domain.score_turns(item, turns, result)


# -- by hand ------------------------------------------------------------------------------


def test_reward_options_by_hand() -> None:
    plain = FeedbackConfig(enabled=True)
    assert episode_reward(0.75, 3, 4, plain) == 0.75
    penalty = fb(turn_penalty=0.1)
    # fail then pass: the final pass fraction minus one turn's penalty
    assert episode_reward(1.0, 2, 4, penalty) == pytest.approx(0.9)
    assert episode_reward(1.0, 1, 4, penalty) == 1.0
    assert episode_reward(0.05, 4, 4, penalty) == 0.0  # kept in [0, 1]
    bonus = fb(early_bonus=0.3)
    assert episode_reward(1.0, 1, 4, bonus) == pytest.approx(1.0)
    assert episode_reward(1.0, 2, 4, bonus) == pytest.approx(0.7 + 0.3 * 2 / 3)
    assert episode_reward(1.0, 4, 4, bonus) == pytest.approx(0.7)
    assert episode_reward(0.5, 1, 4, bonus) == pytest.approx(0.35)  # no bonus without a pass
    all_pass = fb(final="all_pass")
    assert episode_reward(0.75, 1, 4, all_pass) == 0.0
    assert episode_reward(1.0, 3, 4, all_pass) == 1.0


def test_feedback_rendering_pass_fail_error_lines_and_truncation() -> None:
    results = [Result(name="t0", status="pass"),
               Result(name="t1", status="fail", message="AssertionError: expected 3\n got 4"),
               Result(name="t2", status="error", message="Traceback ...\nZeroDivisionError"),
               Result(name="t3", status="timeout", message="ran past 2.00 s")]
    text = render_results(results)
    assert text.splitlines() == [
        "1/4 tests passed.",
        "FAIL t1: AssertionError: expected 3 got 4",
        "ERROR t2: Traceback ... ZeroDivisionError",
        "TIMEOUT t3: ran past 2.00 s",
        "PASS t0",
    ]
    assert render_results(results[:1]) == "1/1 tests passed. All visible tests pass.\nPASS t0"
    # one message is cut to message_chars; the whole to observation_chars, with a marker
    long = [Result(name=f"t{i}", status="fail", message="x" * 1000) for i in range(50)]
    cut = render_results(long, observation_chars=400, message_chars=60)
    assert len(cut) <= 400 and cut.endswith("more lines cut]")
    assert all(len(line) <= len("FAIL t00: ") + 60 for line in cut.splitlines())
    assert "FAIL t0: " + "x" * 57 + "..." in cut
    for budget in range(200, 600, 7):  # never over the budget, whatever it is
        assert len(render_results(long, observation_chars=budget, message_chars=300)) <= budget


def test_the_first_tests_of_a_humaneval_program() -> None:
    program = ("METADATA = {}\n\ndef check(candidate):\n    assert candidate(1) == 2\n"
               "    x = 3\n    assert candidate(x) == 4, 'three'\n"
               "    for i in range(2):\n        assert candidate(i) == i + 1\n")
    assert count_tests(program) == 3
    two = first_tests(program, 2)
    assert count_tests(two) == 2 and "x = 3" in two and "range" not in two
    assert count_tests(first_tests(program, 0)) == 0 and "def check" in first_tests(program, 0)


def test_budgets_and_feedback_refused_at_config_load_when_inconsistent() -> None:
    base = ["scheduler.domains=['code', 'terminal']"]
    bad = {
        "domain.terminal.max_new_tokens=512": "max_new_tokens (512) must be below "
                                             "max_total_tokens (256)",
        "domain.terminal.timeout_s=30": "timeout_s (30.0, one sandbox run) is longer than "
                                       "episode_timeout_s",
        "domain.code.feedback.turn_penalty=0.2": "feedback options need feedback.enabled",
        "domain.code.feedback.enabled=true": "a pass on the last turn would earn nothing",
    }
    table = {"domain.terminal.max_total_tokens=256", "domain.terminal.episode_timeout_s=10"}
    for override, message in bad.items():
        extra = ["domain.code.feedback.turn_penalty=0.5"] if "enabled" in override else []
        with pytest.raises((ConfigError, ValueError), match=message.replace("(", r"\(")
                           .replace(")", r"\)")):
            load_config(None, [*base, *table, override, *extra])
    with pytest.raises((ConfigError, ValueError), match="no attempt is left"):
        load_config(None, [*base, "domain.code.feedback.enabled=true", "domain.code.max_turns=1"])
    ok = load_config(None, [*base, *table, "domain.code.feedback.enabled=true",
                            "domain.code.feedback.turn_penalty=0.25", "domain.code.max_turns=4"])
    assert ok.domain["code"].feedback.turn_penalty == 0.25


def test_the_terminal_budget_is_configurable_and_single_turn_budgets_are_refused() -> None:
    terminal = build_domain("terminal", DomainConfig(max_total_tokens=4096, max_tool_calls=3,
                                                    episode_timeout_s=60))
    assert terminal.episode == EpisodePolicy(multi_turn=True, max_turns=6, max_total_tokens=4096,
                                             max_tool_calls=3, timeout_s=60)
    assert build_domain("terminal", DomainConfig()).episode.max_total_tokens == 2048
    with pytest.raises(DeclarationError, match="'math' is single-turn: max_total_tokens"):
        build_domain("math", DomainConfig(max_total_tokens=512))
    with pytest.raises(DeclarationError, match="needs a code domain"):
        build_domain("math", DomainConfig(feedback=fb()))


def test_episode_policy_ends_a_member_on_each_budget() -> None:
    policy = EpisodePolicy(multi_turn=True, max_turns=5, max_tool_calls=2, timeout_s=30)
    assert policy.ended_by(1, 1, 5.0) == ""
    assert policy.ended_by(5, 0, 0.0) == "max_turns"
    assert policy.ended_by(2, 2, 0.0) == "tool_calls"
    assert policy.ended_by(2, 1, 30.0) == "wall_clock"
    code = build_domain("code", DomainConfig(feedback=fb()))
    assert tool_calls(code, ITEM, [WRONG, "", RIGHT]) == 2


# -- in the sandbox -----------------------------------------------------------------------


async def test_code_fail_then_pass_earns_the_final_pass_minus_a_turn(box: ProcessSandbox
                                                                     ) -> None:
    domain = build_domain("code", DomainConfig(max_turns=3, feedback=fb(turn_penalty=0.25)))
    assert is_multi_turn(domain) and domain.episode.max_turns == 3
    observations, done, reward = await play(box, domain, ITEM, [WRONG, RIGHT])
    # the first two of four tests are visible: what failed and why goes back to the model
    assert observations[0].splitlines() == [
        "1/2 tests passed.", "FAIL add_3([1, 2]): returned [3, 4], expected [4, 5]",
        "PASS add_3([])"]
    assert "[-3]" not in observations[0] and "[10, 0]" not in "".join(observations)
    assert done == [False, True] and reward == 0.75
    assert (await play(box, domain, ITEM, [RIGHT]))[2] == 1.0


async def test_code_the_hidden_tests_decide_and_no_code_scores_nothing(box: ProcessSandbox
                                                                       ) -> None:
    domain = build_domain("code", DomainConfig(feedback=fb()))
    observations, done, reward = await play(box, domain, ITEM, [VISIBLE_ONLY])
    # the visible tests pass, so the member is done; the hidden two fail the final check
    assert done == [True] and "All visible tests pass" in observations[0] and reward == 0.5
    observations, done, reward = await play(box, domain, ITEM, ["", "", ""])
    assert observations == [NO_CODE] * 3 and done == [False] * 3 and reward == 0.0


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


async def test_humaneval_python_tests_with_feedback(box: ProcessSandbox, tmp_path: Path) -> None:
    check = ("def check(candidate):\n    assert candidate(1, 2) == 3\n"
             "    assert candidate(0, 0) == 0\n    assert candidate(-1, -1) == -2, 'negatives'\n"
             "    assert candidate(2, 2) == 4\n")
    rows = [{"task_id": f"h{i}", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n",
             "test": check, "entry_point": "add"} for i in range(4)]
    cfg = msgspec.convert({"kind": "python_tests", "data": write_jsonl(tmp_path / "he.jsonl", rows),
                           "fields": {"id": "task_id", "tests": "test"},
                           "split": {"eval_fraction": 0.5},
                           "feedback": {"enabled": True, "visible_fraction": 0.75,
                                        "turn_penalty": 0.1}}, DomainConfig)
    domain = build_domain("he", cfg)
    item = (domain.load_items("train") + domain.load_items("eval"))[0]
    observations, done, reward = await play(
        box, domain, item, ["```python\n    return a - b\n```", "    return a + b\n"])
    lines = observations[0].splitlines()
    assert lines[0] == "1/3 tests passed."  # three of the four asserts are visible
    assert lines[1].startswith("FAIL test_0: assert candidate(1, 2) == 3")
    assert any(line.startswith("FAIL test_2") and "negatives" in line for line in lines)
    assert "candidate(2, 2)" not in observations[0]
    assert done == [False, True] and reward == pytest.approx(0.9)


async def test_apps_stdio_with_a_visible_column_and_a_hidden_check(
    box: ProcessSandbox, tmp_path: Path
) -> None:
    rows = [{"id": f"a{i}", "question": "Print the sum of two integers.",
             "examples": [{"input": "1 2\n", "output": "3\n"}],
             "tests": {"inputs": ["1 2\n", "5 5\n", "-1 1\n"], "outputs": ["3\n", "10\n", "0\n"]}}
            for i in range(4)]
    cfg = msgspec.convert({"kind": "stdio", "data": write_jsonl(tmp_path / "apps.jsonl", rows),
                           "fields": {"prompt": "question"}, "split": {"eval_fraction": 0.5},
                           "max_turns": 3,
                           "feedback": {"enabled": True, "visible_column": "examples"}},
                          DomainConfig)
    domain = build_domain("apps", cfg)
    item = (domain.load_items("train") + domain.load_items("eval"))[0]
    # prints the example's answer: passes the visible case, then 1 of 3 hidden ones
    hack = "```python\nprint(3)\n```"
    observations, done, reward = await play(box, domain, item, [hack])
    assert observations[0] == "1/1 tests passed. All visible tests pass.\nPASS case_0"
    assert done == [True] and reward == pytest.approx(1 / 3)
    wrong = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    observations, done, reward = await play(box, domain, item, [wrong, right])
    assert observations[0].startswith("0/1 tests passed.\nFAIL case_0: expected '3\\n', got")
    assert done == [False, True] and reward == 1.0
    bad = msgspec.structs.replace(cfg, feedback=fb(visible_column="nope"))
    with pytest.raises(ValueError, match="no visible tests column 'nope'"):
        refused = build_domain("apps2", bad)
        refused.load_items("train"), refused.load_items("eval")
