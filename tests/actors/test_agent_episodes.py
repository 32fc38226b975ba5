"""Agent-driven repository episodes through the real actors: a real Redis, the real process
sandbox, the real tiny transformers engine behind the executor's OpenAI-compatible endpoint,
and a scripted agent (testing/scripted_agent.py) that uses the official ``openai`` client and
the tools over HTTP, run as a separate program the way the executor runs any agent.

The agent that applies the fix scores 1.0, the same agent changing nothing scores 0, and
every member's trajectory is exactly the tokens (and logprobs) the engine produced."""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import trio

from streamrl.actors.agents import AgentRunner, common_prefix
from streamrl.actors.episodes import EpisodeSessions
from streamrl.actors.executor import Executor, Sandboxes
from streamrl.actors.generator import Generator
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import Verifier
from streamrl.config.schema import AgentConfig, Config, DomainConfig, ToolsConfig
from streamrl.domains import registry
from streamrl.domains.declared import ENV, declare_domains
from streamrl.inference.agent_sessions import Sessions
from streamrl.inference.engine import Completion
from streamrl.inference.openai_api import serve_openai
from streamrl.inference.transformers_engine import open_transformers_engine
from streamrl.learner.batch import build_batch
from streamrl.models import load_tokenizer, resolve_model
from streamrl.net import free_port
from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling, Trajectory, bytes_to_floats, bytes_to_ids
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer
from testing.processes import descendants
from testing.wait import wait_until
from tests.actors.test_multiturn import Replica, entries
from tests.actors.test_repo_tools import ROW, table, write_rows
from tests.domains.test_kinds_repo_tests import SANDBOX_PYTEST
from tests.up_run import run_up

pytestmark = pytest.mark.skipif(not SANDBOX_PYTEST, reason="the sandbox's python3 has no "
                                "pytest (Debian: apt-get install python3-pytest; .ci/run does)")

AGENT = [sys.executable, "-m", "streamrl.testing.scripted_agent", "--calls", "3"]


class Recording:
    """The engine, recording every completion it returns by the session it was for."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.outputs: list[tuple[str, list[int], Completion]] = []
        self.temperatures: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, prompts: list[list[int]], sampling: Sampling, session: str = ""
                       ) -> list[Completion]:
        out = await self.engine.generate(prompts, sampling)
        self.outputs += [(session, p, c) for p, c in zip(prompts, out, strict=True)]
        self.temperatures.append(sampling.temperature)
        return out  # type: ignore[no-any-return]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


@pytest.fixture
def agent_domains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Two declared domains over the same repository task: the agent with the fix, and the
    same agent without it."""
    write_rows(tmp_path / "data")
    patch = tmp_path / "fix.diff"
    patch.write_text(ROW["solution"])
    tables = {
        "agent_fix_test": table(tmp_path / "data", agent=AgentConfig(
            command=[*AGENT, "--patch", str(patch)], timeout_s=60)),
        "agent_idle_test": table(tmp_path / "data", agent=AgentConfig(
            command=AGENT, timeout_s=60)),
    }
    monkeypatch.delenv(ENV, raising=False)
    declare_domains(tables)
    yield tables
    for name in tables:
        registry._factories.pop(name, None)
        registry._instances.pop(name, None)


@pytest.fixture
async def runner() -> AsyncIterator[tuple[AgentRunner, Recording]]:
    """The executor's side of the agents: the tiny engine behind the endpoint, on loopback."""
    async with open_transformers_engine(resolve_model("tiny")) as engine, \
            trio.open_nursery() as nursery:
        recording = Recording(engine)
        sessions = Sessions.for_engine(recording)
        port = free_port()
        await nursery.start(partial(serve_openai, sessions, model="streamrl-policy",
                                    host="127.0.0.1", port=port))
        yield AgentRunner(sessions, f"http://127.0.0.1:{port}"), recording
        nursery.cancel_scope.cancel()


