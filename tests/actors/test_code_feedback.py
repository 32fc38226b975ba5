"""``code`` with test feedback end to end through the real actors: a real Redis, the real
process sandbox, the real tokenizer, and (first test) planted replies, so that the rewards
can be checked against the configured options: fail then pass earns the final pass
fraction minus one turn's penalty; a budget (``max_tool_calls``) stops an episode; the
observation tokens are masked out of the loss. The second test runs the tiny real model
through ``streamrl up`` on the same domain (the pipeline, not the score)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trio

from streamrl.actors.episodes import EpisodeSessions
from streamrl.actors.executor import Executor, Sandboxes
from streamrl.actors.generator import Generator
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import Verifier
from streamrl.config.schema import DomainConfig, FeedbackConfig
from streamrl.domains import registry
from streamrl.domains.declared import ENV, declare_domains
from streamrl.learner.batch import build_batch
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Sampling, bytes_to_ids
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import encode
from streamrl.queues.streams import Producer
from tests.actors.test_multiturn import Replica, ScriptedEngine, trajectory
from tests.domains.test_feedback import ITEM, RIGHT, WRONG
from tests.up_run import run_up

CONFIG = DomainConfig(max_turns=4, max_tool_calls=2, feedback=FeedbackConfig(
    enabled=True, turn_penalty=0.1))


@pytest.fixture
def code_with_feedback(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``[domain.code]`` with feedback declared in this process (as every actor's context
    does from the config), and the plain ``code`` domain back afterwards."""
    monkeypatch.delenv(ENV, raising=False)
    declare_domains({"code": CONFIG})
    yield
    registry._factories.pop("code", None)
    registry._instances.pop("code", None)


async def test_feedback_episode_rewards_masks_and_budgets_through_the_actors(
    client: RedisClient, names: N.Names, code_with_feedback: None
) -> None:
    tokenizer = load_tokenizer(resolve_model("tiny"))

    def script(turn: int, pos: int) -> str:
        # member 0 passes at once; member 1 fails, reads the feedback, passes; member 2
        # keeps failing until its tool-call budget (2) stops it. ``pos``: among the live
        # members of the turn (at turn 2: members 1 and 2)
        return RIGHT if pos == 0 else WRONG

    engine = ScriptedEngine(tokenizer, script)
    sandboxes = Sandboxes("process")
    executor = Executor(sandboxes, EpisodeSessions(sandboxes), {"code": CONFIG})
    replicas = [Replica(Generator(engine, tokenizer), "g"), Replica(executor, "e"),
                Replica(Verifier(), "v")]
    async with trio.open_nursery() as nursery:
        for r in replicas:
            await nursery.start(r.serve, client, names)
        task = make_task("code", ITEM, split="train", group_size=3,
                         sampling=Sampling(max_new_tokens=64), version=0)
        await Producer(client, names).publish(N.TASKS, [encode(task)])
        traj = await trajectory(client, names)
        nursery.cancel_scope.cancel()
    await sandboxes.aclose()

    ep = traj.rollout.task.episode
    assert ep is not None and ep.ended == ["done", "done", "tool_calls"] and ep.started_at > 0
    assert [len(s.turns) for s in traj.rollout.samples] == [1, 2, 2]
    # the rewards follow the options: 1.0; 1.0 - 0.1 (one turn more); 1/4 of the tests - 0.1
    assert traj.rewards == pytest.approx([1.0, 0.9, 0.15])
    member1 = traj.rollout.samples[1]
    assert member1.turns[0].observation.startswith(
        "1/2 tests passed.\nFAIL add_3([1, 2]): returned [3, 4], expected [4, 5]")
    # the model saw that feedback, in the chat template, before its second reply
    turn2 = next(p for t, ps in engine.calls if t == 2 for p in ps)
    assert "FAIL add_3([1, 2]): returned [3, 4]" in tokenizer.decode(turn2)
    # and the observation tokens are masked out of the loss: only the replies are trained
    for s in traj.rollout.samples:
        tokens, mask = bytes_to_ids(s.tokens), np.frombuffer(s.mask, dtype=np.uint8)
        replies = [engine.reply_ids(t.text) for t in s.turns]
        assert tokens[mask == 1].tolist() == [i for r in replies for i in r]
        assert (mask == 0).any() == (len(s.turns) > 1)
    batch = build_batch([traj], pad_id=0)
    assert int(batch.loss_mask.sum()) == sum(
        int(np.frombuffer(s.mask, np.uint8).sum()) for s in traj.rollout.samples)
    assert (batch.old_logprobs[batch.loss_mask == 0] == 0).all()


@pytest.mark.system
def test_code_with_feedback_trains_with_the_tiny_model(redis_url: str, tmp_path: Path) -> None:
    overrides = {
        "scheduler.domains": '["code"]', "scheduler.group_size": "2",
        "scheduler.max_new_tokens": "24", "scheduler.eval_items": "2",
        "scheduler.eval_every": "0",
        "domain.code.feedback.enabled": "true", "domain.code.max_turns": "2",
        "domain.code.max_total_tokens": "1024",
        "learner.max_steps": "1", "learner.groups_per_step": "1",
    }
    done = run_up(redis_url, tmp_path, overrides, prefix="cf")
    assert done.summary["steps"] >= 1 and done.summary["dead_letters"] == 0

    trajectories = done.trajectories()
    assert trajectories
    for t in trajectories:
        ep = t.rollout.task.episode
        assert ep is not None and set(ep.ended) <= {"done", "max_turns", "budget"}
        assert all(0.0 <= x <= 1.0 for x in t.rewards)
        for s in t.rollout.samples:
            assert 1 <= len(s.turns) <= 2 and s.turns[0].observation  # the tests' results
            mask = np.frombuffer(s.mask, dtype=np.uint8)
            assert (mask == 0).any() == (len(s.turns) == 2)
    assert any(len(s.turns) == 2 for t in trajectories for s in t.rollout.samples)
    metrics = done.metrics()
    assert metrics and metrics[0].groups >= 1
