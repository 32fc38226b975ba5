"""A client's bad requests through the real actors (issue 32, item 4): a repository-task
episode whose agent (testing/scripted_agent.py ``--bad-requests``, the official ``openai``
client and raw HTTP) first sends its endpoint nested JSON, ``stream_options: "yes"``, a lone
surrogate and an empty body, then works as usual. A real Redis, the real process sandbox, the
real tiny transformers engine behind the executor's endpoint.

Each bad request is refused with a 4xx and recorded nowhere; the session stays usable: the
agent's fix scores 1.0, every member's sequence is its three good calls, no dead letter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from streamrl.actors.agents import AgentRunner
from streamrl.actors.episodes import EpisodeSessions
from streamrl.actors.executor import Executor, Sandboxes
from streamrl.actors.generator import Generator
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import Verifier
from streamrl.config.schema import AgentConfig, DomainConfig
from streamrl.domains import registry
from streamrl.domains.declared import ENV, declare_domains
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling, Trajectory
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.streams import Producer
from streamrl.testing.wait import wait_until
from tests.actors.test_agent_episodes import AGENT, Recording, runner
from tests.actors.test_multiturn import Replica, entries
from tests.actors.test_repo_tools import ROW, table, write_rows
from tests.domains.test_kinds_repo_tests import SANDBOX_PYTEST

pytestmark = pytest.mark.skipif(not SANDBOX_PYTEST, reason="the sandbox's python3 has no "
                                "pytest (Debian: apt-get install python3-pytest; .ci/run does)")
__all__ = ["runner"]  # the executor's endpoint over the tiny engine (a fixture)
NAME = "agent_bad_requests_test"


@pytest.fixture
def bad_agent_domain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                     ) -> Iterator[dict[str, DomainConfig]]:
    write_rows(tmp_path / "data")
    patch = tmp_path / "fix.diff"
    patch.write_text(ROW["solution"])
    monkeypatch.delenv(ENV, raising=False)
    tables = {NAME: table(tmp_path / "data", agent=AgentConfig(
        command=[*AGENT, "--patch", str(patch), "--bad-requests"], timeout_s=60))}
    declare_domains(tables)
    yield tables
    registry._factories.pop(NAME, None)
    registry._instances.pop(NAME, None)


async def test_an_agents_bad_requests_leave_its_session_usable(
    client: RedisClient, names: N.Names, bad_agent_domain: dict[str, DomainConfig],
    runner: tuple[AgentRunner, Recording],
) -> None:
    agents, recording = runner
    sandboxes = Sandboxes("process")
    executor = Executor(sandboxes, EpisodeSessions(sandboxes), bad_agent_domain, agents)
    replicas = [Replica(Generator(recording, load_tokenizer(resolve_model("tiny"))), "g"),
                Replica(executor, "e"), Replica(Verifier(), "v")]
    async with trio.open_nursery() as nursery:
        for r in replicas:
            await nursery.start(r.serve, client, names)
        [item] = registry.get_domain(NAME).load_items("train")
        task = make_task(NAME, item, split="train", group_size=2,
                         sampling=Sampling(max_new_tokens=16), version=0)
        await Producer(client, names).publish(N.TASKS, [encode(task)])

        async def ended() -> Any:
            return await entries(client, names, N.TRAJECTORIES) or await entries(
                client, names, N.DEAD)

        await wait_until(ended, timeout=120)
        nursery.cancel_scope.cancel()
    await sandboxes.aclose()

    assert await entries(client, names, N.DEAD) == []
    [traj] = [decode(raw, Trajectory) for raw in await entries(client, names, N.TRAJECTORIES)]
    episode = traj.rollout.task.episode
    assert episode is not None and episode.ended == ["done", "done"]
    assert traj.rewards == [1.0, 1.0]
    # only the three good calls of each member reached the engine and its trajectory
    assert len(recording.outputs) == 6
    assert [len(s.turns) for s in traj.rollout.samples] == [3, 3]