async def test_agent_episodes_score_the_fix_and_record_the_engines_tokens(
    client: RedisClient, names: N.Names, agent_domains: dict[str, Any],
    runner: tuple[AgentRunner, Recording],
) -> None:
    agents, recording = runner
    tokenizer = load_tokenizer(resolve_model("tiny"))
    sandboxes = Sandboxes("process")
    executor = Executor(sandboxes, EpisodeSessions(sandboxes), agent_domains, agents)
    replicas = [Replica(Generator(recording, tokenizer), "g"), Replica(executor, "e"),
                Replica(Verifier(), "v")]
    async with trio.open_nursery() as nursery:
        for r in replicas:
            await nursery.start(r.serve, client, names)
        for name in agent_domains:
            [item] = registry.get_domain(name).load_items("train")
            task = make_task(name, item, split="train", group_size=2,
                             sampling=Sampling(max_new_tokens=16, temperature=0.7), version=0)
            await Producer(client, names).publish(N.TASKS, [encode(task)])

        async def both() -> bool:
            return len(await entries(client, names, N.TRAJECTORIES)) >= 2

        await wait_until(both, timeout=120)
        nursery.cancel_scope.cancel()
    await sandboxes.aclose()

    found = [decode(raw, Trajectory) for raw in await entries(client, names, N.TRAJECTORIES)]
    by_domain = {t.rollout.task.domain: t for t in found}
    assert by_domain["agent_fix_test"].rewards == [1.0, 1.0]
    assert by_domain["agent_idle_test"].rewards == [0.0, 0.0]
    assert recording.outputs  # every model call went through the engine
    # at the task's temperature (the agent asks for 1.0): what the learner recomputes at
    assert set(recording.temperatures) == {0.7}

    for traj in found:
        ep = traj.rollout.task.episode
        assert ep is not None and ep.ended == ["done", "done"]  # each called finish
        prompt = bytes_to_ids(traj.rollout.prompt_ids).tolist()
        sessions = sorted({s for s, _, _ in recording.outputs if s.startswith(ep.id)})
        assert len(sessions) == 2  # one endpoint session per member
        for sample, sid in zip(traj.rollout.samples, sessions, strict=True):
            calls = [(p, c) for s, p, c in recording.outputs if s == sid]
            assert len(calls) == 3 and len(sample.turns) == 3  # one chain of 3 calls
            tokens = bytes_to_ids(sample.tokens).tolist()
            mask = np.frombuffer(sample.mask, np.uint8)
            logprobs = bytes_to_floats(sample.logprobs)
            # the whole sequence is the last call's prompt and completion, as the engine saw
            # and produced them; the model's tokens are exactly its completions
            last_prompt, last = calls[-1]
            assert prompt + tokens == [*last_prompt, *last.tokens.tolist()]
            produced = [t for _, c in calls for t in c.tokens.tolist()]
            assert np.asarray(tokens)[mask == 1].tolist() == produced
            np.testing.assert_array_equal(logprobs[mask == 1],
                                          np.concatenate([c.logprobs for _, c in calls]))
            assert (logprobs[mask == 0] == 0).all()
            # each later call's prompt extends the one before with its completion
            for (p0, c0), (p1, _) in itertools.pairwise(calls):
                assert p1[:len(p0) + len(c0.tokens)] == [*p0, *c0.tokens.tolist()]
    batch = build_batch(found, pad_id=0)
    assert int(batch.loss_mask.sum()) == sum(
        int(np.frombuffer(s.mask, np.uint8).sum()) for t in found for s in t.rollout.samples)


def test_common_prefix() -> None:
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == [1, 2]
    assert common_prefix([[5, 6]]) == [5, 6]
    assert common_prefix([[1], [2]]) == []


def test_agent_tables_are_checked_at_load() -> None:
    repo = {"kind": "repo_tests", "data": "x", "tools": ToolsConfig(enabled=True)}
    assert "tools.enabled" in (DomainConfig(kind="repo_tests", data="x", agent=AgentConfig(
        command=["agent"])).budget_error() or "")
    assert DomainConfig(**repo, agent=AgentConfig(command=["a"])).budget_error() is None
    table = {"kind": "repo_tests", "data": "x", "tools": {"enabled": True},
             "agent": {"command": ["a"]}}
    with pytest.raises(msgspec.ValidationError, match="need inference servers"):
        msgspec.convert({"scheduler": {"domains": ["r"]}, "domain": {"r": table}}, Config)
    servers = {"engine": "sglang", "server_urls": ["http://h:1"]}
    with pytest.raises(msgspec.ValidationError, match=r"below executor\.time_limit_s"):
        msgspec.convert({"scheduler": {"domains": ["r"]}, "domain": {"r": table},
                         "generator": servers}, Config)
    msgspec.convert({"scheduler": {"domains": ["r"]}, "domain": {"r": table},
                     "generator": servers, "executor": {"time_limit_s": 900}}, Config)


