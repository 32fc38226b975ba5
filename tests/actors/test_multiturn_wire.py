"""Context by reference on the wire (runtime/contexts.py): a multi-turn episode's turns
carry what they added plus the names of the stored parts, never the whole context again;
the learner's trajectory is the same, token for token; nothing is lost on a reclaimed turn
and nothing is left behind when the episode ends. Real Redis, real actors and runtime, the
process sandbox; the model is :class:`streamrl.testing.episodes.BulkEngine`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import trio

from streamrl.actors.episodes import EpisodeSessions
from streamrl.actors.executor import Executor, Sandboxes
from streamrl.actors.generator import Generator
from streamrl.actors.scheduler import make_task
from streamrl.actors.verifier import Verifier
from streamrl.config.schema import DomainConfig
from streamrl.domains.registry import get_domain
from streamrl.models import load_tokenizer, resolve_model
from streamrl.protocol import names as N
from streamrl.protocol.messages import Sample, Sampling, Task, Trajectory
from streamrl.queues.client import RedisClient
from streamrl.queues.codec import decode, encode
from streamrl.queues.payloads import PayloadLimits, resolve
from streamrl.queues.streams import FIELD, ConsumerSettings, Producer, open_stream_consumer
from streamrl.runtime.policies import Policies, RetryPolicy
from streamrl.runtime.serve import ActorRuntime, RuntimeSettings
from streamrl.testing.episodes import BulkEngine, WireMeter, bulk_domain, play_in_process
from streamrl.testing.wait import wait_until

TURNS = 4


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model("tiny"))


@pytest.fixture
def domain() -> Iterator[str]:
    with bulk_domain(TURNS) as name:
        yield name


def executor(domain: str, turns: int = TURNS) -> Executor:
    sandboxes = Sandboxes("process")
    return Executor(sandboxes, EpisodeSessions(sandboxes), {domain: DomainConfig(max_turns=turns)})


def task_of(domain: str, group: int) -> Task:
    item = next(i for i in get_domain(domain).load_items("train") if i.kind == "count_matching")
    return make_task(domain, item, split="train", group_size=group,
                     sampling=Sampling(max_new_tokens=1 << 16), version=0)


async def serve(actor: Any, client: RedisClient, names: N.Names, meter: WireMeter | None = None,
                name: str | None = None, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    settings = ConsumerSettings(block_ms=50, reclaim_min_idle_ms=500, trim_interval_s=0)
    async with open_stream_consumer(client, names, actor.input_stream, stage=actor.stage,
                                    consumer=name, settings=settings) as consumer:
        if meter is not None:
            meter.wrap(consumer)
        runtime = ActorRuntime(consumer, actor, Policies(retry=RetryPolicy(2, 0.05, 0.1)),
                               RuntimeSettings(concurrency=2, heartbeat_interval_s=0.2,
                                               reclaim_interval_s=0.2))
        await runtime.serve(task_status=task_status)


async def trajectory(client: RedisClient, names: N.Names) -> Trajectory:
    async def one() -> bool:
        return int(await client.call(client.sync.xlen, names.stream(N.TRAJECTORIES))) >= 1

    await wait_until(one, timeout=120)
    key = names.stream(N.TRAJECTORIES)
    [(entry, fields)] = await client.call(client.sync.xrange, key)
    [got] = resolve(client.sync, [(entry, fields[FIELD])], PayloadLimits(), stream_key=key)
    assert got.payload is not None, got.error  # a long one goes by claim check
    return decode(got.payload, Trajectory)


async def context_keys(client: RedisClient, names: N.Names) -> list[bytes]:
    return list(await client.call(client.sync.keys, names.context("*")))


def whole(s: Sample) -> tuple[Any, ...]:
    return (s.tokens, s.logprobs, s.mask, s.versions, s.turns, s.text, s.finish_reason,
            s.weight_version)


async def test_an_episode_by_reference_trains_on_the_same_tokens(
    client: RedisClient, names: N.Names, tokenizer: Any, domain: str
) -> None:
    # Given the same episode played twice: through the handlers with whole messages (the
    # wire before), and through Redis by reference
    task = task_of(domain, group=3)
    ex_old = executor(domain)
    async with ex_old.sandboxes.opened():
        old, old_sizes = await play_in_process(Generator(BulkEngine(512), tokenizer), ex_old,
                                               task, TURNS)
    meter, ex = WireMeter(), executor(domain)
    async with ex.sandboxes.opened(), trio.open_nursery() as nursery:
        for actor in (Generator(BulkEngine(512), tokenizer), ex, Verifier()):
            await nursery.start(serve, actor, client, names, meter)
        await Producer(client, names).publish(N.TASKS, [encode(task)])
        traj = await trajectory(client, names)
        nursery.cancel_scope.cancel()
    # Then the learner's trajectory carries the whole context, token for token the same
    assert [whole(s) for s in traj.rollout.samples] == [whole(s) for s in old.rollout.samples]
    assert all(len(s.tokens) // 4 > TURNS * 512 for s in traj.rollout.samples)
    assert traj.rollout.task.episode is not None and traj.rollout.task.episode.context == []
    # And every turn wrote about the same (what it added), where whole messages grew
    assert sorted(meter.turns) == list(range(1, TURNS + 1))
    assert max(meter.turns.values()) < 1.2 * min(meter.turns.values())
    assert old_sizes[TURNS] > 3 * old_sizes[1] and meter.turns[TURNS] < old_sizes[TURNS] / 2
    # the turn messages in the streams name the stored parts instead
    for _, fields in await client.call(client.sync.xrange, names.stream(N.ROLLOUTS)):
        rollout = msgspec.msgpack.decode(fields[FIELD])
        assert len(rollout["task"]["episode"].get("context", [])) < TURNS
    # And the episode's stored context is gone with its end (no leak)
    assert await context_keys(client, names) == []


async def test_a_reclaimed_turn_still_finds_its_context(
    client: RedisClient, names: N.Names, tokenizer: Any, domain: str
) -> None:
    # Given generator A that dies in the middle of turn 3 (its entry left pending)
    held = BulkEngine(256, hold_turn=3)
    ex = executor(domain)
    a = trio.CancelScope()

    async def generator_a(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with a:
            await serve(Generator(held, tokenizer), client, names, name="gen-a",
                        task_status=task_status)

    async with ex.sandboxes.opened(), trio.open_nursery() as nursery:
        await nursery.start(generator_a)
        for actor in (ex, Verifier()):
            await nursery.start(serve, actor, client, names)
        task = task_of(domain, group=2)
        await Producer(client, names).publish(N.TASKS, [encode(task)])
        await wait_until(lambda: _true(held.calls >= 3), timeout=60)
        a.cancel()  # killed mid-turn: turn 3's task stays pending in its name
        assert len(await context_keys(client, names)) == 1
        # When generator B starts: its reclaimer takes turn 3 over from the dead consumer
        await nursery.start(serve, Generator(BulkEngine(256), tokenizer), client, names, None,
                            "gen-b")
        traj = await trajectory(client, names)
        nursery.cancel_scope.cancel()
    # Then turn 3 was generated from its whole stored context, and the episode finished
    assert all(len(s.turns) == TURNS for s in traj.rollout.samples)
    assert all(len(s.tokens) // 4 > TURNS * 256 for s in traj.rollout.samples)
    assert await context_keys(client, names) == []


async def _true(value: bool) -> bool:
    return value


async def test_a_256k_token_context_goes_through_in_turn_sized_messages(
    client: RedisClient, names: N.Names, tokenizer: Any
) -> None:
    turns, per_turn, group = 8, 32 * 1024, 2
    with bulk_domain(turns, "bulk_256k_test") as domain:
        meter, ex = WireMeter(), executor(domain, turns)
        async with ex.sandboxes.opened(), trio.open_nursery() as nursery:
            for actor in (Generator(BulkEngine(per_turn), tokenizer), ex, Verifier()):
                await nursery.start(serve, actor, client, names, meter)
            await Producer(client, names).publish(N.TASKS, [encode(task_of(domain, group))])
            traj = await trajectory(client, names)
            nursery.cancel_scope.cancel()
    # Then each member's context holds 256k tokens and more, all in the trajectory ...
    assert all(len(s.tokens) // 4 > 256 * 1024 for s in traj.rollout.samples)
    # ... while no turn wrote more than twice what it added (inline, then as the part) for
    # the group: never the whole context (that one payload is the verifier's trajectory)
    added = group * per_turn * 13  # bytes per token: id, logprob, mask, version + framing
    assert max(meter.turns.values()) < 2.2 * added
    assert meter.final > turns * added
    assert await context_keys(client, names) == []