async def test_an_agent_past_its_wall_clock_is_killed_and_scores_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runner: tuple[AgentRunner, Recording],
) -> None:
    agents, _ = runner
    write_rows(tmp_path / "data")
    marker, pid_file = tmp_path / "still-running", tmp_path / "slow.pid"
    tables = {"agent_slow_test": table(tmp_path / "data", agent=AgentConfig(
        command=["sh", "-c", f"echo $$ >> {pid_file}; sleep 5; touch {marker}"], timeout_s=1)),
              "agent_crash_test": table(tmp_path / "data", agent=AgentConfig(
                  command=["sh", "-c", "(sleep 37; touch marker) & exit 3"]))}
    monkeypatch.delenv(ENV, raising=False)
    declare_domains(tables)
    sandboxes = Sandboxes("process")
    try:
        async with sandboxes.opened():
            for name, why in (("agent_slow_test", "wall_clock"), ("agent_crash_test",
                                                                   "agent_failed")):
                domain = registry.get_domain(name)
                [item] = domain.load_items("train")
                task = make_task(name, item, split="train", group_size=2,
                                 sampling=Sampling(max_new_tokens=16), version=0)
                prompt, samples, ended, results = await agents.run_group(
                    domain, item, task, sandboxes)
                assert ended == [why, why]
                # no call: no tokens, the group's prompt is the domain's own
                assert [s.tokens for s in samples] == [b"", b""]
                assert prompt == domain.render_prompt(item, agents.sessions.tokenizer)
                assert [domain.score(item, "", r) for r in results] == [0.0, 0.0]
                assert not agents.sessions._sessions  # every endpoint session dropped
                # nothing the agent started outlives it
                assert not [d for d in descendants() if "sleep" in d.cmdline]
        # the killed agents' shells, which would have touched the marker after their sleep,
        # are gone: the killed agent cannot go on
        pids = [int(p) for p in pid_file.read_text().split()]
        assert pids and not [p for p in pids if _alive(p)], pids
        assert not marker.exists()
    finally:
        await sandboxes.aclose()
        for name in tables:
            registry._factories.pop(name, None)
            registry._instances.pop(name, None)


@pytest.mark.system
def test_up_runs_agent_episodes_against_serve_model(redis_url: str, tmp_path: Path) -> None:
    """The whole path under ``streamrl up``: serve-model (``up.serve_models``), the
    executor's endpoint over it (the SGLang client), the scripted agent with the fix, the
    verifier and a learner step on what the agent's calls recorded."""
    write_rows(tmp_path / "data")
    patch = tmp_path / "fix.diff"
    patch.write_text(ROW["solution"])
    name = "repo_agent"
    command = json.dumps([*AGENT[:-1], "2", "--patch", str(patch)])
    overrides = {
        "up.serve_models": "1",
        "scheduler.domains": f'["{name}"]', "scheduler.group_size": "2",
        "scheduler.max_new_tokens": "16", "scheduler.eval_items": "1",
        "scheduler.eval_every": "0", "executor.time_limit_s": "300",
        f"domain.{name}.kind": "repo_tests", f"domain.{name}.data": str(tmp_path / "data"),
        f"domain.{name}.split.by": "files", f"domain.{name}.split.train": "train.jsonl",
        f"domain.{name}.split.eval": "eval.jsonl", f"domain.{name}.tools.enabled": "true",
        f"domain.{name}.agent.command": command, f"domain.{name}.agent.timeout_s": "120",
        "learner.max_steps": "1", "learner.groups_per_step": "1",
    }
    done = run_up(redis_url, tmp_path, overrides, prefix="ag", timeout_s=540)
    assert done.summary["steps"] >= 1 and done.summary["dead_letters"] == 0

    found = done.trajectories()
    assert found
    for t in found:
        assert t.rewards == [1.0, 1.0]  # the agent's fix, judged by the hidden tests
        ep = t.rollout.task.episode
        assert ep is not None and ep.ended == ["done", "done"]
        for s in t.rollout.samples:
            assert len(s.turns) == 2  # two model calls through the endpoint, one chain
            mask = np.frombuffer(s.mask, np.uint8)
            versions = s.token_versions()
            assert 0 < mask.sum() < len(mask)  # the calls' completions, between the turns
            assert int(versions[mask == 1].min()) == s.weight_version
    assert "serving the OpenAI endpoint" in done.log("executor-0")
